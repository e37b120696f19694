"""Lease-before-op for LangChain tools: every tool call is fenced on its own.

:func:`fence_tools` returns copies of LangChain tools whose calls run under the lease of the
step that calls them (a ``ToolNode`` of a graph passed through ``fence_graph()``, a
``create_react_agent``-style loop, or any fenced node that calls ``tool.ainvoke()``):

* the whole call runs with the step's lease held (beside a wait of the step for remote
  children, which may have yielded it, it is taken again first);
* before the tool's body: the lease must be held (``assert_held``, no I/O); a write tool
  (``IDEMPOTENT_WRITE``, ``NON_IDEMPOTENT_WRITE``) adds an entry of its own to the lease's
  stamp set and renews, in ONE guarded write, so a worker that lost the lease stamps
  nothing and raises before the side effect. ``READ_ONLY`` tools cost no extra write;
* each call's entry names the tool (``"<node>:<tool>"``) and the step's task; parallel
  calls of one step each have their own, so none clears another's, and the entries are
  cleared once the step's writes are seen by a resume;
* a non-idempotent tool that raises surfaces :class:`WriteDeadLetteredError` (an
  :class:`~langgraph_fence.ExecutionDeadLetteredError`): never retried, never turned into a
  ``ToolMessage`` the model could answer by calling the tool again.

The guarantee is **at most once, not exactly once**: a write that completed but whose step
did not record its writes is dead-lettered, never repeated.
"""

from __future__ import annotations

import functools
import logging
import threading
import uuid
from collections.abc import Awaitable, Callable, Iterable, Mapping
from contextvars import ContextVar
from typing import Any, cast

from langchain_core.tools import BaseTool, StructuredTool
from langchain_core.tools import tool as create_tool
from langgraph.config import get_config
from langgraph.errors import GraphBubbleUp, GraphInterrupt

from langgraph_fence._compat import paused_at_first_interrupt
from langgraph_fence.effects import EFFECT_ATTRIBUTE, Effect, EffectLike, as_effect
from langgraph_fence.errors import (
    ExecutionContextUnavailableError,
    WriteDeadLetteredError,
    find_fence_error,
)
from langgraph_fence.from_thread import run_on_loop
from langgraph_fence.lease import PendingEffect
from langgraph_fence.steps.context import (
    ExecutionContext,
    StampAt,
    current_frame,
    defer_stamp,
    effect_began,
    handle_of,
    reset_deferred,
    superstep_of,
)
from langgraph_fence.steps.nodes import check_stamp_at

__all__ = ["fence_tools"]

logger = logging.getLogger("langgraph_fence.tools")

#: Set on the class of a fenced tool; where its write is stamped (``"body"``/``"effect"``).
STAMP_ATTRIBUTE = "__langgraph_fence_stamp__"


# The tool whose async path has already fenced this call: its body may run through the
# sync path in a worker thread (BaseTool._arun -> run_in_executor(self._run)), which must
# not stamp a second time.
_fenced_call: ContextVar[BaseTool | None] = ContextVar("langgraph_fence_tool_call", default=None)


def _frame(tool: BaseTool) -> ExecutionContext:
    frame = current_frame()
    if frame is None:
        raise ExecutionContextUnavailableError(
            f"tool {tool.name!r} was called outside a fenced step: a fenced tool runs inside "
            "a node wrapped with fence_graph() or @fenced (put the ToolNode in a graph passed "
            "through fence_graph()), in a run started with Instance.ainvoke()/astream(), or "
            "in a test with langgraph_fence.testing.run_node()"
        )
    return frame


def _effect_of(tool: BaseTool) -> Effect:
    return cast(Effect, getattr(type(tool), EFFECT_ATTRIBUTE))


def _refuse_repeat(frame: ExecutionContext, tool: BaseTool) -> None:
    """In-process recovery: a retried attempt never runs after a non-idempotent tool call.

    A ``RetryPolicy`` retries the whole step: the tools it already called would be called
    again. If a non-idempotent tool of an earlier attempt of this task stamped the lease and
    the stamp still stands, nothing of this attempt runs.
    """
    handle = handle_of(frame)
    standing = handle.standing_non_idempotent(frame.task_id)
    if standing is None:
        return
    stamped_in = handle.tool_stamp_attempts.get(frame.task_id)
    if stamped_in is not None and stamped_in < frame.attempt:
        raise handle.record_dead_letter(
            WriteDeadLetteredError(
                f"node {frame.node!r} of execution {handle.scope_key!r} is being retried "
                f"(attempt {frame.attempt}) after a non-idempotent tool call {standing.node!r} "
                f"of attempt {stamped_in} (token {standing.token}) that may have happened: tool "
                f"{tool.name!r} does not run, nothing is repeated, and the execution is "
                "dead-lettered"
            )
        )


async def _stamp(frame: ExecutionContext, tool: BaseTool, effect: Effect) -> PendingEffect:
    """Add this call's entry to the stamp set and renew, in one guarded write; the entry."""
    handle = handle_of(frame)
    stamp = PendingEffect(
        effect,
        f"{frame.node}:{tool.name}",
        frame.task_id,
        handle.token,
        superstep_of(frame),
        call=f"{tool.name}/{uuid.uuid4().hex[:12]}",
    )
    await handle.mark_pending_effect(stamp)
    if effect is Effect.NON_IDEMPOTENT_WRITE:
        handle.tool_stamp_attempts.setdefault(frame.task_id, frame.attempt)
    return stamp


def _stamp_from_thread(frame: ExecutionContext, tool: BaseTool, effect: Effect) -> PendingEffect:
    """Stamp from a worker thread (a sync tool): the guarded write runs on the run's loop."""
    return run_on_loop(
        handle_of(frame).loop,
        lambda: _stamp(frame, tool, effect),
        what=f"tool {tool.name!r} ({effect.value}) stamping its call",
        on_loop="call `await tool.ainvoke(...)` from async code instead of a blocking "
        "tool.invoke()",
    )


def _stands(frame: ExecutionContext, made: list[PendingEffect]) -> bool:
    """Whether the entry this call made (if it made one) still stands in the stamp set."""
    return any(entry.key in handle_of(frame).pending_effects for entry in made)


def _paused_before_its_write(
    frame: ExecutionContext, made: list[PendingEffect], paused: BaseException
) -> bool:
    """Whether this call's stamp may be released at its pause: it stands, the step never
    entered ``side_effect()``, and the call paused at its task's own first ``interrupt()``
    with no answer consumed in this attempt (as a node's pause). Anything else
    keeps the stamp: the resume is then dead-lettered, never repeated."""
    if not _stands(frame, made) or effect_began(frame):
        return False
    try:
        configurable = get_config().get("configurable") or {}
    except RuntimeError:  # no runnable context: nothing proves where it paused
        return False
    return paused_at_first_interrupt(configurable, paused)


def _refuse_after_write(
    frame: ExecutionContext,
    tool: BaseTool,
    effect: Effect,
    exc: Exception,
    made: list[PendingEffect],
) -> None:
    """Raise the error a failed call raises instead of ``exc`` (from it), if there is one;
    else return, for ``exc`` to go on as it is.

    A fencing error (anywhere in ``exc``), an error already recorded on the run, and an
    interrupt (``GraphBubbleUp``) go on as they are; the node wrapper and the instance put
    the fencing error first. Any other failure of a non-idempotent call whose entry (in
    ``made``) stands is dead-lettered. One that failed before its stamp (a ``stamp_at_effect``
    tool that never entered ``side_effect()``) wrote nothing: its error goes on as it is,
    and the call is safe to repeat.
    """
    stamped = _stands(frame, made)
    if effect is not Effect.NON_IDEMPOTENT_WRITE or not stamped:
        return
    if isinstance(exc, (WriteDeadLetteredError, GraphBubbleUp)):
        return
    handle = handle_of(frame)
    if find_fence_error(exc) is not None or handle.error is not None:
        return
    dead = WriteDeadLetteredError(
        f"tool {tool.name!r} of node {frame.node!r} of execution {handle.scope_key!r} failed "
        f"during a non-idempotent write (token {handle.token}): {type(exc).__name__}: {exc}. "
        "The write may have happened, so it is neither retried nor reported to the model as "
        "a tool error; the execution is dead-lettered"
    )
    raise handle.record_dead_letter(dead) from exc


def _call_sync(tool: BaseTool, body: Callable[[], Any]) -> Any:
    if _fenced_call.get() is tool:
        # The async path fenced this call and runs its body here, in a worker thread. A call
        # the body makes to this same tool is fenced again.
        _fenced_call.set(None)
        return body()
    frame = _frame(tool)
    # The whole call (stamp and body) is counted among the tree's running parts: a wait of
    # this step for remote children (another task of it) yields nothing until it ends, and
    # a lease yielded already is taken again before the stamp.
    with handle_of(frame).activity.held_from_thread(
        what=f"tool {tool.name!r} taking its step's yielded lease again",
        on_loop="call `await tool.ainvoke(...)` from async code instead of a blocking "
        "tool.invoke()",
    ):
        return _run_sync(frame, tool, body)


def _run_sync(frame: ExecutionContext, tool: BaseTool, body: Callable[[], Any]) -> Any:
    effect = _effect_of(tool)
    frame.fence.assert_held()
    handle_of(frame).check_alive()  # a dead-lettered run runs no tool body, whoever retries
    _refuse_repeat(frame, tool)
    made = [_stamp_from_thread(frame, tool, effect)] if effect.is_write else []
    try:
        return body()
    except GraphInterrupt as paused:
        if _paused_before_its_write(frame, made, paused):
            # As in _run_async, released from this thread.
            handle, keys = handle_of(frame), [entry.key for entry in made]
            run_on_loop(
                handle.loop,
                lambda: handle.clear_pending_effects(keys),
                what=f"tool {tool.name!r} releasing its stamp at interrupt()",
                on_loop="call `await tool.ainvoke(...)` from async code instead",
            )
        raise
    except Exception as exc:
        _refuse_after_write(frame, tool, effect, exc, made)
        raise


async def _call_async(tool: BaseTool, body: Callable[[], Awaitable[Any]]) -> Any:
    frame = _frame(tool)
    # As in _call_sync: the call keeps the lease held (re-taken first if yielded).
    async with handle_of(frame).activity.held():
        return await _run_async(frame, tool, body)


async def _run_async(
    frame: ExecutionContext, tool: BaseTool, body: Callable[[], Awaitable[Any]]
) -> Any:
    effect = _effect_of(tool)
    frame.fence.assert_held()
    handle_of(frame).check_alive()  # a dead-lettered run runs no tool body, whoever retries
    _refuse_repeat(frame, tool)
    deferred = None
    made: list[PendingEffect] = []  # this call's entry, once stamped
    if effect.is_write:
        if getattr(type(tool), STAMP_ATTRIBUTE) == "body":
            made.append(await _stamp(frame, tool, effect))
        else:
            # Stamped where the body enters side_effect(): an approval before it is safe.
            async def stamp_at_effect() -> None:
                made.append(await _stamp(frame, tool, effect))

            deferred = defer_stamp(stamp_at_effect)
    reset = _fenced_call.set(tool)
    try:
        return await body()
    except GraphInterrupt as paused:
        if deferred is None and _paused_before_its_write(frame, made, paused):
            # The call paused at its task's first interrupt() (an approval): LangGraph runs
            # it again from its start on resume, and its write comes after the interrupt().
            # The stamp made before its body is released; the resumed call stamps anew. A
            # stamp_at_effect tool's entry (side_effect() entered) stands: its write began.
            await handle_of(frame).clear_pending_effects([entry.key for entry in made])
        raise
    except Exception as exc:
        _refuse_after_write(frame, tool, effect, exc, made)
        raise
    finally:
        _fenced_call.reset(reset)
        if deferred is not None:
            reset_deferred(deferred)


_classes: dict[tuple[type[BaseTool], Effect, StampAt], type[BaseTool]] = {}
_classes_lock = threading.Lock()


def _fenced_class(cls: type[BaseTool], effect: Effect, stamp: StampAt) -> type[BaseTool]:
    """``cls`` with its ``_run``/``_arun`` fenced; everything else inherited unchanged.

    The overrides carry the parent's signature and annotations (``functools.wraps``), so
    ``BaseTool.run``/``arun`` pass ``config`` and ``run_manager`` exactly as before. Only
    an ``_arun`` the class implements itself is overridden: a class that runs its sync body
    in a thread keeps doing so, and that body is fenced.
    """
    with _classes_lock:
        cached = _classes.get((cls, effect, stamp))
        if cached is not None:
            return cached
        parent_run = cls._run
        namespace: dict[str, Any] = {
            "__module__": cls.__module__,
            EFFECT_ATTRIBUTE: effect,
            STAMP_ATTRIBUTE: stamp,
        }

        @functools.wraps(parent_run)
        def _run(self: BaseTool, *args: Any, **kwargs: Any) -> Any:
            return _call_sync(self, lambda: parent_run(self, *args, **kwargs))

        namespace["_run"] = _run
        if cls._arun is not BaseTool._arun:
            parent_arun = cls._arun

            @functools.wraps(parent_arun)
            async def _arun(self: BaseTool, *args: Any, **kwargs: Any) -> Any:
                return await _call_async(self, lambda: parent_arun(self, *args, **kwargs))

            namespace["_arun"] = _arun
        metaclass: Any = type(cls)  # pydantic's model metaclass: the subclass is a model too
        fenced_cls = cast(type[BaseTool], metaclass(cls.__name__, (cls,), namespace))
        fenced_cls.__qualname__ = cls.__qualname__
        _classes[(cls, effect, stamp)] = fenced_cls
        return fenced_cls


def _runs_async(tool: BaseTool) -> bool:
    """Whether the tool's async path runs its own coroutine (not its sync body in a thread)."""
    if isinstance(tool, StructuredTool):
        return tool.coroutine is not None
    return type(tool)._arun is not BaseTool._arun


def _as_tool(candidate: object, index: int) -> BaseTool:
    if isinstance(candidate, BaseTool):
        return candidate
    if callable(candidate) and not isinstance(candidate, type):
        # As ToolNode does with a plain function.
        return create_tool(cast(Callable[..., Any], candidate))
    raise ValueError(
        f"tools[{index}] must be a LangChain tool (a BaseTool or an @tool function) or a plain "
        f"function, got {candidate!r}"
    )


def fence_tools(
    tools: Iterable[BaseTool | Callable[..., Any]],
    effects: Mapping[str, EffectLike] | None = None,
    *,
    stamp_at_effect: Iterable[str] = (),
) -> list[BaseTool]:
    """Fence LangChain tools: each call runs lease-before-op under the calling step's lease.

    Pass the result to ``ToolNode`` (or a model's ``bind_tools``) in place of the tools, in a
    graph passed through ``fence_graph()`` and run by ``Instance``. Each returned tool keeps
    the original's name, description, argument schema, sync/async support and
    ``ToolMessage``/``tool_call_id`` behaviour; only its body is fenced.

    Guarantees, per tool call:

    * the body starts only while the step's lease is held; a write tool first stamps
      ``pending_effect`` (effect, ``"<node>:<tool>"``, the step's task id, token) and renews
      in one guarded write, so a worker that lost the lease stamps nothing and raises
      :class:`~langgraph_fence.ExecutionFencedError` before the side effect. ``READ_ONLY``
      tools make no write;
    * each call's entry is its own: parallel calls of one step (and of parallel steps) never
      clear one another's, and a takeover dead-letters while any non-idempotent call's
      entry stands; the entries are cleared once the step's writes are seen by a resume
      (in the same transaction with ``SqlCheckpointer``);
    * a ``NON_IDEMPOTENT_WRITE`` call that raises surfaces :class:`WriteDeadLetteredError`
      (never retried by a ``RetryPolicy``, never turned into a ``ToolMessage`` whatever
      ``ToolNode``'s ``handle_tool_errors`` says), and a retried attempt of a step whose
      non-idempotent call already stamped runs nothing. A fencing error is re-raised as it
      is; the node wrapper raises it even where a ``ToolNode`` caught it.

    Limits: **at most once, not exactly once**. A write that completed but whose step did not
    record its writes (crash, takeover) is dead-lettered, never repeated, never confirmed.
    Exactly-once needs an external system that checks the token (see
    :mod:`langgraph_fence.sinks`). A ``READ_ONLY`` call checks the lease locally only, so a
    read may still run just after another worker took over (reads are safe to repeat).

    Args:
        tools: ``BaseTool`` instances, ``@tool`` functions, or plain functions (made into
            tools as ``ToolNode`` does).
        effects: each tool's effect by tool name. Undeclared tools are
            ``NON_IDEMPOTENT_WRITE`` (fail-closed).
        stamp_at_effect: names of async write tools stamped where their body enters
            ``async with get_execution_context().side_effect():`` instead of before the
            body (a failure before it is then retried, not dead-lettered). A call that
            pauses at ``interrupt()`` before its write (LangGraph's approval pattern) has
            its stamp released at the pause and taken anew when it runs again on resume;
            an ``interrupt()`` after ``side_effect()`` was entered dead-letters the
            execution at once (its resume would repeat the write).

    Returns:
        The fenced tools, in the order given.

    Raises:
        ValueError: a tool that is not a tool or a function, two tools with one name, a tool
            fenced already, ``effects`` naming a tool not in ``tools``, or a value in
            ``effects`` that is not an :class:`Effect`.
    """
    if isinstance(tools, str | bytes | Mapping | BaseTool) or not isinstance(tools, Iterable):
        raise ValueError(f"tools must be a list of LangChain tools or functions, got {tools!r}")
    if effects is not None and not isinstance(effects, Mapping):
        raise ValueError(f"effects must map tool names to Effect values, got {effects!r}")
    declared = dict(effects or {})
    converted = [_as_tool(candidate, index) for index, candidate in enumerate(tools)]
    seen: set[str] = set()
    for tool in converted:
        if tool.name in seen:
            raise ValueError(
                f"duplicate tool name {tool.name!r}: a model calls tools by name, so each "
                "name must be unique"
            )
        seen.add(tool.name)
        if hasattr(type(tool), EFFECT_ATTRIBUTE):
            raise ValueError(
                f"tool {tool.name!r} is fenced already: pass the original tool to fence_tools()"
            )
    unknown = sorted(name for name in declared if name not in seen)
    if unknown:
        raise ValueError(
            f"effects names tools not in the list: {unknown}; the tools are {sorted(seen)}"
        )
    by_tool: dict[str, Effect] = {
        name: as_effect(effect, name=f"effects[{name!r}]") for name, effect in declared.items()
    }
    if isinstance(stamp_at_effect, str) or not isinstance(stamp_at_effect, Iterable):
        raise ValueError(f"stamp_at_effect must be a list of tool names, got {stamp_at_effect!r}")
    deferred = set(stamp_at_effect)
    unknown = sorted(name for name in deferred if name not in seen)
    if unknown:
        raise ValueError(
            f"stamp_at_effect names tools not in the list: {unknown}; the tools are {sorted(seen)}"
        )
    fenced: list[BaseTool] = []
    for tool in converted:
        effect = by_tool.get(tool.name, Effect.NON_IDEMPOTENT_WRITE)
        stamp: StampAt = "body"
        if tool.name in deferred:
            stamp = check_stamp_at("effect", effect, name=f"stamp_at_effect[{tool.name!r}]")
            if not _runs_async(tool):
                raise ValueError(
                    f"stamp_at_effect names {tool.name!r}, a sync tool: side_effect() is an "
                    "async context manager; give the tool a coroutine, or stamp it before "
                    "its body"
                )
        copy = tool.model_copy()
        # Same fields, same state, a class whose _run/_arun are fenced (see _fenced_class).
        object.__setattr__(copy, "__class__", _fenced_class(type(tool), effect, stamp))
        fenced.append(copy)
    return fenced

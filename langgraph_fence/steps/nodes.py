"""The node wrapper: every fenced step runs in a frame under the run's live lease.

Before the body: the lease must be held (``assert_held``, no I/O); a write step stamps
``pending_effect`` and renews in one guarded write, so a worker that lost the lease stamps
nothing and stops before the side effect. During the body: the frame is the current
:class:`~langgraph_fence.ExecutionContext`; losing the lease cancels the step. After it: the
frame's fence refuses, and a fencing error (found anywhere in the failure's chain) is
recorded on the run and raised in place of anything else.
"""

from __future__ import annotations

import asyncio
import functools
import inspect
import logging
from collections.abc import Awaitable, Callable, Mapping, Sequence
from typing import Any, TypeVar, overload

from langchain_core.runnables import RunnableConfig
from langgraph.config import get_config
from langgraph.errors import GraphBubbleUp, GraphInterrupt
from langgraph.types import RetryPolicy

from langgraph_fence._compat import paused_at_first_interrupt, pregel_runtime, pregel_task_id
from langgraph_fence.effects import EFFECT_ATTRIBUTE, Effect, EffectLike, as_effect
from langgraph_fence.errors import (
    ExecutionContextUnavailableError,
    ExecutionDeadLetteredError,
    WriteDeadLetteredError,
    find_error,
    find_fence_error,
)
from langgraph_fence.fence import ExecutionFence, RunHandle, close_fence
from langgraph_fence.from_thread import run_on_loop
from langgraph_fence.keys import FENCE_CONFIG_KEY
from langgraph_fence.lease import PendingEffect
from langgraph_fence.lease.faults import fault_point
from langgraph_fence.steps.context import (
    CONTEXT_CONFIG_KEY,
    STAMP_AT,
    ExecutionContext,
    StampAt,
    defer_stamp,
    effect_began,
    reset_deferred,
    reset_frame,
    set_frame,
)

__all__ = ["check_stamp_at", "fenced", "guard_retry_policy", "wrap_step"]

logger = logging.getLogger("langgraph_fence.nodes")

F = TypeVar("F", bound=Callable[..., Any])


def _configurable(config: Any) -> dict[str, Any]:
    # dict first: LangGraph's configs are dicts, and the Mapping check is an ABC's
    # (several times slower), paid on every step.
    if not isinstance(config, (dict, Mapping)):
        return {}
    configurable = config.get("configurable")
    return configurable if isinstance(configurable, dict) else {}


def _step_config(node: str, kwargs: Mapping[str, Any]) -> RunnableConfig:
    config = kwargs.get("config")
    if isinstance(config, (dict, Mapping)) and isinstance(config.get("configurable"), dict):
        return config  # type: ignore[return-value]
    try:
        return get_config()
    except RuntimeError:
        raise ExecutionContextUnavailableError(
            f"node {node!r} ran outside a LangGraph run and without a held lease: run the "
            "graph with Instance.ainvoke()/astream(), or test the node with "
            "langgraph_fence.testing.run_node()"
        ) from None


def handle_of(config: Any, *, node: str) -> RunHandle:
    """The run handle in ``config``, or a clear refusal."""
    return _handle_in(_configurable(config), node=node)


def _handle_in(configurable: Mapping[str, Any], *, node: str) -> RunHandle:
    handle = configurable.get(FENCE_CONFIG_KEY)
    if handle is None:
        raise ExecutionContextUnavailableError(
            f"node {node!r} ran without a held lease: run the graph with "
            "Instance.ainvoke()/astream() (which acquires the lease), or test the node with "
            "langgraph_fence.testing.run_node()"
        )
    if not isinstance(handle, RunHandle):
        raise ValueError(
            f"config['configurable'][{FENCE_CONFIG_KEY!r}] holds a {type(handle).__name__}, "
            "not a RunHandle: that key is reserved for langgraph-fence; do not set it yourself"
        )
    return handle


class _Step:
    """One step's frame: entered before the body, left after it, on every path."""

    __slots__ = (
        "_cancelled",
        "_counted",
        "_deferred",
        "_reset",
        "_task",
        "_unsubscribe",
        "config",
        "configurable",
        "effect",
        "frame",
        "handle",
        "label",
        "node",
        "stamp_at",
        "task_id",
    )

    def __init__(
        self,
        node: str,
        effect: Effect,
        config: RunnableConfig,
        stamp_at: StampAt = "body",
        *,
        label: str,
    ) -> None:
        self.node = node
        self.effect = effect
        self.config = config
        self.stamp_at = stamp_at
        self.label = label  # the fence's name in its errors
        # The task's own configurable dict: read once here, written once (the frame).
        configurable = _configurable(config)
        self.configurable = configurable
        self.handle = _handle_in(configurable, node=node)
        # The task's id keys the step's stamp; the node's name outside a LangGraph task.
        self.task_id = pregel_task_id(configurable) or node
        self._deferred: Any = None
        self._reset: Any = None
        self._unsubscribe: Callable[[], None] | None = None
        self._task: asyncio.Task[Any] | None = None
        self._cancelled = False
        self._counted = False
        self.frame: ExecutionContext | None = None

    def _pending(self) -> PendingEffect:
        return PendingEffect(
            self.effect, self.node, self.task_id, self.handle.token, self._superstep()
        )

    def _superstep(self) -> str:
        checkpoint_map = self.configurable.get("checkpoint_map")
        if isinstance(checkpoint_map, (dict, Mapping)):
            return str(checkpoint_map.get("") or "")
        return ""

    def _attempt(self) -> int:
        runtime = pregel_runtime(self.configurable)
        info = getattr(runtime, "execution_info", None)
        return int(getattr(info, "node_attempt", 1) or 1)

    def _enter_frame(self) -> None:
        configurable = self.configurable
        fence = ExecutionFence(self.handle, label=self.label)
        # Positional (fence, node, task_id, attempt, checkpoint_ns, thread_id, effect,
        # _handle, _superstep): a third cheaper than by keyword, on every step.
        self.frame = ExecutionContext(
            fence,
            self.node,
            self.task_id,
            self._attempt(),
            str(configurable.get("checkpoint_ns", "")),
            str(configurable.get("thread_id", "")),
            self.effect,
            self.handle,
            self._superstep(),
        )
        # The task's configurable dict is its own: the frame is visible to the node through
        # its config and get_config(), and does not leak into the next step or the saver.
        configurable[CONTEXT_CONFIG_KEY] = self.frame
        self._reset = set_frame(self.frame)

    def _refuse_repeat(self) -> None:
        """In-process recovery: never run a non-idempotent write again in the same run.

        Checked for every step, not only write steps: a read-only node may call a fenced
        tool that stamped a non-idempotent write in an earlier attempt of this task.
        """
        standing = self.handle.standing_non_idempotent(self.task_id)
        if standing is not None:
            raise self.handle.record_dead_letter(
                WriteDeadLetteredError(
                    f"node {standing.node!r} of execution {self.handle.scope_key!r} is a "
                    f"non-idempotent write whose earlier attempt (token {standing.token}) may have "
                    "happened: it is not repeated; the execution is dead-lettered"
                )
            )

    async def enter_async(self) -> None:
        # Counted among the tree's running steps first: a yielded lease is taken again
        # (epoch + 1) before anything of the step runs (tree_activity.py).
        activity = self.handle.activity
        if not activity.enter_held():
            await activity.enter()
        self._counted = True
        try:
            self._enter_checked()
            if self.effect.is_write:
                if self.stamp_at == "body":
                    await self.handle.mark_pending_effect(self._pending())
                else:
                    # Stamped where the body enters ctx.side_effect(): what runs before it
                    # (an approval, a model call) is safe to repeat.
                    handle, pending = self.handle, self._pending()
                    self._deferred = defer_stamp(lambda: handle.mark_pending_effect(pending))
        except BaseException:
            self._uncount()
            raise
        self._enter_frame()
        task = asyncio.current_task()
        if task is not None:
            self._task = task
            self._unsubscribe = self.handle.on_stop(self._cancel)

    def _cancel(self, error: BaseException) -> None:
        """The run must stop: cancel the step's task."""
        # Once: a lapse (lost) followed by the store's answer (fenced) must not cancel the
        # step's handling of the first cancellation.
        if not self._cancelled and self._task is not None:
            self._cancelled = True
            self._task.cancel(f"langgraph-fence: {error}")

    def enter_sync(self) -> None:
        """Enter from a worker thread (a sync node); guarded writes go to the run's loop."""
        self.handle.activity.enter_from_thread()
        self._counted = True
        try:
            self._enter_checked()
            if self.effect.is_write:
                handle, pending = self.handle, self._pending()
                run_on_loop(
                    handle.loop,
                    lambda: handle.mark_pending_effect(pending),
                    what=f"node {self.node!r} ({self.effect.value}) stamping its write",
                    on_loop="make the node an `async def`, or let LangGraph run it in a "
                    "worker thread (graph.ainvoke/invoke do)",
                )
        except BaseException:
            self._uncount()
            raise
        self._enter_frame()

    def _enter_checked(self) -> None:
        handle = self.handle
        handle.check()
        handle.check_alive()
        if handle.pending_effects:  # nothing stamped in this run: nothing to repeat
            self._refuse_repeat()

    def _released_at_pause(self, exc: BaseException) -> tuple[str, ...]:
        """The key of the entry stamped before this step's body, if ``exc`` is a pause that
        proves its write has not begun: it paused at its own first ``interrupt()`` with no
        answer consumed yet in this attempt, and its body never entered ``side_effect()``.
        Else nothing: the entry stands (and a pause dead-letters the run)."""
        if not isinstance(exc, GraphInterrupt):
            return ()
        if self.stamp_at != "body" or not self.effect.is_write:
            return ()
        entry = self.handle.pending_effects.get(self.task_id)
        if entry is None or entry.call:
            return ()
        frame = self.frame
        if frame is None or effect_began(frame):
            return ()
        if not paused_at_first_interrupt(self.configurable, exc):
            return ()
        return (self.task_id,)

    async def failed(self, exc: BaseException) -> BaseException:
        """What the step raises for ``exc`` (:meth:`failure`). If the body paused at
        ``interrupt()``, the stamp made before it is released first, when that proves the
        write has not begun.

        LangGraph runs a step that paused at ``interrupt()`` again from its start when the
        thread is resumed, and (its docs say) a step's write comes after its
        ``interrupt()``. So a pause at the step's own first ``interrupt()``, with no answer
        consumed and ``side_effect()`` never entered, comes before the write: the resumed
        step stamps anew before it runs. Any other pause (a second interrupt after an
        answer, one raised in a subgraph the step called, one after ``side_effect()``) may
        follow a write: the entry stands.
        """
        keys = self._released_at_pause(exc)
        if keys:
            await self.handle.clear_pending_effects(keys)
        return self.failure(exc)

    def failed_sync(self, exc: BaseException) -> BaseException:
        """:meth:`failed` from a worker thread (a sync node)."""
        keys = self._released_at_pause(exc)
        if keys:
            handle = self.handle
            run_on_loop(
                handle.loop,
                lambda: handle.clear_pending_effects(keys),
                what=f"node {self.node!r} releasing its stamp at interrupt()",
                on_loop="make the node an `async def`",
            )
        return self.failure(exc)

    def _uncount(self) -> None:
        if self._counted:
            self._counted = False
            self.handle.activity.leave()

    def leave(self) -> None:
        self._uncount()
        if self._deferred is not None:
            reset_deferred(self._deferred)
            self._deferred = None
        if self._unsubscribe is not None:
            self._unsubscribe()
            # The unsubscribe holds the listener, a method of this step: dropped here so
            # the step is no reference cycle (the garbage collector's work).
            self._unsubscribe = None
        self._task = None
        if self.frame is not None:
            close_fence(self.frame.fence)
        if self._reset is not None:
            reset_frame(self._reset)
            self._reset = None

    def failure(self, exc: BaseException) -> BaseException:
        """What the step raises for ``exc``: the run's fencing error first, always."""
        found = find_fence_error(exc)
        if found is not None:
            return self.handle.record(found)
        if self.handle.error is not None:
            return self.handle.error
        if self.handle.dead_letter is not None:
            return self.handle.dead_letter  # whatever the step raised after it
        if not isinstance(exc, Exception) or isinstance(exc, ExecutionDeadLetteredError):
            return exc
        paused = isinstance(exc, GraphInterrupt)
        standing = self.handle.standing_non_idempotent(self.task_id) if paused else None
        if standing is not None:
            # interrupt() after a write of this step began: side_effect() was entered, or a
            # tool call of the step wrote, before the pause (a body's own stamp, and a tool
            # call's that paused itself, were released at the interrupt). LangGraph runs the
            # step again from its start on resume, so the write could repeat: say so now.
            dead = WriteDeadLetteredError(
                f"interrupted after a non-idempotent write began: {standing.node!r} of "
                f"execution {self.handle.scope_key!r} (token {self.handle.token}) stamped its "
                f"write before node {self.node!r} called interrupt(), and LangGraph runs the "
                "step again from its start on resume, so the write could repeat; "
                "dead-lettered. Ask for approval before the write: call interrupt() before "
                "side_effect() or the tool call, or in a node of its own before it"
            )
            dead.__cause__ = exc
            return self.handle.record_dead_letter(dead)
        if isinstance(exc, GraphBubbleUp):
            # An interrupt or a drain is control flow, not a failed write.
            return exc
        # Decided by the stamp that stands, not by the declaration: a stamp="effect" step
        # that failed before side_effect() stamped nothing and wrote nothing, so its error
        # goes on as it is (a RetryPolicy may retry it; a resume runs it again).
        if self.handle.standing_non_idempotent(self.task_id) is not None:
            # The stamp stands (this node's, or a tool's it called): the write may have
            # happened. Never retried, never repeated; a GraphBubbleUp, so LangGraph saves no
            # error write that would clear the stamp before the execution is dead-lettered.
            dead = WriteDeadLetteredError(
                f"node {self.node!r} of execution {self.handle.scope_key!r} failed during a "
                f"non-idempotent write (token {self.handle.token}): {type(exc).__name__}: "
                f"{exc}. The write may have happened, so it is not retried; the execution is "
                "dead-lettered"
            )
            dead.__cause__ = exc
            return self.handle.record_dead_letter(dead)
        return exc

    def ended(self, failure: BaseException | None, result: Any) -> Any:
        """The step's ``result``, or ``failure`` raised: outside the except block that found
        it, so the recorded error object is raised as it is."""
        if failure is not None:
            raise failure
        # A dead letter caught inside the step (a try/except around a fenced call) still
        # ends it: the run is dead.
        self.handle.check_alive()
        return result


async def _run_async(
    step: _Step, fn: Callable[..., Awaitable[Any]], args: Any, kwargs: dict[str, Any]
) -> Any:
    await step.enter_async()
    failure: BaseException | None = None
    result: Any = None
    try:
        result = await fn(*args, **kwargs)
        await fault_point("effect.after", node=step.node, handle=step.handle, config=step.config)
    except asyncio.CancelledError:
        if step.handle.error is None:
            raise
        # The run lost its lease and cancelled this step: the fencing error, not the
        # cancellation, is what the step ends with.
        task = asyncio.current_task()
        if task is not None:
            task.uncancel()
        failure = step.handle.error
    except BaseException as exc:
        failure = await step.failed(exc)
        if failure is exc:
            raise
    finally:
        step.leave()
    return step.ended(failure, result)


def _run_sync(step: _Step, call: Callable[[], Any]) -> Any:
    step.enter_sync()
    failure: BaseException | None = None
    result: Any = None
    try:
        result = call()
    except BaseException as exc:
        failure = step.failed_sync(exc)
        if failure is exc:
            raise
    finally:
        step.leave()
    return step.ended(failure, result)


def _wrap_async(
    fn: Callable[..., Awaitable[Any]], node: str | None, effect: Effect, stamp: StampAt = "body"
) -> Any:
    name = node or fn.__name__
    label = f"node {name!r}"

    @functools.wraps(fn)
    async def fenced_node(*args: Any, **kwargs: Any) -> Any:
        step = _Step(name, effect, _step_config(name, kwargs), stamp, label=label)
        return await _run_async(step, fn, args, kwargs)

    setattr(fenced_node, EFFECT_ATTRIBUTE, effect)
    return fenced_node


def _wrap_sync(fn: Callable[..., Any], node: str | None, effect: Effect) -> Any:
    name = node or fn.__name__
    label = f"node {name!r}"

    @functools.wraps(fn)
    def fenced_node(*args: Any, **kwargs: Any) -> Any:
        step = _Step(name, effect, _step_config(name, kwargs), label=label)
        return _run_sync(step, lambda: fn(*args, **kwargs))

    setattr(fenced_node, EFFECT_ATTRIBUTE, effect)
    return fenced_node


def wrap_step(
    fn: Callable[..., Any], node: str, effect: Effect, stamp: StampAt = "body", *, sync: bool
) -> Any:
    """``fn`` run as a fenced step named ``node`` (what :func:`fenced` does to a function):
    ``sync`` for a function that returns its result, else one that returns an awaitable
    (a sync step is stamped before its body: ``side_effect()`` is async)."""
    if sync:
        return _wrap_sync(fn, node, effect)
    return _wrap_async(fn, node, effect, stamp)


def _wrap(fn: Callable[..., Any], node: str | None, effect: Effect, stamp: StampAt) -> Any:
    if inspect.iscoroutinefunction(fn):
        return _wrap_async(fn, node, effect, stamp)
    if stamp != "body":
        raise ValueError(
            f"stamp={stamp!r} needs an async node (side_effect() is an async context "
            f"manager): make {getattr(fn, '__name__', fn)!r} an `async def`, or keep "
            "stamp='body'"
        )
    return _wrap_sync(fn, node, effect)


def check_stamp_at(stamp: object, effect: Effect, *, name: str = "stamp") -> StampAt:
    """``stamp`` if it is a :data:`~langgraph_fence.steps.context.StampAt`, else ``ValueError``."""
    if stamp not in STAMP_AT:
        raise ValueError(f"{name} must be one of {', '.join(STAMP_AT)}, got {stamp!r}")
    if stamp == "effect" and not effect.is_write:
        raise ValueError(
            f"{name}='effect' is for write steps (it defers their stamp); this one is "
            f"{effect.value}: declare its effect, or drop {name}"
        )
    return stamp


@overload
def fenced(fn: F, /) -> F: ...


@overload
def fenced(
    *, effect: EffectLike = Effect.READ_ONLY, name: str | None = None, stamp: StampAt = "body"
) -> Callable[[F], F]: ...


def fenced(
    fn: Callable[..., Any] | None = None,
    /,
    *,
    effect: EffectLike = Effect.READ_ONLY,
    name: str | None = None,
    stamp: StampAt = "body",
) -> Any:
    """Run a node function under the run's lease: ``@fenced`` or ``@fenced(effect=...)``.

    Guarantees: the body starts only while the lease is held; a write step
    (``IDEMPOTENT_WRITE``, ``NON_IDEMPOTENT_WRITE``) first stamps ``pending_effect`` and
    renews in one guarded write, so a worker that lost the lease stops before the side
    effect; the frame (:func:`~langgraph_fence.get_execution_context`) exists for the
    body only; a fencing error anywhere in a failure is raised in its place (the same
    object), and a non-idempotent write that fails once its stamp stands raises
    :class:`~langgraph_fence.ExecutionDeadLetteredError` instead of being retried (a
    ``stamp="effect"`` step that fails before ``side_effect()`` stamped nothing: its error
    is raised as it is, and it may be retried).

    Sync and async functions keep their kind, signature and injected parameters
    (``config``, ``runtime``, ``store``, ``writer``). A fenced node run without a lease
    refuses with :class:`~langgraph_fence.ExecutionContextUnavailableError`.

    Human-in-the-loop works as LangGraph writes it: a step that pauses at ``interrupt()``
    runs again from its start when the thread is resumed, so its write comes after the
    ``interrupt()`` call; the stamp made before the body is released at the pause, and the
    resumed step stamps anew before it runs (an approved resume writes once, a worker
    killed mid-write is never repeated). An ``interrupt()`` after a write of the step began
    (inside or after ``side_effect()``, or after a write tool call of the step) dead-letters
    the execution at once: its resume would repeat the write.

    Args:
        effect: what the node does to the world (default ``READ_ONLY``).
        name: the node's name in frames and stamps (default: the function's name).
        stamp: ``"body"`` (default): a write step is stamped before its body starts.
            ``"effect"`` (async write nodes): stamped where the body enters
            ``async with get_execution_context().side_effect():``; what runs before it
            (an ``interrupt()`` for approval, a model call) is safe to repeat.
    """
    effect = as_effect(effect)
    stamp = check_stamp_at(stamp, effect)
    if fn is not None:
        if not callable(fn):
            raise ValueError(f"fenced() decorates a node function, got {fn!r}")
        return _wrap(fn, name, effect, stamp)

    def decorate(f: Callable[..., Any]) -> Any:
        if not callable(f):
            raise ValueError(f"fenced() decorates a node function, got {f!r}")
        return _wrap(f, name, effect, stamp)

    return decorate


class _FenceGuardedRetryOn:
    """A ``retry_on`` that never retries a fencing error or a dead-lettered write."""

    __slots__ = ("inner",)

    def __init__(self, inner: Any) -> None:
        self.inner = inner

    def __call__(self, exc: Exception) -> bool:
        if find_fence_error(exc) is not None or find_error(exc, ExecutionDeadLetteredError):
            return False
        inner = self.inner
        if isinstance(inner, Sequence):
            return isinstance(exc, tuple(inner))
        if isinstance(inner, type) and issubclass(inner, BaseException):
            return isinstance(exc, inner)
        return bool(inner(exc))


def guard_retry_policy(
    policy: RetryPolicy | Sequence[RetryPolicy] | None,
) -> RetryPolicy | Sequence[RetryPolicy] | None:
    """``policy`` with every ``retry_on`` guarded: fencing errors are never retried."""
    if policy is None:
        return None
    if isinstance(policy, RetryPolicy):
        if isinstance(policy.retry_on, _FenceGuardedRetryOn):
            return policy
        return policy._replace(retry_on=_FenceGuardedRetryOn(policy.retry_on))
    return [guard_retry_policy(p) for p in policy]  # type: ignore[misc]

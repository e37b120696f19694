"""The frame of one running step: its fence, its node, its task, and how to find it."""

from __future__ import annotations

from collections.abc import (
    AsyncIterator,
    Awaitable,
    Callable,
    Collection,
    Mapping,
    Sequence,
)
from contextlib import asynccontextmanager
from contextvars import ContextVar
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Literal

from langgraph_fence.effects import Effect
from langgraph_fence.errors import ExecutionContextUnavailableError
from langgraph_fence.fence import ExecutionFence, RunHandle, enter_step, held, leave_step

if TYPE_CHECKING:
    from langgraph_fence.execution.children import Child, ChildPlacement
    from langgraph_fence.queue import NotBefore

__all__ = [
    "CONTEXT_CONFIG_KEY",
    "STAMP_AT",
    "ExecutionContext",
    "StampAt",
    "get_execution_context",
]

#: Where a write step is stamped: before its whole body (the default, fail-closed), or
#: where its body enters ``side_effect()`` (what runs before, an approval or a
#: model call, is then safe to repeat). See :meth:`ExecutionContext.side_effect`.
StampAt = Literal["body", "effect"]
STAMP_AT: tuple[StampAt, ...] = ("body", "effect")

#: Where the frame is also placed in the step's ``config["configurable"]``.
CONTEXT_CONFIG_KEY = "execution_context"

#: The frame of the step running in this context: set by the node wrapper, read by
#: ``get_execution_context()``.
_current: ContextVar[ExecutionContext | None] = ContextVar(
    "langgraph_fence_execution_context", default=None
)


@dataclass(frozen=True, slots=True, eq=False)
class ExecutionContext:
    """One running step (a node attempt) and the lease it runs under.

    ``fence`` reads the run's lease live and refuses once the step has ended. The frame is
    found with :func:`get_execution_context` (a context variable, so it reaches sync nodes
    in worker threads and subgraphs run inside the node) and at
    ``config["configurable"]["execution_context"]``.

    Attributes:
        fence: the lease this step runs under (the root's, for ParentInstance children).
        node: the node's name.
        task_id: LangGraph's task id of this step.
        attempt: 1 for the first attempt, + 1 per ``RetryPolicy`` retry.
        checkpoint_ns: the step's checkpoint namespace (non-empty inside subgraphs).
        thread_id: the run's thread id.
        effect: what the step declared it does to the world.
    """

    fence: ExecutionFence
    node: str
    task_id: str
    attempt: int
    checkpoint_ns: str
    thread_id: str
    effect: Effect
    _handle: RunHandle
    # The root checkpoint whose superstep this step belongs to (checkpoint_map[""]): the
    # stamps the step makes are cleared by a later root checkpoint.
    _superstep: str = ""
    # Set once the body entered side_effect(): its write began (a pause after it keeps the
    # stamp, so the resume is dead-lettered rather than repeated).
    _began: list[bool] = field(default_factory=list)
    # How many durable sleeps this step attempt asked for: each has its place in the key.
    _sleeps: list[bool] = field(default_factory=list)

    async def sleep(self, until: NotBefore) -> None:
        """Sleep durably until ``until`` (an aware ``datetime``, or a delay in seconds or a
        ``timedelta``), judged by the database's clock: the run gives its lease and its
        worker's slot back now, and any worker's ``serve()`` resumes it at that time, not
        before (at the next token, from the last checkpoint). This step then runs again
        and this call returns at once: put the sleep first in its step, or in a step of
        its own, with nothing before it in the step that must not run twice.

        For a run started with ``Instance.ainvoke`` the call ends the ``ainvoke`` with
        :class:`~langgraph_fence.ExecutionSleeping` (the time it resumes); a worker serving
        its graph resumes it. Needs an instance on a SQL database (``Instance.open``).

        Raises:
            ExecutionSleeping: the sleep is not over: the run stops here (do not catch it).
            ExecutionFencedError: this step's execution was taken over: nothing recorded.
            ValueError, TypeError: a bad ``until``, named.
        """
        from langgraph_fence.execution.children import queue_of
        from langgraph_fence.execution.sleeps import durable_sleep

        async with held(self.fence):
            self.fence.assert_held()
            place = len(self._sleeps)
            self._sleeps.append(True)
            key = f"{self.checkpoint_ns}|{self.task_id}|{place}"
            await durable_sleep(self._handle, queue_of(self._handle), key, until)

    @asynccontextmanager
    async def side_effect(self) -> AsyncIterator[None]:
        """Mark where the step's side effect starts: ``async with ctx.side_effect(): ...``.

        In a write step declared with ``stamp="effect"`` (``@fenced(..., stamp="effect")``,
        ``fence_tools(..., stamp_at_effect=[...])``) the stamp and its renewal (one guarded
        write) happen here, not before the body: what the body does before (an
        ``interrupt()`` asking for approval, a model call) is safe to repeat, and a takeover
        that finds no stamp resumes the step. Inside the block the step is a write in
        flight: a takeover dead-letters it. In a step stamped before its body, the block
        only checks that the lease is held. The block runs with the lease held, also beside
        a wait for remote children of this step (the lease is taken again first).

        Raises:
            ExecutionFencedError: the lease was taken over (nothing was stamped).
            ExecutionContextUnavailableError: called inside another step (an ancestor's
                frame used in a child step).
        """
        # Counted among the tree's running parts for the whole block: a wait of this step
        # for remote children (another task of it) yields nothing while the write runs.
        async with held(self.fence):
            self.fence.assert_held()
            self._began.append(True)
            deferred = _deferred.get()
            if deferred is not None and not deferred.done:
                await deferred.stamp()
                deferred.done = True
            yield

    async def spawn_child(
        self,
        graph_name: str,
        input: Any,
        *,
        placement: ChildPlacement,
        key: str,
        graph: Any = None,
    ) -> Child:
        """Spawn a child execution of this step's execution, once per ``key``.

        ``ChildPlacement.ANY_INSTANCE``: the child is recorded pending (its own execution:
        the parent's tenant, an id derived from the parent's scope key and ``key``) in one
        statement guarded by this step's hold; calls of one run made together
        (``asyncio.gather``) are recorded in one statement per graph name, as
        :meth:`spawn_children` records a batch. Any instance whose ``serve()`` serves
        ``graph_name`` runs it under its own lease and epoch. A re-run of this step (a
        retry, a takeover) finds the child of the same key and spawns nothing new
        (``child.spawned`` is then ``False``).

        ``ChildPlacement.PARENT_INSTANCE``: the child graph starts now in this process, as
        a subgraph of this step with a checkpoint namespace of its own; its steps run under
        the root's lease and token. It is part of this step: a re-run runs it again.

        Args:
            graph_name: the name a worker serves the child's graph under.
            input: the child graph's input (storable data: another process runs it).
            placement: where the child runs.
            key: the child's key, unique among this execution's children.
            graph: for ``PARENT_INSTANCE``, the compiled child graph (default: the one this
                instance serves under ``graph_name``).

        Raises:
            ExecutionFencedError: this step's execution was taken over: nothing spawned.
            ExecutionContextUnavailableError: called inside another step (an ancestor's
                frame used in a child step).
            ValueError, TypeError: a bad argument, named with the fix.
        """
        from langgraph_fence.execution.children import Step, spawn_child

        # The spawn is a write under this step's token: beside a wait of this step for
        # remote children, the yielded lease is taken again first.
        async with held(self.fence):
            return await spawn_child(
                Step(self._handle, self.fence), placement, graph_name, key, input, graph
            )

    async def spawn_children(
        self,
        graph_name: str,
        inputs: Mapping[str, Any],
        *,
        placement: ChildPlacement,
        graph: Any = None,
    ) -> list[Child]:
        """Spawn one child execution per key of ``inputs`` (child key -> the child graph's
        input), as :meth:`spawn_child` does for one, in the order given.

        ``ChildPlacement.ANY_INSTANCE``: every child is recorded pending in ONE statement
        on PostgreSQL (one transaction of a fixed number of statements on SQLite), whatever
        their number, guarded by this step's hold on the parent's row: all are spawned or,
        if this step's execution was taken over, none. A re-run of this step (a retry, a
        takeover) finds the children of the keys it spawned and spawns only the keys that
        are new (``child.spawned`` says which).

        ``ChildPlacement.PARENT_INSTANCE``: each child graph starts now in this process, as
        :meth:`spawn_child` starts one.

        Args:
            graph_name: the name a worker serves the children's graph under.
            inputs: child key (unique among this execution's children) -> its input
                (storable data: another process runs it).
            placement: where the children run.
            graph: for ``PARENT_INSTANCE``, the compiled child graph (default: the one this
                instance serves under ``graph_name``).

        Raises:
            ExecutionFencedError: this step's execution was taken over: nothing spawned.
            ValueError, TypeError: a bad argument or an input that cannot be recorded,
                named with the fix; nothing spawned.
        """
        from langgraph_fence.execution.children import Step, spawn_children

        return await spawn_children(
            Step(self._handle, self.fence), placement, graph_name, inputs, graph
        )

    async def wait_children(
        self,
        children: Sequence[Child],
        *,
        timeout: float | None = None,  # noqa: ASYNC109 - gather-like API: timeout=
        return_exceptions: bool = False,
        poll_interval: float = 0.05,
        allow: Collection[tuple[str, ...]] = (),
    ) -> list[Any]:
        """The outputs of ``children``, in the order given, once all have ended.

        As ``asyncio.gather``: a child that failed or was dead-lettered raises
        :class:`~langgraph_fence.ChildFailedError` (naming the child execution and its
        reason) within one look of its end, or with ``return_exceptions=True`` takes its
        place in the list. Each look reads every pending ``ANY_INSTANCE`` child in ONE
        statement, whatever their number; on PostgreSQL a child's end wakes the wait at
        once. A ``PARENT_INSTANCE`` child's own error is raised (or placed) as
        it is; a fencing error is always raised. While it waits for ``ANY_INSTANCE``
        children and nothing else of the tree runs, the root lease is yielded; it is taken
        again (epoch + 1, this fence's token with it) before the wait returns or raises. If
        the execution was taken over meanwhile, the wait stops with
        ``ExecutionFencedError``.

        Args:
            children: what :meth:`spawn_child` returned.
            timeout: seconds to wait (``None``: as long as it takes).
            poll_interval: the longest pause between looks (they start faster). On
                PostgreSQL the children's ends wake the wait (LISTEN), and it reads all of
                them every ``poll_interval`` (at least a second) only in case a
                notification was lost.
            allow: ``(module, name)`` pairs the outputs may construct besides what the
                serializer allows.

        Raises:
            ChildFailedError: a child ended ``failed`` or ``dead_lettered``.
            TimeoutError: not all had ended within ``timeout``.
            ExecutionFencedError: this step's execution was taken over.
        """
        from langgraph_fence.execution.children import Step, wait_children

        return await wait_children(
            Step(self._handle, self.fence),
            children,
            timeout,
            return_exceptions,
            poll_interval,
            allow,
        )

    @property
    def tenant_id(self) -> str:
        """The tenant of the lease."""
        return self.fence.tenant_id

    @property
    def scope_key(self) -> str:
        """The scope key of the lease."""
        return self.fence.scope_key


def get_execution_context() -> ExecutionContext:
    """The frame of the step running now.

    Raises:
        ExecutionContextUnavailableError: no fenced step is running in this context (the
            node was not wrapped with ``@fenced`` / ``fence_graph``, or the call is outside
            a step).
    """
    frame = _current.get()
    if frame is None:
        raise ExecutionContextUnavailableError(
            "no fenced step is running here: get_execution_context() works inside a node "
            "wrapped with @fenced or fence_graph(), run through Instance.ainvoke() or "
            "langgraph_fence.testing.run_node()"
        )
    return frame


def handle_of(frame: ExecutionContext) -> RunHandle:
    """The run handle ``frame`` runs under (for the wrappers and stores of this package)."""
    return frame._handle


def superstep_of(frame: ExecutionContext) -> str:
    """The root checkpoint whose superstep ``frame``'s step belongs to."""
    return frame._superstep


def effect_began(frame: ExecutionContext) -> bool:
    """Whether ``frame``'s body entered ``side_effect()``: its write began."""
    return bool(frame._began)


def current_frame() -> ExecutionContext | None:
    """The running frame, or ``None`` (no error)."""
    return _current.get()


class _DeferredStamp:
    """The stamp a ``stamp="effect"`` step makes when its body enters ``side_effect()``."""

    __slots__ = ("done", "stamp")

    def __init__(self, stamp: Callable[[], Awaitable[Any]]) -> None:
        self.stamp = stamp
        self.done = False


_deferred: ContextVar[_DeferredStamp | None] = ContextVar(
    "langgraph_fence_deferred_stamp", default=None
)


def defer_stamp(stamp: Callable[[], Awaitable[Any]]) -> Any:
    """Until the returned token is reset, ``side_effect()`` in this context makes ``stamp``."""
    return _deferred.set(_DeferredStamp(stamp))


def reset_deferred(token: Any) -> None:
    _deferred.reset(token)


def set_frame(frame: ExecutionContext | None) -> Any:
    """Make ``frame`` (and its fence) the running step in this context until
    :func:`reset_frame` is given the returned token."""
    return _current.set(frame), enter_step(None if frame is None else frame.fence)


def reset_frame(token: Any) -> None:
    """Undo the :func:`set_frame` that returned ``token``."""
    frame_token, fence_token = token
    leave_step(fence_token)
    _current.reset(frame_token)

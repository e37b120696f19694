"""What the per-run code uses of the instance it runs under.

:class:`InstanceHost` is the one object a run (:mod:`langgraph_fence.execution.run`), the
takeover loop (:mod:`langgraph_fence.execution.serve`) and a step's children
(:mod:`langgraph_fence.execution.children`) are given by their
:class:`~langgraph_fence.Instance`: its id, lease TTL and clock, the lease store and records,
the fenced checkpointer, the keeper that renews what it holds, its listeners, the graphs it
serves and the run queue. They never hold the instance itself.
A run's handle sees it through the narrower
:class:`~langgraph_fence.fence.tree_activity.RunHost`.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from langgraph.checkpoint.serde.base import SerializerProtocol

from langgraph_fence.events import EventKind, Listeners
from langgraph_fence.execution.keeper import Keeper
from langgraph_fence.fence import RunHandle
from langgraph_fence.lease import ExecutionLeaseRepository, LeaseKey
from langgraph_fence.lease.records import (
    ExecutionRecords,
    SqlExecutionRecords,
    check_thread_binding,
)
from langgraph_fence.lease.stores import base_store
from langgraph_fence.queue import SubmittedRuns
from langgraph_fence.serde import safe_serializer

if TYPE_CHECKING:
    from langgraph_fence.fence.tree_activity import Tree
    from langgraph_fence.saver.checkpoint import FencedCheckpointer

__all__ = ["InstanceHost"]


@dataclass(kw_only=True, eq=False)
class InstanceHost:
    """The services of one :class:`~langgraph_fence.Instance` that its runs use.

    Attributes:
        instance_id: the holder name the instance's leases carry.
        lease_ttl: the TTL of every lease it takes, in seconds.
        clock: its monotonic clock (the confirmed windows are on it).
        repository: the lease store.
        records: the execution records.
        checkpointer: the fenced checkpointer of its graphs.
        keeper: the keeper that renews every lease it holds and admits new ones.
        events: its listeners.
        served_graphs: the graphs ``serve()`` serves here, by name (shared with the
            instance: where a ``PARENT_INSTANCE`` child finds its graph).
        record_serde: what a run config is checked with before it is recorded.
        runs: the runs in flight (kept referenced while they run).
    """

    instance_id: str
    lease_ttl: float
    clock: Callable[[], float]
    repository: ExecutionLeaseRepository
    records: ExecutionRecords
    checkpointer: FencedCheckpointer
    keeper: Keeper
    events: Listeners
    served_graphs: dict[str, Any]
    record_serde: SerializerProtocol = field(init=False)
    runs: set[object] = field(init=False, default_factory=set)
    _queue: SubmittedRuns | None = field(init=False, default=None)

    def __post_init__(self) -> None:
        # A run config is checked with what its records store it with (memory records keep
        # objects, but a value is refused the same way on every store).
        self.record_serde = getattr(self.records, "serde", None) or safe_serializer()

    # -- what a run's handle needs (langgraph_fence.fence.tree_activity.RunHost)

    def keep(self, handle: Tree) -> None:
        """Renew ``handle``'s lease with every other lease the instance holds."""
        assert isinstance(handle, RunHandle)  # the one Tree there is
        self.keeper.keep(handle)

    async def let_go(self, handle: Tree) -> None:
        """Stop renewing ``handle``'s lease (it is being released or yielded)."""
        assert isinstance(handle, RunHandle)
        await self.keeper.release(handle)

    def emit(self, kind: EventKind, scope_key: str, token: int, reason: str | None = None) -> None:
        """Tell the instance's listeners."""
        self.events.emit(kind, scope_key, token, reason)

    async def wake_yielded(self, parent: LeaseKey, ttl: float) -> None:
        """Make the yielded ``parent`` runnable if all its children ended (a no-op where
        there is no run queue)."""
        queue = self.queue_or_none()
        if queue is not None:
            await queue.wake_yielded(parent, ttl)

    # -- the run queue

    def queue_made(self) -> SubmittedRuns | None:
        """The run queue if one was made already (nothing is made here)."""
        return self._queue

    def queue_or_none(self) -> SubmittedRuns | None:
        """The run queue, or ``None`` where there is none (not a SQL store)."""
        try:
            return self.run_queue()
        except TypeError:
            return None

    def run_queue(self) -> SubmittedRuns:
        """The run queue on the lease table's database (SQL stores only).

        Raises:
            TypeError: the lease store and the records are not on one SQL database.
        """
        if self._queue is None:
            from langgraph_fence.lease.sql import SqlLeaseRepository

            try:
                store = base_store(self.repository)
            except ValueError:
                store = None
            if not isinstance(store, SqlLeaseRepository) or not isinstance(
                self.records, SqlExecutionRecords
            ):
                raise TypeError(
                    "submitted runs need the lease table and the execution records on one SQL "
                    "database (every worker reads the queue there): open the instance with "
                    "Instance.open('sqlite+aiosqlite:///...' or 'postgresql+asyncpg://...')"
                )
            records = self.records

            async def bind(key: LeaseKey, thread_id: str) -> None:
                check_thread_binding(key, thread_id, await records.bind(key, thread_id))

            self._queue = SubmittedRuns(store, records.serde, bind=bind)
        return self._queue

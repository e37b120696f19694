"""Tree activity: which steps of one tree run now, and the root lease's yield.

While a step waits for ``ANY_INSTANCE`` children
(:func:`langgraph_fence.execution.children.wait_children`)
the instance gives the root lease up, but ONLY while every running part of the tree is such
a wait: a sibling task of the same superstep, a ``PARENT_INSTANCE`` child's step, or a
checkpoint write of the tree still in flight keeps it held. Each of those enters
:class:`TreeActivity` before it does anything (the node wrapper, the checkpointer wrapper)
and leaves it when done; a wait counts itself as waiting.

* **Yield** (one guarded statement, :meth:`~langgraph_fence.ExecutionLeaseRepository.yield_lease`):
  the lease becomes ``waiting`` with its holder kept; the keeper stops renewing it. Nothing
  writes under it (the guard wants ``running``) and no instance takes it over.
* **Re-take** (one statement, :meth:`~langgraph_fence.ExecutionLeaseRepository.retake`):
  before any step or checkpoint write of the tree runs again, before an operation of a
  running step that writes under the token (a fenced tool call, a store write,
  ``side_effect()``, a spawn, ``confirm_now()``: :meth:`TreeActivity.held`) runs, and
  before the wait returns,
  the lease is taken again at epoch + 1 and the keeper renews it again; every live frame's
  fence reads the handle, so it shows the new token. If another instance took the tree
  meanwhile, the re-take is refused: the run records the
  :class:`~langgraph_fence.ExecutionFencedError` and stops, and the new holder re-runs the
  waiting step, which finds the children it already spawned.
* **Wake**: after each yield (and after each child's end, :mod:`langgraph_fence.execution.run`) a
  yielded tree whose children have all ended is made pending, runnable by any instance's
  ``serve()`` one lease TTL later (its waiter, usually alive, re-takes it first), so a waiter
  that died never strands its tree.
"""

from __future__ import annotations

import asyncio
import logging
import threading
from collections.abc import AsyncIterator, Callable, Iterator
from contextlib import asynccontextmanager, contextmanager
from typing import TYPE_CHECKING, Any, Protocol

from langgraph_fence.errors import ExecutionFencedError
from langgraph_fence.events import EventKind
from langgraph_fence.from_thread import run_on_loop
from langgraph_fence.lease.transitions import fenced_error

if TYPE_CHECKING:
    from langgraph_fence.errors import ExecutionLeaseLostError
    from langgraph_fence.lease import ExecutionLeaseRepository, Lease, LeaseKey

__all__ = ["RunHost", "Tree", "TreeActivity", "wake_parent"]

logger = logging.getLogger("langgraph_fence.tree_activity")


class RunHost(Protocol):
    """What a run's handle needs of the instance it runs under
    (:class:`~langgraph_fence.execution.host.InstanceHost`): keep its lease renewed or let it
    go, tell the instance's listeners, wake a yielded parent, and the graphs served there."""

    served_graphs: dict[str, Any]

    def keep(self, handle: Tree) -> None:
        """Renew ``handle``'s lease with every other lease the instance holds."""

    async def let_go(self, handle: Tree) -> None:
        """Stop renewing ``handle``'s lease (it is being released or yielded)."""

    def emit(self, kind: EventKind, scope_key: str, token: int, reason: str | None = None) -> None:
        """Tell the instance's listeners."""

    async def wake_yielded(self, parent: LeaseKey, ttl: float) -> None:
        """Make the yielded ``parent`` runnable if all its children ended."""


class Tree(Protocol):
    """What the yield reads and changes of the run's handle
    (:class:`~langgraph_fence.fence.RunHandle` is the one)."""

    @property
    def key(self) -> LeaseKey:
        """The execution."""

    @property
    def scope_key(self) -> str:
        """The execution's scope key."""

    @property
    def token(self) -> int:
        """The token held now."""

    @property
    def lease(self) -> Lease:
        """The lease held now."""

    @property
    def ttl(self) -> float:
        """The lease TTL."""

    @property
    def repository(self) -> ExecutionLeaseRepository:
        """The lease store."""

    @property
    def error(self) -> ExecutionLeaseLostError | None:
        """The run's first fencing error, if any."""

    @property
    def stop_reason(self) -> str | None:
        """Why the run is asked to stop, if it is."""

    @property
    def loop(self) -> asyncio.AbstractEventLoop | None:
        """The loop the run's store calls belong to."""

    @property
    def host(self) -> RunHost | None:
        """The instance's side, if the run has one."""

    @property
    def clock(self) -> Callable[[], float]:
        """The instance's monotonic clock."""

    def record(self, error: ExecutionLeaseLostError) -> ExecutionLeaseLostError:
        """Record ``error`` as the run's fencing error; the one to raise."""

    def note_yielded(self, lease: Lease) -> None:
        """The lease was yielded: ``lease`` is the row as the yield left it."""

    def replace_lease(self, lease: Lease, *, sent_at: float) -> None:
        """The lease was taken again: hold ``lease``, confirmed from ``sent_at``."""


class TreeActivity:
    """The running steps of one run's tree, and whether its lease is yielded now.

    Attributes:
        running: steps and checkpoint writes of the tree in flight (waits included).
        waiting: how many of them wait for remote children.
        yielded: the lease is yielded, or a yield is under way (every entry re-takes first).
    """

    __slots__ = ("_count", "_handle", "_turn", "running", "waiting", "yielded")

    def __init__(self, handle: Tree) -> None:
        self._handle = handle
        self._count = threading.Lock()  # sync steps enter from worker threads
        self._turn: asyncio.Lock | None = None  # one yield or re-take at a time
        self.running = 0
        self.waiting = 0
        self.yielded = False

    def _lock(self) -> asyncio.Lock:
        if self._turn is None:
            self._turn = asyncio.Lock()
        return self._turn

    # -- a step or a checkpoint write of the tree

    def enter_held(self) -> bool:
        """A step or checkpoint write starts while the lease is not yielded: counted, and
        True (no I/O). False, nothing counted, while it is yielded: :meth:`enter` then."""
        with self._count:  # counted and the yield read at once (maybe_yield sets it so)
            if self.yielded:
                return False
            self.running += 1
            return True

    async def enter(self) -> None:
        """A step or checkpoint write starts: counted, and the lease re-taken if yielded."""
        with self._count:  # counted and the yield read at once (maybe_yield sets it so)
            self.running += 1
            yielded = self.yielded
        if yielded:
            try:
                await self.retake()
            except BaseException:
                self.leave()
                raise

    def enter_from_thread(
        self,
        *,
        what: str = "a sync step re-taking its tree's yielded lease",
        on_loop: str = "make the node an `async def`",
    ) -> None:
        """:meth:`enter` from a worker thread (a sync step): the re-take runs on the run's
        loop (``what`` and ``on_loop`` as for :func:`~langgraph_fence.from_thread.run_on_loop`)."""
        with self._count:  # counted and the yield read at once (maybe_yield sets it so)
            self.running += 1
            yielded = self.yielded
        if yielded:
            try:
                run_on_loop(self._handle.loop, self.retake, what=what, on_loop=on_loop)
            except BaseException:
                self.leave()
                raise

    def leave(self) -> None:
        """A step or checkpoint write ended."""
        with self._count:
            self.running -= 1

    # -- an operation of a running step

    @asynccontextmanager
    async def held(self) -> AsyncIterator[None]:
        """The block runs with the lease held: counted among the running parts of the tree
        (so no yield lands while it runs) and the lease re-taken first if yielded.

        For what a step writes beside its own entry and checkpoint writes (a tool call, a
        store write, a side effect, a spawn, a confirmation): the step itself may be the one
        waiting for remote children, with this code running concurrently in another task.
        """
        if not self.enter_held():
            await self.enter()
        try:
            yield
        finally:
            self.leave()

    @contextmanager
    def held_from_thread(self, *, what: str, on_loop: str) -> Iterator[None]:
        """:meth:`held` from a worker thread (a sync tool or step): the re-take runs on the
        run's loop (``what`` and ``on_loop`` as for
        :func:`~langgraph_fence.from_thread.run_on_loop`)."""
        self.enter_from_thread(what=what, on_loop=on_loop)
        try:
            yield
        finally:
            self.leave()

    # -- a wait for remote children

    def begin_wait(self) -> None:
        """The calling step (counted as running) now waits for remote children."""
        with self._count:
            self.waiting += 1

    async def end_wait(self) -> None:
        """The wait ends (returns or raises): the lease is re-taken first if yielded."""
        with self._count:
            self.waiting -= 1
        if self.yielded:
            await self.retake()

    def _quiet(self) -> bool:
        """Every running part of the tree is a wait for remote children."""
        with self._count:
            return 0 < self.running == self.waiting

    async def maybe_yield(self) -> bool:
        """Yield the lease if only waits run and the run is not stopping; whether it did."""
        handle = self._handle
        if self.yielded or not self._quiet():
            return False
        async with self._lock():
            if handle.error is not None or handle.stop_reason is not None:
                return False
            host = handle.host
            assert host is not None  # children are spawned under an instance only
            # Decided and set in one hold of the count, before the statement: a step of
            # another thread entering meanwhile either counts first (no yield) or sees it
            # set, waits for the turn and re-takes, so nothing of the tree runs under a
            # lease being given up. The keeper lets go first: it sends no renewal of a
            # lease being yielded.
            with self._count:
                if self.yielded or not 0 < self.running == self.waiting:
                    return False
                self.yielded = True
            await host.let_go(handle)
            # Should the statement fail, landed or not, ``yielded`` stays set: the re-take
            # (which accepts a lease still held) settles it before anything runs.
            try:
                lease = await handle.repository.yield_lease(handle.lease)
            except ExecutionFencedError as exc:
                raise handle.record(exc) from None
            handle.note_yielded(lease)
            host.emit(
                EventKind.YIELDED, handle.scope_key, lease.epoch, "waiting for remote children"
            )
        # Its children may all have ended since the wait last looked: then it is woken at
        # once (the wait re-takes it at its next look; if it died, serve() takes it).
        await wake_parent(handle, handle.key)
        return True

    async def check_yielded(self) -> bool:
        """Whether the lease is yielded now; if so, one read tells whether anyone else
        took it meanwhile (a takeover after a wake, a cancel, a new run of the thread: the
        epoch moved), so a yielded waiter learns of it within one poll.

        Raises:
            ExecutionFencedError: the epoch moved on (recorded on the run's handle).
        """
        if not self.yielded:
            return False
        handle = self._handle
        async with self._lock():  # not while a re-take of this run is under way
            if not self.yielded:
                return False
            current = await handle.repository.get(handle.key)
            if current is None or current.epoch != handle.token:
                raise handle.record(fenced_error(handle.lease, current, action="wait_children"))
            return True

    async def retake(self) -> None:
        """Take the yielded lease again (epoch + 1) and have the keeper renew it again.

        Raises:
            ExecutionFencedError: another instance took the tree meanwhile (recorded on
                the run's handle: the run stops).
        """
        handle = self._handle
        async with self._lock():
            if not self.yielded:
                return
            if isinstance(handle.error, ExecutionFencedError):
                raise handle.error
            host = handle.host
            assert host is not None
            sent_at = handle.clock()
            try:
                lease = await handle.repository.retake(handle.lease, handle.ttl)
            except ExecutionFencedError as exc:
                raise handle.record(exc) from None
            handle.replace_lease(lease, sent_at=sent_at)
            self.yielded = False
            host.keep(handle)
            host.emit(
                EventKind.RETAKEN, handle.scope_key, lease.epoch, "a step of the tree runs again"
            )


async def wake_parent(handle: Tree, parent: LeaseKey) -> None:
    """Wake ``parent`` if it is yielded and all its children ended: runnable by any
    ``serve()`` one lease TTL from now (store clock). Best effort: a failure is logged (the
    waiter, if alive, re-takes it all the same)."""
    host = handle.host
    if host is None:
        return
    try:
        await host.wake_yielded(parent, handle.ttl)
    except Exception:
        logger.warning("could not wake the yielded tree %s", parent.scope_key, exc_info=True)

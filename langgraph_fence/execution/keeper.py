"""The keeper: renewal and the watchdog of every run an instance holds.

One keeper per instance, not two tasks per run. Its renewer wakes when the earliest
renewal is due and renews every lease that is due (or nearly: within a quarter of the
renew interval, so that renewals fall into step and go out together) with ONE statement per
batch (:meth:`~langgraph_fence.ExecutionLeaseRepository.renew_many`), which tells lease by
lease which were refused. Per lease the meaning is that of one renewal of its own:

* renewed: the run's confirmed window moves on (``RunHandle.renewed``); a renewal
  sent with less than one renew interval of the window left is told as ``renewed_late``;
* refused: the run's handle records the ``ExecutionFencedError`` and the run drains;
* the store out of reach: logged; the watchdog decides when that has lasted too long;
* after a lapse, one more renewal tells a takeover (fenced) from a slow store (lost).

The watchdog wakes when the earliest confirmed window of a held run runs out and records a
lease loss on that run's handle (the run drains), on the instance's clock, even while a
renewal statement hangs. It runs on the instance's event loop while the instance holds runs:
it only turns a window that ran out into a recorded loss and a drain, which act on that
loop, and reads the windows as the renewer leaves them.

Where the renewals run:

* **in a thread of their own** (the default for a real deployment: a
  :class:`~langgraph_fence.SqlLeaseRepository` on a database file or server, the real clock,
  no injected ``sleep``): the renewer thread has an event loop and database connections of
  its own (:func:`~langgraph_fence.database.twin_engine`), so a renewal goes out on time and
  its answer moves the run's window on while the instance's loop is kept busy (thousands of
  runs starting or ending at once, a node doing synchronous work). It renews only while the
  instance's loop runs: once that loop has not run for :func:`loop_stall_bound` seconds (a
  deadlocked process), the thread stops renewing, the leases lapse and another instance
  takes them over. It shares the process's interpreter lock: a garbage-collection pass
  (or a C call that holds the lock) delays it as it delays the loop.
* **on the instance's event loop**, as tasks, where the instance has an injected clock or
  ``sleep`` (the ``leases`` fixture's controlled clock drives that loop only) or a store no
  other thread can reach (the memory store, a wrapped store, an in-memory SQLite database).
  A loop kept busy for longer than a lease's slack then delays its renewals and loses it.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import threading
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, NamedTuple

from langgraph_fence.database.retry import FixedWindow, retry_window
from langgraph_fence.errors import ExecutionFencedError, ExecutionLeaseLostError, InstanceFullError
from langgraph_fence.events import EventKind, Listeners
from langgraph_fence.execution._keeper_settings import (
    LOOP_STALL_FLOOR,
    MAX_HELD_CEILING,
    MAX_HELD_CEILING_ON_LOOP,
    MAX_STARTING,
    RENEW_BATCH,
    RENEWALS_PER_SECOND,
    Renewer,
    Sleep,
    default_max_held,
    loop_stall_bound,
    thread_store,
)
from langgraph_fence.execution._renewer_thread import (
    RenewerThread,
    cancel_and_wait,
    wait_quietly,
)
from langgraph_fence.execution.collector import Collector
from langgraph_fence.fence import RunHandle, safety_margin
from langgraph_fence.lease import ExecutionLeaseRepository, LeaseKey

if TYPE_CHECKING:
    from langgraph_fence.lease.sql import SqlLeaseRepository

__all__ = [
    "LOOP_STALL_FLOOR",
    "MAX_HELD_CEILING",
    "MAX_HELD_CEILING_ON_LOOP",
    "MAX_STARTING",
    "RENEWALS_PER_SECOND",
    "RENEW_BATCH",
    "Batch",
    "Keeper",
    "Renewer",
    "Sleep",
    "default_max_held",
    "loop_stall_bound",
    "thread_store",
]

logger = logging.getLogger("langgraph_fence.keeper")


class Batch(NamedTuple):
    """One renewal statement the keeper sent and had answered."""

    sent_at: float  # on the instance's clock
    size: int  # leases it carried
    slack: float  # the least confirmed window left among them when it was sent, in seconds
    took: float  # seconds until its answer


class Keeper:
    """Keeps the leases of an instance's runs: :meth:`keep` a handle while its run lasts,
    :meth:`release` it when the run ends (before its lease is released).

    Admission: a run takes a slot (:meth:`admit`, or :meth:`try_admit` for ``serve()``)
    before anything of it is written and gives it back (:meth:`leave`) when it has ended;
    no more than ``max_held`` runs hold slots at once. And no run is taken on while the
    renewals of those held run late (:attr:`behind`): a new run waits for them to catch up
    (:meth:`in_time`), ``serve()`` takes nothing over; the leases already held come first.

    Args:
        max_held: the most runs held at once; ``None``: :func:`default_max_held`.
        thread_store: renew in a thread of its own through this store
            (:func:`thread_store`; the store of every handle kept); ``None``: on the loop.
        collector: the process's garbage collector under watch
            (:mod:`~langgraph_fence.execution.collector`), looked at while no renewal is
            due; ``None``: left alone.

    Attributes:
        renew_interval: seconds between renewals of one lease.
        loop_stall_bound: with a renewer thread, how long the instance's loop may go
            without running before the thread stops renewing (:func:`loop_stall_bound`).
        batches: for tests and benchmarks, the renewal statements that were answered (the
            last 4096), on the instance's clock.
    """

    def __init__(
        self,
        *,
        ttl: float,
        renew_interval: float,
        clock: Callable[[], float],
        sleep: Sleep,
        events: Listeners,
        holder: str,
        max_held: int | None = None,
        thread_store: SqlLeaseRepository | None = None,
        collector: Collector | None = None,
    ) -> None:
        self.ttl = ttl
        self.holder = holder
        self.max_held = (
            default_max_held(renew_interval, in_thread=thread_store is not None)
            if max_held is None
            else max_held
        )
        self._slots = 0
        #: Paces starts: held by a new run from its thread binding to its confirmed lease.
        self.starting = asyncio.Semaphore(MAX_STARTING)
        self.renew_interval = renew_interval
        #: The window a lease has left when its renewal goes out on time, in seconds.
        self.margin = ttl - safety_margin(ttl) - renew_interval
        # When a renewal statement was last answered late (see ``behind``), on the
        # instance's clock; and the statements in flight, by when each was sent. Both
        # under ``_lock``: the renewer thread writes them, the loop reads them.
        self._late_at: float | None = None
        self._sent: dict[object, float] = {}
        self.loop_stall_bound = loop_stall_bound(ttl)
        self._clock = clock
        self._sleep = sleep
        self._events = events
        # The schedule, shared by the instance's loop (keep, release, the watchdog) and the
        # renewer thread: read and changed under this lock only.
        self._lock = threading.Lock()
        # Handle -> when its next renewal is due, on the instance's clock.
        self._due: dict[RunHandle, float] = {}
        self._in_flight: set[RunHandle] = set()  # renewals sent, not yet answered
        self._sending: set[asyncio.Task[None]] = set()  # on the loop that renews
        self._renewer: asyncio.Task[None] | None = None
        self._watchdog: asyncio.Task[None] | None = None
        self._thread_store = thread_store
        self._thread: RenewerThread | None = None
        self._loop: asyncio.AbstractEventLoop | None = None  # the instance's
        # When the renewer thread asked the instance's loop for a sign of life that has not
        # come yet (None: it came): how long the loop has not run, at least.
        self._beat_asked: float | None = None
        self._stall_told = False
        self.batches: list[Batch] = []
        self._collector = collector
        if collector is not None:
            collector.join(self)

    @property
    def in_thread(self) -> bool:
        """Whether the renewals run in the renewer thread (else on the instance's loop)."""
        return self._thread_store is not None

    @property
    def held(self) -> int:
        """How many runs the keeper keeps now."""
        return len(self._due)

    @property
    def busy(self) -> int:
        """How many runs hold a slot or a kept lease now: those starting count, their lease
        being taken lapses as a kept one would."""
        return max(self._slots, len(self._due))

    @property
    def behind(self) -> bool:
        """Whether the renewals of the runs held run late, so that the instance takes on
        no new run: a renewal statement came back less than a renew interval ago with
        less than half of :attr:`margin` left for one of the leases it still holds (or
        after one of their windows ran out), or one has been in flight for longer than
        half of :attr:`margin`. Never while nothing is held."""
        now = self._clock()
        with self._lock:
            if not self._due:
                return False
            if self._answered_late(now):
                return True
            return any(now - sent_at > self.margin / 2 for sent_at in self._sent.values())

    def _answered_late(self, now: float) -> bool:
        """Whether a renewal statement was answered late less than a renew interval
        before ``now`` (under ``_lock``)."""
        return self._late_at is not None and now - self._late_at < self.renew_interval

    def lateness(self, since: float) -> float:
        """How late the renewal statements answered since ``since`` (the instance's clock)
        came, in seconds: how far below half of :attr:`margin` the least-covered lease's
        window was when the latest answer came (the line past which the instance is
        :attr:`behind` and takes no new run). 0.0 while every answer left at least that, or
        none was sent."""
        late = 0.0
        for batch in reversed(self.batches):
            if batch.sent_at < since:
                break
            late = max(late, self.margin / 2 - (batch.slack - batch.took))
        return late

    @property
    def free(self) -> int:
        """How many more runs may take a slot now."""
        return max(self.max_held - self._slots, 0)

    def try_admit(self) -> bool:
        """Take a slot if one is free and the renewals run in time; whether it was taken."""
        return not self.behind and self._take_slot()

    def _take_slot(self) -> bool:
        if self._slots >= self.max_held:
            return False
        self._slots += 1
        return True

    def admit(self, what: str) -> None:
        """Take a slot for ``what``, else raise :class:`InstanceFullError` (nothing written).
        Whether the renewals run in time is asked later, in the start's turn (:meth:`in_time`)."""
        if not self._take_slot():
            raise InstanceFullError(
                f"instance {self.holder!r} holds {self._slots} executions, its max_held: "
                f"{what} was not started (nothing was written). Every lease an instance holds "
                "must be renewed in time, so it takes no more until one of its runs ends: start "
                "it on another instance or again later, or open the instance with a higher "
                "max_held"
            )

    def leave(self) -> None:
        """Give a slot back: its run has ended."""
        self._slots = max(self._slots - 1, 0)

    async def in_time(self, what: str) -> None:
        """Return once the renewals of the runs held run in time (:attr:`behind` is
        false): at once, as a rule. While they run late, wait for them to catch up (a new
        run would only add to their load), at most one lease TTL on the instance's clock,
        then raise :class:`InstanceFullError` for ``what`` (nothing of it written)."""
        if not self.behind:
            return
        deadline = self._clock() + self.ttl
        while self.behind and self._clock() < deadline:
            await self._sleep(self.renew_interval / 4)
        if self.behind:
            raise InstanceFullError(
                f"instance {self.holder!r}: the renewals of the {self.held} executions it "
                f"holds run late, so {what} waited {self.ttl:g} s (one lease TTL) for them to "
                "catch up and was not started (nothing was written): the leases it holds come "
                "first. Start it on another instance or again later; if this lasts, hold "
                "fewer executions here (a lower max_held) or give the leases a longer "
                "lease_ttl"
            )

    async def confirm_start(self, handle: RunHandle) -> None:
        """Renew a new run's lease at once if its acquire was answered with less than one
        renew interval of its window left (a burst of starts queued on the pool), before
        anything runs under it: the late answer leaves it held, not lost.

        Nothing ran under the token yet, so confirming the hold again is enough: the
        renewal is guarded (holder and epoch), and one that finds the execution taken over
        meanwhile raises that :class:`ExecutionFencedError`. One more round trip, on the
        keeper's own connections, and only on the slow path.
        """
        sent_at = self._clock()
        if handle.confirmed_until - sent_at >= self.renew_interval:
            return
        with retry_window(FixedWindow.lasting(self.renew_interval)):
            (answer,) = await handle.repository.renew_many([handle.lease], self.ttl)
        if isinstance(answer, ExecutionFencedError):
            raise answer
        handle.replace_lease(answer, sent_at=sent_at)

    def keep(self, handle: RunHandle) -> None:
        """Renew ``handle``'s lease every ``renew_interval`` and watch its window."""
        due = self._next_due(handle)
        if self._thread_store is not None and handle.repository is not self._thread_store:
            raise ValueError(
                f"the run of {handle.scope_key!r} holds its lease from another store than "
                "the one this keeper's renewer thread renews through"
            )
        with self._lock:
            self._due[handle] = due
        self._loop = asyncio.get_running_loop()
        if self._thread_store is not None:
            thread = self._thread
            if thread is None or not thread.alive:
                self._thread = thread = RenewerThread(
                    self._thread_store,
                    holder=self.holder,
                    clock=self._clock,
                    renew=self._renew_loop,
                    sending=self._sending,
                )
            thread.wake_by(due)
        elif self._renewer is None or self._renewer.done():
            self._renewer = asyncio.create_task(self._renew_loop(None), name="keeper renewals")
        if self._watchdog is None or self._watchdog.done():
            self._watchdog = asyncio.create_task(self._watch_loop(), name="keeper watchdog")

    async def release(self, handle: RunHandle) -> None:
        """Stop keeping ``handle`` (an answer still in flight for it is dropped); the last
        one stops the keeper's tasks (the renewer thread waits for the next run)."""
        with self._lock:
            self._due.pop(handle, None)
            idle = not self._due
        if not idle:
            return
        if self._collector is not None:
            self._collector.look()  # nothing of this keeper's is held: a pass may fit now
        if self._thread_store is None:
            await self._stop_tasks()
            return
        watchdog, self._watchdog = self._watchdog, None
        if watchdog is not None:
            await cancel_and_wait([watchdog])

    async def aclose(self) -> None:
        """Stop renewing and watching (the leases still held then lapse); a renewal
        statement still in flight is waited for, not cancelled (:meth:`_stop_tasks`)."""
        await self._stop_tasks()
        thread, self._thread = self._thread, None
        if thread is not None:
            await thread.stop()
        if self._thread_store is None:
            await wait_quietly(list(self._sending))
        if self._collector is not None:
            self._collector.leave(self)

    async def _stop_tasks(self) -> None:
        """Stop the renewal loop and the watchdog. A renewal statement already sent (one of
        ``_sending``, on the instance's loop) is never cancelled: it ends on its own and its
        answer is dropped for a handle no longer kept. Cancelled while SQLite runs it, its
        ``UPDATE ... RETURNING`` would be left stepped once, holding the database's write
        lock after its connection is closed, until the garbage collector frees its cursor:
        every writer of the file, in every process, would wait for it (and give up after
        the busy timeout)."""
        tasks = [t for t in (self._renewer, self._watchdog) if t is not None]
        self._renewer = self._watchdog = None
        await cancel_and_wait(tasks)

    # -- renewals

    def _next_due(self, handle: RunHandle) -> float:
        """One renew interval after the confirmation the handle's window counts from (its
        acquire or last renewal was SENT then): a start that waited long for its statement
        is renewed at once, not one interval after it finally got its answer."""
        window = handle.ttl - safety_margin(handle.ttl)
        return handle.confirmed_until - window + self.renew_interval

    async def _renew_loop(self, thread: RenewerThread | None) -> None:
        """Send the renewals as they fall due: on the instance's loop while it holds runs
        (``thread`` None), or in the renewer thread until it is stopped."""
        while thread is None or not thread.stopping:
            now = self._clock()
            with self._lock:
                if thread is None and not self._due:
                    return
                idle = not self._due
                waiting = {h: at for h, at in self._due.items() if h not in self._in_flight}
            if thread is not None and idle:
                if self._loop is None or self._loop.is_closed():
                    return  # the instance is gone without closing its keeper
                await thread.wait(self.renew_interval)  # until keep() wakes it
                continue
            earliest = min(waiting.values(), default=now + self.renew_interval / 4)
            if earliest > now:
                if self._collector is not None:
                    # Nothing is due: the one moment a collector's pause costs no renewal.
                    self._collector.look()
                    now = self._clock()
                if thread is None:
                    await self._sleep(max(earliest - now, 0.0))
                else:
                    await thread.wait(max(earliest - now, 0.0))
                continue
            if thread is not None and self._loop_stalled(thread):
                await thread.wait(self.renew_interval / 4)
                continue
            # Renew with those due soon: renewals fall into step and share statements.
            horizon = now + self.renew_interval / 4
            with self._lock:
                due = [h for h, at in waiting.items() if at <= horizon]
                for handle in [h for h in due if isinstance(h.error, ExecutionFencedError)]:
                    self._due.pop(handle, None)  # fenced: nothing to renew, ever
                due = _one_per_key([h for h in due if h in self._due])
                self._in_flight.update(due)
            for start in range(0, len(due), RENEW_BATCH):
                # Each statement on its own task: a slow answer does not hold back the
                # renewals that fall due meanwhile (a lease in flight is not sent twice).
                batch = due[start : start + RENEW_BATCH]
                task = asyncio.create_task(self._renew(batch, thread), name="keeper renewal")
                self._sending.add(task)
                task.add_done_callback(self._sending.discard)

    async def _renew(self, handles: list[RunHandle], thread: RenewerThread | None) -> None:
        """One renewal statement per store for ``handles``; each answer applied to its run."""
        try:
            await self._renew_batch(handles, None if thread is None else thread.store)
        finally:
            with self._lock:
                self._in_flight.difference_update(handles)
            if thread is not None:
                thread.poke()  # their next renewal may be due already: a slow answer

    async def _renew_batch(
        self, handles: list[RunHandle], store: SqlLeaseRepository | None
    ) -> None:
        by_store: dict[int, tuple[ExecutionLeaseRepository, list[RunHandle]]] = {}
        for handle in handles:
            repository = handle.repository if store is None else store
            by_store.setdefault(id(repository), (repository, []))[1].append(handle)
        for repository, batch in by_store.values():
            sent_at = self._clock()
            left = {h: h.confirmed_until - sent_at for h in batch}
            # The token each lease was renewed at: an answer about an older one (the run
            # yielded and re-took its lease meanwhile) tells nothing about the run now.
            epochs = {h: h.token for h in batch}
            # A lease that had lapsed before it was sent (renewed once more only to tell a
            # takeover from a slow store) says nothing about the pace; one that lapses in
            # flight does.
            live = [h for h in batch if h.error is None]
            # A connection error is retried while the earliest window of the batch lasts.
            earliest = min(batch, key=lambda h: h.confirmed_until)
            ticket = object()
            with self._lock:
                self._sent[ticket] = sent_at
            try:
                with retry_window(earliest):
                    answers = await repository.renew_many([h.lease for h in batch], self.ttl)
            except Exception as exc:
                # The store may be down for a moment: the watchdog decides when that has
                # lasted too long; until then the next renewal may get through.
                logger.warning("renewal of %d leases failed", len(batch), exc_info=True)
                with self._lock:
                    for handle in batch:
                        handle.saw_store_error(exc)
                        if handle in self._due:
                            self._due[handle] = self._clock() + self.renew_interval
                continue
            finally:
                with self._lock:
                    del self._sent[ticket]
            took = self._clock() - sent_at
            self.batches.append(Batch(sent_at, len(batch), min(left.values()), took))
            del self.batches[:-4096]
            fenced: list[tuple[RunHandle, ExecutionFencedError]] = []
            late: list[tuple[RunHandle, float]] = []
            with self._lock:  # a handle released meanwhile is not kept any more
                # Nor is it anybody's to fall behind with: the pace counts those still held.
                held = [left[h] - took for h in live if h in self._due]
                for handle, answer in zip(batch, answers, strict=True):
                    if handle not in self._due:
                        continue
                    if isinstance(answer, ExecutionFencedError):
                        if handle.token != epochs[handle]:
                            continue  # re-taken at a new token since: kept anew, not fenced
                        self._due.pop(handle)
                        fenced.append((handle, answer))
                    elif handle.renewed(answer, sent_at=sent_at):
                        self._due[handle] = self._next_due(handle)
                        if left[handle] < self.renew_interval:
                            late.append((handle, left[handle]))
                    elif handle.error is not None:
                        # The run had lost its lease (its window ran out): it stays stopped;
                        # this renewal only told that nobody took the execution over.
                        self._due.pop(handle)
                    # else: yielded and re-taken meanwhile (a new token): kept anew.
            self._note_pace(held, len(batch))
            for handle, error in fenced:  # the run drains
                if store is None:
                    handle.record(error)
                else:
                    handle.record_from_thread(error)
            for handle, slack in late:
                why = f"renewed with {max(slack, 0.0):.1f} s of its proven hold left"
                self._on_loop(
                    self._events.emit, EventKind.RENEWED_LATE, handle.scope_key, handle.token, why
                )

    def _note_pace(self, left: list[float], size: int) -> None:
        """Note a renewal statement of ``size`` leases answered with ``left`` seconds of
        their windows left, for each lease live when it was sent and still held: late
        (see :attr:`behind`) if the least is under half of :attr:`margin`."""
        if not left:
            return
        least = min(left)
        if least >= self.margin / 2:
            return
        now = self._clock()
        with self._lock:
            was_late = self._answered_late(now)
            self._late_at = now
        if not was_late:
            logger.warning(
                "instance %s: its renewals run late (a statement of %d leases was answered "
                "with %.2f s of a lease's window left, against %.2f s when on time): it takes "
                "on no new run until they have come back in time for %.1f s",
                self.holder,
                size,
                least,
                self.margin,
                self.renew_interval,
            )

    def _on_loop(self, call: Callable[..., object], *args: Any) -> None:
        """``call(*args)`` on the instance's loop: at once if this is it, else when it runs."""
        loop = self._loop
        if self._thread_store is None or loop is None:
            call(*args)
            return
        with contextlib.suppress(RuntimeError):  # the loop is closed: nobody to tell
            loop.call_soon_threadsafe(call, *args)

    # -- the instance's loop, seen from the renewer thread

    def _loop_stalled(self, thread: RenewerThread) -> bool:
        """Whether the instance's loop has not run for longer than the bound (asking it
        for a sign of life if none is pending); a closed loop stops the thread."""
        now = self._clock()
        asked = self._beat_asked
        loop = self._loop
        if loop is None or loop.is_closed():
            # The instance is gone without closing its keeper: its runs are over, and their
            # leases must lapse now, not one stall bound later.
            thread.stopping = True
            return True
        if asked is None:
            self._beat_asked = now
            try:
                loop.call_soon_threadsafe(self._beat)
            except RuntimeError:  # closed meanwhile
                thread.stopping = True
                return True
            return False
        stalled = now - asked
        if stalled <= self.loop_stall_bound:
            return False
        if not self._stall_told:
            self._stall_told = True
            logger.warning(
                "instance %s: its event loop has not run for %.1f s (more than %.1f s): its "
                "%d leases are no longer renewed, so they lapse and another instance takes "
                "them over",
                self.holder,
                stalled,
                self.loop_stall_bound,
                len(self._due),
            )
        return True

    def _beat(self) -> None:
        """The instance's loop runs (called on it)."""
        self._beat_asked = None
        if self._stall_told:
            self._stall_told = False
            logger.warning("instance %s: its event loop runs again", self.holder)

    # -- the watchdog

    async def _watch_loop(self) -> None:
        while True:
            with self._lock:
                if not self._due:
                    return
                live = [h for h in self._due if h.error is None]
            if not live:
                await self._sleep(self.renew_interval)
                continue
            now = self._clock()
            for handle in live:
                if handle.confirmed_until <= now:
                    # Recorded on the handle; the run drains.
                    with contextlib.suppress(ExecutionLeaseLostError):
                        handle.check()
            live = [h for h in live if h.error is None]
            if live:
                remaining = min(h.confirmed_until for h in live) - self._clock()
                await self._sleep(max(remaining, 0.0) + 1e-3)


def _one_per_key(handles: list[RunHandle]) -> list[RunHandle]:
    """``handles`` with each execution key once, the first of each key kept.

    A store refuses a renewal statement that names a key twice, and the refusal would fail
    every lease of the batch, pass after pass. Two handles of one key are two runs of one
    execution in this instance: one that was fenced but has not heard of it yet (its step
    still running: an interrupt, or its own expired lease taken back by ``serve()``) and the
    new one. The one left out stays due and goes out in the next pass, in a statement of its
    own.
    """
    seen: set[LeaseKey] = set()
    kept: list[RunHandle] = []
    for handle in handles:
        if handle.key not in seen:
            seen.add(handle.key)
            kept.append(handle)
    return kept

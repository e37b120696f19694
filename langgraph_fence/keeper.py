"""The keeper: renewal and the watchdog of every run an instance holds.

One keeper per instance, not two tasks per run. Its renewer wakes when the earliest
renewal is due and renews every lease that is due (or nearly: within a quarter of the
renew interval, so that renewals fall into step and go out together) with ONE statement per
batch (:meth:`~langgraph_fence.ExecutionLeaseRepository.renew_many`), which tells lease by
lease which were refused. Per lease the meaning is that of one renewal of its own:

* renewed: the run's confirmed window moves on (``RunHandle.replace_lease``); a renewal
  sent with less than one renew interval of the window left is told as ``renewed_late``;
* refused: the run's handle records the ``ExecutionFencedError`` and the run drains;
* the store out of reach: logged; the watchdog decides when that has lasted too long;
* after a lapse, one more renewal tells a takeover (fenced) from a slow store (lost).

The watchdog wakes when the earliest confirmed window of a held run runs out and records a
lease loss on that run's handle (the run drains), on the instance's clock, even while a
renewal statement hangs. Both wait on the instance's injected ``sleep`` and run only while
the instance holds runs.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Awaitable, Callable
from typing import Any, NamedTuple

from .errors import ExecutionFencedError, ExecutionLeaseLostError, InstanceFullError
from .events import EventKind, Listeners
from .fence import RunHandle, safety_margin
from .lease import DEFAULT_MAX_HELD, ExecutionLeaseRepository, Lease, LeaseKey
from .retry import FixedWindow, retry_window

__all__ = ["DEFAULT_MAX_HELD", "MAX_STARTING", "RENEW_BATCH", "Batch", "Keeper", "Sleep"]

logger = logging.getLogger(__name__)

Sleep = Callable[[float], Awaitable[Any]]

#: The most leases one renewal statement carries; more go out as several statements.
RENEW_BATCH = 1000

#: How many new runs of one instance take their lease at once; more wait their turn. A
#: burst of thousands of starts then queues here, not on the connection pool, where its
#: waits would run out the pool's timeout (measured: 5 000 at once on a pool of 16).
MAX_STARTING = 8


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
    no more than ``max_held`` runs hold slots at once.

    Attributes:
        renew_interval: seconds between renewals of one lease.
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
        max_held: int = DEFAULT_MAX_HELD,
    ) -> None:
        self.ttl = ttl
        self.holder = holder
        self.max_held = max_held
        self._slots = 0
        #: Paces starts: held by a new run from its thread binding to its confirmed lease.
        self.starting = asyncio.Semaphore(MAX_STARTING)
        self.renew_interval = renew_interval
        self._clock = clock
        self._sleep = sleep
        self._events = events
        # Handle -> when its next renewal is due, on the instance's clock.
        self._due: dict[RunHandle, float] = {}
        self._in_flight: set[RunHandle] = set()  # renewals sent, not yet answered
        self._sending: set[asyncio.Task[None]] = set()
        self._renewer: asyncio.Task[None] | None = None
        self._watchdog: asyncio.Task[None] | None = None
        self.batches: list[Batch] = []

    @property
    def held(self) -> int:
        """How many runs the keeper keeps now."""
        return len(self._due)

    @property
    def free(self) -> int:
        """How many more runs may take a slot now."""
        return max(self.max_held - self._slots, 0)

    def try_admit(self) -> bool:
        """Take a slot if one is free; whether it was taken."""
        if self._slots >= self.max_held:
            return False
        self._slots += 1
        return True

    def admit(self, what: str) -> None:
        """Take a slot for ``what``, else raise :class:`InstanceFullError` (nothing written)."""
        if not self.try_admit():
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
        self._due[handle] = self._next_due(handle)
        if self._renewer is None or self._renewer.done():
            self._renewer = asyncio.create_task(self._renew_loop(), name="keeper renewals")
        if self._watchdog is None or self._watchdog.done():
            self._watchdog = asyncio.create_task(self._watch_loop(), name="keeper watchdog")

    async def release(self, handle: RunHandle) -> None:
        """Stop keeping ``handle`` (an answer still in flight for it is dropped); the last
        one stops the keeper's tasks."""
        self._due.pop(handle, None)
        if not self._due:
            await self.aclose()

    async def aclose(self) -> None:
        """Stop renewing and watching (the leases still held then lapse)."""
        tasks = [t for t in (self._renewer, self._watchdog) if t is not None]
        tasks.extend(self._sending)
        self._renewer = self._watchdog = None
        for task in tasks:
            task.cancel()
        for task in tasks:
            try:
                await task
            except asyncio.CancelledError:
                pass
            except Exception:
                logger.exception("keeper task failed")

    # -- renewals

    def _next_due(self, handle: RunHandle) -> float:
        """One renew interval after the confirmation the handle's window counts from (its
        acquire or last renewal was SENT then): a start that waited long for its statement
        is renewed at once, not one interval after it finally got its answer."""
        window = handle.ttl - safety_margin(handle.ttl)
        return handle.confirmed_until - window + self.renew_interval

    async def _renew_loop(self) -> None:
        while self._due:
            now = self._clock()
            waiting = {h: at for h, at in self._due.items() if h not in self._in_flight}
            earliest = min(waiting.values(), default=now + self.renew_interval / 4)
            if earliest > now:
                await self._sleep(earliest - now)
                continue
            # Renew with those due soon: renewals fall into step and share statements.
            horizon = now + self.renew_interval / 4
            due = [h for h, at in waiting.items() if at <= horizon]
            for handle in [h for h in due if isinstance(h.error, ExecutionFencedError)]:
                self._due.pop(handle, None)  # fenced: nothing to renew, ever
            due = _one_per_key([h for h in due if h in self._due])
            for start in range(0, len(due), RENEW_BATCH):
                # Each statement on its own task: a slow answer does not hold back the
                # renewals that fall due meanwhile (a lease in flight is not sent twice).
                batch = due[start : start + RENEW_BATCH]
                self._in_flight.update(batch)
                task = asyncio.create_task(self._renew(batch), name="keeper renewal")
                self._sending.add(task)
                task.add_done_callback(self._sending.discard)

    async def _renew(self, handles: list[RunHandle]) -> None:
        """One renewal statement per store for ``handles``; each answer applied to its run."""
        try:
            await self._renew_batch(handles)
        finally:
            self._in_flight.difference_update(handles)

    async def _renew_batch(self, handles: list[RunHandle]) -> None:
        by_store: dict[int, tuple[ExecutionLeaseRepository, list[RunHandle]]] = {}
        for handle in handles:
            by_store.setdefault(id(handle.repository), (handle.repository, []))[1].append(handle)
        for repository, batch in by_store.values():
            sent_at = self._clock()
            left = {h: h.confirmed_until - sent_at for h in batch}
            epochs = {h: h.token for h in batch}
            # A connection error is retried while the earliest window of the batch lasts.
            earliest = min(batch, key=lambda h: h.confirmed_until)
            try:
                with retry_window(earliest):
                    answers = await repository.renew_many([h.lease for h in batch], self.ttl)
            except Exception as exc:
                # The store may be down for a moment: the watchdog decides when that has
                # lasted too long; until then the next renewal may get through.
                logger.warning("renewal of %d leases failed", len(batch), exc_info=True)
                for handle in batch:
                    handle.saw_store_error(exc)
                    if handle in self._due:
                        self._due[handle] = self._clock() + self.renew_interval
                continue
            self.batches.append(
                Batch(sent_at, len(batch), min(left.values()), self._clock() - sent_at)
            )
            del self.batches[:-4096]
            for handle, answer in zip(batch, answers, strict=True):
                # Not released while the statement ran, nor yielded and re-taken (a new
                # epoch): an answer about the old token would set the run's token back.
                if handle in self._due and handle.token == epochs[handle]:
                    self._answer(handle, answer, sent_at, left[handle])

    def _answer(
        self, handle: RunHandle, answer: Lease | ExecutionFencedError, sent_at: float, left: float
    ) -> None:
        if isinstance(answer, ExecutionFencedError):
            handle.record(answer)  # the run drains
            self._due.pop(handle, None)
            return
        if handle.error is not None:
            # The run had lost its lease (its window ran out): it stays stopped; this
            # renewal only told that nobody took the execution over.
            self._due.pop(handle, None)
            return
        handle.replace_lease(answer, sent_at=sent_at)
        self._due[handle] = self._next_due(handle)
        if left < self.renew_interval:
            late = f"renewed with {max(left, 0.0):.1f} s of its proven hold left"
            self._events.emit(EventKind.RENEWED_LATE, handle.scope_key, handle.token, late)

    # -- the watchdog

    async def _watch_loop(self) -> None:
        while self._due:
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

"""The keeper's renewal statements, on a controlled clock over the memory store."""

from __future__ import annotations

import asyncio
from collections.abc import Sequence

import pytest

from langgraph_fence import (
    ExecutionFencedError,
    ExecutionLeaseLostError,
    InstanceFullError,
    Lease,
    LeaseKey,
    MemoryLeaseRepository,
)
from langgraph_fence.events import Listeners
from langgraph_fence.execution.keeper import Keeper, default_max_held
from langgraph_fence.fence import RunHandle
from langgraph_fence.testing import ManualClock
from tests.support.clocks import SteppedClock
from tests.support.databases import unique
from tests.support.polling import eventually

TTL = 9.0


def keeper_on(clock: ManualClock) -> Keeper:
    """Instance A's keeper on the controlled clock: TTL 9 s, renewed every 3 s."""
    return Keeper(
        ttl=TTL,
        renew_interval=TTL / 3,
        clock=clock,
        sleep=clock.sleep,
        events=Listeners("A"),
        holder="A",
    )


async def test_two_runs_of_one_execution_due_at_once_renew_in_statements_of_their_own() -> None:
    """An instance can hold two handles of one key: the old run's, fenced but still in its
    step (it has not heard yet), and the new run's. Both due in one pass: the store refuses
    a statement naming a key twice, so sent together neither would ever be renewed, and the
    new run would lapse. Each goes in a statement of its own: the old one hears it was
    fenced, the new one is renewed."""
    clock = ManualClock()
    store = MemoryLeaseRepository(clock=clock)
    key = LeaseKey(unique("t"), unique("e"))
    first = await store.acquire(key, "A", TTL)
    assert first is not None
    old = RunHandle(store, first, TTL, clock=clock)
    clock.advance(TTL + 1)  # A's lease lapsed; A takes its own execution back (epoch 2)
    second = await store.acquire(key, "A", TTL)
    assert second is not None
    assert second.epoch == 2
    # Its renewal due now, as the old run's is.
    new = RunHandle(store, second, TTL, clock=clock, confirmed_from=clock() - TTL / 3)
    keeper = keeper_on(clock)
    before = new.confirmed_until
    keeper.keep(old)
    keeper.keep(new)
    try:
        await eventually(
            lambda: new.confirmed_until > before, timeout=10, what="the new run's renewal"
        )
        await eventually(
            lambda: isinstance(old.error, ExecutionFencedError),
            timeout=10,
            what="the old run to hear it was fenced",
        )
        assert new.error is None
    finally:
        await keeper.aclose()


class LateRenewals(MemoryLeaseRepository):
    """The memory store, whose renewal statements take ``delay`` seconds of the controlled
    clock to answer (an injected fault: a store answering late)."""

    def __init__(self, clock: ManualClock) -> None:
        super().__init__(clock=clock)
        self.clock = clock
        self.delay = 0.0

    async def renew_many(
        self, leases: Sequence[Lease], ttl: float
    ) -> list[Lease | ExecutionFencedError]:
        if self.delay:
            await self.clock.sleep(self.delay)
        return await super().renew_many(leases, ttl)


async def test_a_start_waits_while_renewals_run_late_and_is_refused_after_a_ttl() -> None:
    """Renewals answered with less than half a lease's on-time margin left (here 3 s late
    of 5.1 s) turn the keeper ``behind``: ``serve()``'s admission takes nothing, a new run
    waits (``in_time``) and, if they stay late for a whole TTL, is refused with
    ``InstanceFullError`` before anything of it is written. Once a renewal comes back in
    time the next start goes at once; the lease held was never lost."""
    clock = SteppedClock()
    store = LateRenewals(clock)
    lease = await store.acquire(LeaseKey(unique("t"), unique("e")), "A", TTL)
    assert lease is not None
    handle = RunHandle(store, lease, TTL, clock=clock)
    keeper = keeper_on(clock)
    assert keeper.margin == TTL - 0.9 - TTL / 3
    store.delay = 3.0
    keeper.keep(handle)
    try:
        await clock.step_until(lambda: keeper.behind, within=TTL)
        assert not keeper.try_admit()  # serve() takes nothing over meanwhile
        waiting = asyncio.create_task(keeper.in_time("run B"))
        asked_at = clock()
        await clock.step_until(lambda: clock() >= asked_at + TTL / 2, within=TTL)
        assert not waiting.done()  # it waits
        await clock.step_until(waiting.done, within=TTL)
        assert clock() >= asked_at + TTL  # for a whole TTL
        with pytest.raises(InstanceFullError, match="run late") as refused:
            await waiting
        assert "run B waited 9 s" in str(refused.value)
        assert "was not started (nothing was written)" in str(refused.value)
        assert handle.error is None  # the lease held came first, and is held
        store.delay = 0.0
        await clock.step_until(lambda: not keeper.behind, within=TTL)
        await asyncio.wait_for(keeper.in_time("run C"), 1)  # at once, no clock moved
        assert keeper.try_admit()
        assert handle.error is None
    finally:
        await keeper.aclose()


async def test_a_lapsed_lease_renewed_to_tell_its_fate_does_not_hold_back_new_runs() -> None:
    """A lease whose window ran out (its run is stopped) is renewed once more only to tell
    a takeover from a slow store: its negative window left says nothing of the pace of the
    renewals, so it does not turn the keeper ``behind``."""
    clock = SteppedClock()
    store = MemoryLeaseRepository(clock=clock)
    lease = await store.acquire(LeaseKey(unique("t"), unique("e")), "A", TTL)
    assert lease is not None
    handle = RunHandle(store, lease, TTL, clock=clock)
    keeper = keeper_on(clock)
    clock.advance(TTL)  # the window ran out before the first renewal went out
    keeper.keep(handle)
    try:
        await clock.step_until(lambda: len(keeper.batches) >= 1, within=TTL)
        assert keeper.batches[0].slack < 0
        assert isinstance(handle.error, ExecutionLeaseLostError)
        assert not keeper.behind
    finally:
        await keeper.aclose()


class HeldRenewals(MemoryLeaseRepository):
    """The memory store, whose renewal statements stay in flight (sent, not answered)
    until ``answer`` is set."""

    def __init__(self, clock: ManualClock) -> None:
        super().__init__(clock=clock)
        self.sent = asyncio.Event()
        self.answer = asyncio.Event()
        self.cancelled = False
        self.answered = False

    async def renew_many(
        self, leases: Sequence[Lease], ttl: float
    ) -> list[Lease | ExecutionFencedError]:
        self.sent.set()
        try:
            await self.answer.wait()
        except asyncio.CancelledError:
            self.cancelled = True
            raise
        answers = await super().renew_many(leases, ttl)
        self.answered = True
        return answers


async def test_a_renewal_in_flight_when_the_last_run_lets_go_is_answered_not_cancelled() -> None:
    """The last run an instance holds ends (or yields its lease) while its renewal is in
    flight: the keeper stops, but the statement is let end (its answer dropped), never
    cancelled. On SQLite a renewal cancelled while the database runs it keeps the write
    lock until the garbage collector frees its cursor (tests/integration/test_keeper.py);
    closing the keeper waits for it."""
    clock = ManualClock()
    store = HeldRenewals(clock)
    lease = await store.acquire(LeaseKey(unique("t"), unique("e")), "A", TTL)
    assert lease is not None
    handle = RunHandle(store, lease, TTL, clock=clock)
    keeper = keeper_on(clock)
    keeper.keep(handle)
    window = handle.confirmed_until
    try:
        clock.advance(TTL / 3)  # its renewal falls due and is sent
        await eventually(store.sent.is_set, timeout=10, what="the renewal to be sent")
        await keeper.release(handle)  # the run ended: the keeper holds nothing now
        assert not store.cancelled  # still in flight
    finally:
        store.answer.set()
        await keeper.aclose()  # waits for the renewal in flight
    assert store.answered
    assert not store.cancelled
    assert handle.confirmed_until == window  # the answer came for a run no longer kept


def test_max_held_follows_the_renew_interval() -> None:
    """Unless told, an instance holds as many executions as it renews at 3 000 leases a
    second: 10 000 at the default TTL (30 s, renewed every 10 s) where its renewals run in
    their own thread, 1 000 where they run on its loop; 3 000 at TTL 3 s; 1 000 at 1 s."""
    assert default_max_held(10.0, in_thread=True) == 10_000
    assert default_max_held(10.0, in_thread=False) == 1_000
    assert default_max_held(1.0, in_thread=True) == 3_000
    assert default_max_held(1 / 3, in_thread=True) == 1_000
    assert default_max_held(0.0001, in_thread=True) == 1

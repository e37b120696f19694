"""The keeper's renewal statements, on a controlled clock over the memory store."""

from __future__ import annotations

from langgraph_fence import ExecutionFencedError, LeaseKey, MemoryLeaseRepository
from langgraph_fence.events import Listeners
from langgraph_fence.fence import RunHandle
from langgraph_fence.keeper import Keeper
from langgraph_fence.testing import ManualClock
from tests.conftest import unique
from tests.polling import eventually

TTL = 9.0


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
    keeper = Keeper(
        ttl=TTL,
        renew_interval=TTL / 3,
        clock=clock,
        sleep=clock.sleep,
        events=Listeners("A"),
        holder="A",
    )
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

"""The takeover decision: take and decide in one guarded statement, on every store."""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from dataclasses import replace

import pytest
from sqlalchemy.ext.asyncio import AsyncEngine

from langgraph_fence import (
    Effect,
    ExecutionFencedError,
    ExecutionLeaseRepository,
    Lease,
    LeaseKey,
    LeaseStatus,
    PendingEffect,
    SqlLeaseRepository,
)
from langgraph_fence.lease.transitions import dead_letter_reason
from langgraph_fence.testing import ManualClock
from tests.support.databases import SQL_BACKENDS, unique

TTL = 10.0


async def expired(store: ExecutionLeaseRepository, clock: ManualClock) -> Lease:
    lease = await store.acquire(LeaseKey(unique("t"), unique("e")), "A", TTL)
    assert lease is not None
    clock.advance(TTL)
    return lease


async def stamped(
    store: ExecutionLeaseRepository, clock: ManualClock, effect: Effect
) -> tuple[Lease, PendingEffect]:
    lease = await store.acquire(LeaseKey(unique("t"), unique("e")), "A", TTL)
    assert lease is not None
    pending = PendingEffect(effect, "charge", unique("task"), lease.epoch)
    lease = await store.mark_pending_effect(lease, pending, TTL)
    clock.advance(TTL)
    return lease, pending


async def test_an_expired_execution_is_taken_at_the_next_epoch(
    lease_store: ExecutionLeaseRepository, clock: ManualClock
) -> None:
    old = await expired(lease_store, clock)
    taken = await lease_store.take_over(old, "B", TTL)
    assert taken is not None
    assert (taken.epoch, taken.holder, taken.status) == (2, "B", LeaseStatus.RUNNING)
    assert taken.expires_at == clock() + TTL
    assert await lease_store.get(old.key) == taken
    with pytest.raises(ExecutionFencedError):
        await lease_store.renew(old, TTL)


async def test_an_idempotent_write_in_flight_is_taken_and_its_stamp_cleared(
    lease_store: ExecutionLeaseRepository, clock: ManualClock
) -> None:
    old, _ = await stamped(lease_store, clock, Effect.IDEMPOTENT_WRITE)
    taken = await lease_store.take_over(old, "B", TTL)
    assert taken is not None
    assert taken.status is LeaseStatus.RUNNING
    assert taken.pending_effect is None


async def test_a_non_idempotent_write_in_flight_is_dead_lettered_by_the_take(
    lease_store: ExecutionLeaseRepository, clock: ManualClock
) -> None:
    old, pending = await stamped(lease_store, clock, Effect.NON_IDEMPOTENT_WRITE)
    decided = await lease_store.take_over(old, "B", TTL)
    assert decided is not None
    assert decided.status is LeaseStatus.DEAD_LETTERED
    assert decided.epoch == 2
    assert decided.holder is None
    assert decided.expires_at is None
    assert decided.pending_effect == pending  # kept, to show what may have happened
    assert decided.reason == dead_letter_reason([pending], 2, "B")
    assert "'charge'" in decided.reason
    assert "token 1" in decided.reason
    # Ended: nobody takes it again, and the old holder is fenced.
    assert await lease_store.take_over(decided, "C", TTL) is None
    assert await lease_store.acquire(old.key, "C", TTL) is None
    assert await lease_store.acquire(old.key, "C", TTL, reopen=True) is None
    with pytest.raises(ExecutionFencedError):
        await lease_store.renew(old, TTL)


async def test_a_run_renewed_after_the_candidate_query_is_skipped(
    lease_store: ExecutionLeaseRepository, clock: ManualClock
) -> None:
    old = await expired(lease_store, clock)
    [candidate] = [c for c in await lease_store.takeover_candidates(1000) if c.key == old.key]
    await lease_store.renew(old, TTL)  # its holder woke up in time
    assert await lease_store.take_over(candidate, "B", TTL) is None
    current = await lease_store.get(old.key)
    assert current is not None
    assert current.holder == "A"
    assert current.epoch == 1


async def test_a_stamp_made_after_the_candidate_query_decides_the_take(
    lease_store: ExecutionLeaseRepository, clock: ManualClock
) -> None:
    # The holder stamps a non-idempotent write after the candidate was read and then stalls
    # again: the decision is made on the row as it is, not on the stale candidate.
    old = await lease_store.acquire(LeaseKey(unique("t"), unique("e")), "A", 1.0)
    assert old is not None
    clock.advance(1.0)
    [candidate] = [c for c in await lease_store.takeover_candidates(1000) if c.key == old.key]
    assert candidate.pending_effect is None
    pending = PendingEffect(Effect.NON_IDEMPOTENT_WRITE, "charge", unique("task"), 1)
    await lease_store.mark_pending_effect(old, pending, 1.0)
    clock.advance(1.0)
    decided = await lease_store.take_over(candidate, "B", TTL)
    assert decided is not None
    assert decided.status is LeaseStatus.DEAD_LETTERED


async def test_a_pending_execution_handed_back_is_taken(
    lease_store: ExecutionLeaseRepository, clock: ManualClock
) -> None:
    lease = await lease_store.acquire(LeaseKey(unique("t"), unique("e")), "A", TTL)
    assert lease is not None
    handed = await lease_store.release(lease, LeaseStatus.PENDING, "drained")
    taken = await lease_store.take_over(handed, "B", TTL)
    assert taken is not None
    assert taken.epoch == 2
    assert taken.holder == "B"


async def test_a_live_or_ended_execution_is_not_taken(
    lease_store: ExecutionLeaseRepository, clock: ManualClock
) -> None:
    live = await lease_store.acquire(LeaseKey(unique("t"), unique("e")), "A", TTL)
    assert live is not None
    assert await lease_store.take_over(live, "B", TTL) is None
    done = await lease_store.release(live, LeaseStatus.DONE)
    clock.advance(TTL)
    assert await lease_store.take_over(done, "B", TTL) is None
    waiting_lease = await lease_store.acquire(LeaseKey(unique("t"), unique("e")), "A", TTL)
    assert waiting_lease is not None
    waiting = await lease_store.release(waiting_lease, LeaseStatus.WAITING)
    assert await lease_store.take_over(waiting, "B", TTL) is None


async def test_bad_input_is_refused(
    lease_store: ExecutionLeaseRepository, clock: ManualClock
) -> None:
    old = await expired(lease_store, clock)
    with pytest.raises(ValueError, match="holder"):
        await lease_store.take_over(old, "", TTL)
    with pytest.raises(ValueError, match="ttl"):
        await lease_store.take_over(old, "B", 0)
    with pytest.raises(ValueError, match="another store"):
        await lease_store.take_over(replace(old, store_id="elsewhere"), "B", TTL)
    current = await lease_store.get(old.key)
    assert current is not None
    assert current.epoch == 1


@pytest.mark.parametrize("backend", SQL_BACKENDS)
@pytest.mark.parametrize("effect", [None, Effect.NON_IDEMPOTENT_WRITE])
async def test_two_instances_racing_never_both_take_or_both_dead_letter(
    backend: str,
    effect: Effect | None,
    make_engine: Callable[[str], AsyncEngine],
    clock: ManualClock,
) -> None:
    stores = []
    for _ in range(8):
        store = SqlLeaseRepository(make_engine(backend), clock=clock)
        await store.setup()
        stores.append(store)
    for _ in range(5):
        old = await stores[0].acquire(LeaseKey(unique("t"), unique("e")), "A", TTL)
        assert old is not None
        if effect is not None:
            pending = PendingEffect(effect, "charge", unique("task"), 1)
            old = await stores[0].mark_pending_effect(old, pending, TTL)
        clock.advance(TTL)
        results = await asyncio.wait_for(
            asyncio.gather(*(s.take_over(old, f"B{i}", TTL) for i, s in enumerate(stores))),
            30,
        )
        winners = [r for r in results if r is not None]
        assert len(winners) == 1, results
        expected = LeaseStatus.RUNNING if effect is None else LeaseStatus.DEAD_LETTERED
        assert winners[0].status is expected
        assert winners[0].epoch == 2
    for store in stores:
        await store.engine.dispose()


async def test_a_clear_for_one_task_leaves_another_tasks_entry(
    lease_store: ExecutionLeaseRepository, clock: ManualClock
) -> None:
    lease = await lease_store.acquire(LeaseKey(unique("t"), unique("e")), "A", TTL)
    assert lease is not None
    first = PendingEffect(Effect.NON_IDEMPOTENT_WRITE, "charge", "task-1", 1)
    second = PendingEffect(Effect.NON_IDEMPOTENT_WRITE, "email", "task-2", 1)
    await lease_store.mark_pending_effect(lease, first, TTL)
    lease = await lease_store.mark_pending_effect(lease, second, TTL)
    # task-1's writes land while task-2 is mid-write: task-2's entry must stand, and a
    # takeover now must dead-letter, naming it.
    kept = await lease_store.clear_pending_effects(lease, [first.key])
    assert kept.pending_effects == (second,)
    assert (await lease_store.get(lease.key)) == kept
    clock.advance(TTL)
    decided = await lease_store.take_over(kept, "B", TTL)
    assert decided is not None
    assert decided.status is LeaseStatus.DEAD_LETTERED
    assert decided.reason == dead_letter_reason([second], 2, "B")
    assert "node 'email' at token 1" in decided.reason


@pytest.mark.parametrize("order", ["idempotent-first", "idempotent-last"])
async def test_a_take_over_names_every_non_idempotent_entry_in_key_order(
    lease_store: ExecutionLeaseRepository, clock: ManualClock, order: str
) -> None:
    lease = await lease_store.acquire(LeaseKey(unique("t"), unique("e")), "A", TTL)
    assert lease is not None
    entries = [
        PendingEffect(Effect.NON_IDEMPOTENT_WRITE, "tools:send_email", "task-b", 1, call="e/1"),
        PendingEffect(Effect.NON_IDEMPOTENT_WRITE, "charge 'x'", "task-a", 1),
        PendingEffect(Effect.NON_IDEMPOTENT_WRITE, "tools:charge_card", "task-b", 1, call="c/2"),
    ]
    idempotent = PendingEffect(Effect.IDEMPOTENT_WRITE, "refresh", "task-c", 1)
    stamps = [idempotent, *entries] if order == "idempotent-first" else [*entries, idempotent]
    for effect in stamps:
        lease = await lease_store.mark_pending_effect(lease, effect, TTL)
    clock.advance(TTL)
    decided = await lease_store.take_over(lease, "B", TTL)
    assert decided is not None
    assert decided.status is LeaseStatus.DEAD_LETTERED
    named = sorted(entries, key=lambda e: e.key)
    # The SQL stores build the reason in their one statement; it reads as the model's.
    assert decided.reason == dead_letter_reason(named, 2, "B")
    assert decided.pending_effects == tuple(sorted(stamps, key=lambda e: e.key))


async def test_only_idempotent_entries_standing_resume_with_the_set_cleared(
    lease_store: ExecutionLeaseRepository, clock: ManualClock
) -> None:
    lease = await lease_store.acquire(LeaseKey(unique("t"), unique("e")), "A", TTL)
    assert lease is not None
    for task in ("task-1", "task-2"):
        lease = await lease_store.mark_pending_effect(
            lease, PendingEffect(Effect.IDEMPOTENT_WRITE, "refresh", task, 1), TTL
        )
    clock.advance(TTL)
    taken = await lease_store.take_over(lease, "B", TTL)
    assert taken is not None
    assert taken.status is LeaseStatus.RUNNING
    assert taken.pending_effects == ()
    assert taken.holder == "B"
    assert taken.epoch == 2

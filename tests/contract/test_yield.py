"""The yield and the re-take (issue 11's remote-children wait), on every lease store.

A yielded lease is ``waiting`` with its holder kept: nothing writes under it, nobody takes
it over, and only its holder takes it again, at epoch + 1, unless anyone else took it first.
"""

from __future__ import annotations

from dataclasses import replace

import pytest

from langgraph_fence import Effect, ExecutionFencedError, LeaseStatus
from langgraph_fence.lease.transitions import is_takeover_candidate, is_yielded
from langgraph_fence.testing import ManualClock
from tests.support.leases import TTL, Store, held, refused_unchanged, stamp


async def test_a_yield_keeps_holder_epoch_and_stamps_and_gives_the_hold_up(
    lease_store: Store, clock: ManualClock
) -> None:
    lease = await held(lease_store)
    lease = await lease_store.mark_pending_effect(lease, stamp(1, Effect.IDEMPOTENT_WRITE), TTL)
    yielded = await lease_store.yield_lease(lease)
    assert (yielded.status, yielded.holder, yielded.epoch) == (LeaseStatus.WAITING, "A", 1)
    assert yielded.expires_at is None
    assert yielded.pending_effects == lease.pending_effects
    assert is_yielded(yielded.status, yielded.holder)
    assert await lease_store.get(lease.key) == yielded
    # Long past its old expiry it is no takeover candidate, and nobody's writes land.
    clock.advance(TTL * 10)
    assert yielded.key not in [c.key for c in await lease_store.takeover_candidates()]
    for op in (
        lambda: lease_store.renew(lease, TTL),
        lambda: lease_store.mark_pending_effect(lease, stamp(1), TTL),
        lambda: lease_store.clear_pending_effects(lease),
        lambda: lease_store.yield_lease(lease),
    ):
        await refused_unchanged(lease_store, lease.key, op)


async def test_the_holder_retakes_at_the_next_epoch(lease_store: Store, clock: ManualClock) -> None:
    lease = await held(lease_store)
    lease = await lease_store.mark_pending_effect(lease, stamp(1), TTL)
    yielded = await lease_store.yield_lease(lease)
    clock.advance(TTL * 3)
    taken = await lease_store.retake(yielded, TTL)
    assert (taken.status, taken.holder, taken.epoch) == (LeaseStatus.RUNNING, "A", 2)
    assert taken.expires_at == clock() + TTL
    # The same run goes on: its stamp set stands (only its own writes clear it).
    assert taken.pending_effects == lease.pending_effects
    assert await lease_store.get(lease.key) == taken
    # The old token is fenced; the new one writes.
    await refused_unchanged(lease_store, lease.key, lambda: lease_store.renew(lease, TTL))
    await lease_store.renew(taken, TTL)


async def test_a_retake_of_a_lease_still_held_moves_the_epoch(lease_store: Store) -> None:
    # A yield whose answer was lost (landed or not): the re-take settles it either way.
    lease = await held(lease_store)
    taken = await lease_store.retake(lease, TTL)
    assert (taken.status, taken.holder, taken.epoch) == (LeaseStatus.RUNNING, "A", 2)


async def test_a_yielded_lease_is_held_for_a_new_run(
    lease_store: Store, clock: ManualClock
) -> None:
    # A start of the thread while its tree waits for children takes nothing, however long
    # the wait (a yielded lease has no expiry): the waiter takes it again.
    lease = await held(lease_store)
    yielded = await lease_store.yield_lease(lease)
    clock.advance(10 * TTL)
    for reopen in (False, True):
        assert await lease_store.acquire(lease.key, "B", TTL, reopen=reopen) is None
    assert await lease_store.get(lease.key) == yielded
    assert (await lease_store.retake(yielded, TTL)).epoch == 2


@pytest.mark.parametrize("how", ["other_holder", "retaken_twice", "dead_lettered"])
async def test_a_retake_is_refused_once_anyone_else_took_it(
    lease_store: Store, clock: ManualClock, how: str
) -> None:
    lease = await held(lease_store)
    yielded = await lease_store.yield_lease(lease)
    probe = yielded
    if how == "other_holder":
        probe = replace(yielded, holder="B")
    elif how == "retaken_twice":
        await lease_store.retake(yielded, TTL)
    elif how == "dead_lettered":
        await lease_store.dead_letter(lease.key, "given up", epoch=1)
    await refused_unchanged(lease_store, lease.key, lambda: lease_store.retake(probe, TTL))


async def test_a_yield_of_a_lease_taken_over_is_refused(
    lease_store: Store, clock: ManualClock
) -> None:
    lease = await held(lease_store)
    clock.advance(TTL)
    assert await lease_store.acquire(lease.key, "B", TTL) is not None
    with pytest.raises(ExecutionFencedError):
        await lease_store.yield_lease(lease)


def test_a_woken_tree_is_a_candidate_only_from_its_not_before_time() -> None:
    from langgraph_fence import Lease, LeaseKey

    woken = Lease(LeaseKey("t", "e"), None, 3, 100.0, (), LeaseStatus.PENDING)
    assert not is_takeover_candidate(woken, 99.0)
    assert is_takeover_candidate(woken, 100.0)
    assert is_takeover_candidate(replace(woken, expires_at=None), 0.0)
    yielded = replace(woken, holder="A", status=LeaseStatus.WAITING, expires_at=None)
    assert not is_takeover_candidate(yielded, 1e12)


def test_a_woken_tree_is_held_for_a_new_run_until_its_not_before_time() -> None:
    from langgraph_fence import Lease, LeaseKey
    from langgraph_fence.lease.transitions import decide_acquire

    woken = Lease(LeaseKey("t", "e"), None, 3, 100.0, (), LeaseStatus.PENDING)
    assert decide_acquire(woken, woken.key, "B", TTL, 99.0, reopen=True) is None
    taken = decide_acquire(woken, woken.key, "B", TTL, 100.0, reopen=True)
    assert taken is not None
    assert (taken.holder, taken.epoch) == ("B", 4)


async def test_a_lease_handed_back_is_not_retaken(lease_store: Store) -> None:
    # Pending with no not-before time: handed back for anyone, not woken for its waiter.
    lease = await held(lease_store)
    await lease_store.release(lease, LeaseStatus.PENDING)
    await refused_unchanged(lease_store, lease.key, lambda: lease_store.retake(lease, TTL))

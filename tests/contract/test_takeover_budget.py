"""The takeover budget (issue 24, item 3), decided in the take-over statement on every store,
and the operator's two ways out of a dead letter: retry and abandon.

An execution whose step kills its process is taken over by each worker in turn; without a
budget the fleet dies one worker per lease TTL, forever. With ``max_takeovers`` the take that
would hand it to one more worker, with no new checkpoint since the last take, dead-letters it.
"""

from __future__ import annotations

from typing import Any

import pytest

from langgraph_fence import Effect, Lease, LeaseKey, LeaseStatus, PendingEffect
from langgraph_fence.testing import ManualClock
from tests.support.databases import unique

TTL = 10.0
BUDGET = 3


async def started(store: Any) -> Lease:
    lease = await store.acquire(LeaseKey(unique("t"), unique("e")), "w0", TTL)
    assert lease is not None
    return lease


async def crash_and_take(
    store: Any, clock: ManualClock, lease: Lease, taker: str, mark: str | None = None
) -> Lease:
    """The holder of ``lease`` dies (its lease expires); ``taker`` takes it over."""
    clock.advance(TTL)
    taken = await store.take_over(lease, taker, TTL, progress_mark=mark, max_takeovers=BUDGET)
    assert taken is not None
    return taken


async def test_an_execution_that_kills_every_taker_is_dead_lettered_past_the_budget(
    lease_store: Any, clock: ManualClock
) -> None:
    lease = await started(lease_store)
    for n in range(1, BUDGET + 1):
        lease = await crash_and_take(lease_store, clock, lease, f"w{n}")
        assert (lease.status, lease.holder, lease.takeovers) == (
            LeaseStatus.RUNNING,
            f"w{n}",
            n,
        )
    dead = await crash_and_take(lease_store, clock, lease, "w4")
    assert (dead.status, dead.holder, dead.expires_at) == (LeaseStatus.DEAD_LETTERED, None, None)
    assert dead.epoch == BUDGET + 2
    assert dead.reason is not None
    assert "crashed 3 workers in a row with no new checkpoint" in dead.reason
    assert "the last w3 at token 4" in dead.reason
    assert "max_takeovers=3" in dead.reason
    assert await lease_store.get(lease.key) == dead
    # Nobody takes it again: it is no longer a candidate.
    assert dead.key not in {c.key for c in await lease_store.takeover_candidates(limit=10_000)}


async def test_a_new_checkpoint_since_the_last_take_starts_the_count_again(
    lease_store: Any, clock: ManualClock
) -> None:
    lease = await started(lease_store)
    lease = await crash_and_take(lease_store, clock, lease, "w1")
    lease = await crash_and_take(lease_store, clock, lease, "w2")
    lease = await crash_and_take(lease_store, clock, lease, "w3")
    assert lease.takeovers == BUDGET
    # w3 wrote a checkpoint before it died: the take sees a new mark, the count is 1.
    lease = await crash_and_take(lease_store, clock, lease, "w4", mark="ckpt-1")
    assert (lease.status, lease.takeovers, lease.progress_mark) == (
        LeaseStatus.RUNNING,
        1,
        "ckpt-1",
    )
    lease = await crash_and_take(lease_store, clock, lease, "w5", mark="ckpt-1")
    lease = await crash_and_take(lease_store, clock, lease, "w6", mark="ckpt-1")
    assert (lease.status, lease.takeovers) == (LeaseStatus.RUNNING, BUDGET)
    dead = await crash_and_take(lease_store, clock, lease, "w7", mark="ckpt-1")
    assert dead.status is LeaseStatus.DEAD_LETTERED


async def test_a_handed_back_execution_spends_no_budget(
    lease_store: Any, clock: ManualClock
) -> None:
    # A graceful stop hands a run back as pending: nobody crashed, so taking it costs nothing.
    lease = await started(lease_store)
    for n in range(BUDGET * 2):
        lease = await lease_store.release(lease, LeaseStatus.PENDING, "drained")
        taken = await lease_store.take_over(lease, f"w{n}", TTL, max_takeovers=BUDGET)
        assert taken is not None
        assert (taken.status, taken.takeovers) == (LeaseStatus.RUNNING, 0)
        lease = taken


@pytest.mark.parametrize("status", [LeaseStatus.DONE, LeaseStatus.WAITING])
async def test_a_run_that_ends_or_reaches_an_interrupt_resets_the_budget(
    lease_store: Any, clock: ManualClock, status: LeaseStatus
) -> None:
    lease = await started(lease_store)
    lease = await crash_and_take(lease_store, clock, lease, "w1")
    lease = await crash_and_take(lease_store, clock, lease, "w2")
    released = await lease_store.release(lease, status)
    assert released.takeovers == 0
    again = await lease_store.acquire(lease.key, "w3", TTL, reopen=True)
    assert again is not None
    for n in range(BUDGET):
        again = await crash_and_take(lease_store, clock, again, f"x{n}")
    assert (again.status, again.takeovers) == (LeaseStatus.RUNNING, BUDGET)


async def test_without_a_budget_every_take_resumes(lease_store: Any, clock: ManualClock) -> None:
    lease = await started(lease_store)
    for n in range(BUDGET * 3):
        clock.advance(TTL)
        taken = await lease_store.take_over(lease, f"w{n}", TTL)
        assert taken is not None
        assert taken.status is LeaseStatus.RUNNING
        lease = taken
    assert lease.takeovers == BUDGET * 3


async def test_a_standing_non_idempotent_stamp_is_decided_before_the_budget(
    lease_store: Any, clock: ManualClock
) -> None:
    lease = await started(lease_store)
    for n in range(1, BUDGET + 1):
        lease = await crash_and_take(lease_store, clock, lease, f"w{n}")
    stamp = PendingEffect(Effect.NON_IDEMPOTENT_WRITE, "charge", "task-1", lease.epoch)
    lease = await lease_store.mark_pending_effect(lease, stamp, TTL)
    dead = await crash_and_take(lease_store, clock, lease, "w4")
    assert dead.status is LeaseStatus.DEAD_LETTERED
    assert dead.reason is not None
    assert "non-idempotent writes stamped" in dead.reason


async def test_retry_makes_a_dead_lettered_execution_pending_with_its_budget_reset(
    lease_store: Any, clock: ManualClock
) -> None:
    lease = await started(lease_store)
    for n in range(1, BUDGET + 2):
        lease = await crash_and_take(lease_store, clock, lease, f"w{n}")
    assert lease.status is LeaseStatus.DEAD_LETTERED
    retried = await lease_store.retry(lease.key)
    assert (retried.status, retried.holder, retried.reason, retried.takeovers) == (
        LeaseStatus.PENDING,
        None,
        None,
        0,
    )
    assert retried.epoch == lease.epoch
    assert retried.key in {c.key for c in await lease_store.takeover_candidates(limit=10_000)}
    # The whole budget again: the pending take, then BUDGET takeovers, then dead.
    taken = await lease_store.take_over(retried, "v0", TTL, max_takeovers=BUDGET)
    assert taken is not None
    assert taken.takeovers == 0
    for n in range(1, BUDGET + 1):
        taken = await crash_and_take(lease_store, clock, taken, f"v{n}")
        assert taken.status is LeaseStatus.RUNNING
    assert (await crash_and_take(lease_store, clock, taken, "v9")).status is (
        LeaseStatus.DEAD_LETTERED
    )


async def test_retry_refuses_what_it_must_not_run_again(
    lease_store: Any, clock: ManualClock
) -> None:
    running = await started(lease_store)
    with pytest.raises(ValueError, match="not dead_lettered"):
        await lease_store.retry(running.key)
    with pytest.raises(KeyError):
        await lease_store.retry(LeaseKey(unique("t"), "never-started"))
    # Dead-lettered mid non-idempotent write: a retry would repeat a write that may have
    # happened. Refused, and the row is left as it was.
    stamp = PendingEffect(Effect.NON_IDEMPOTENT_WRITE, "charge", "task-1", running.epoch)
    stamped = await lease_store.mark_pending_effect(running, stamp, TTL)
    dead = await crash_and_take(lease_store, clock, stamped, "w1")
    with pytest.raises(ValueError, match="node 'charge' at token 1"):
        await lease_store.retry(dead.key)
    assert await lease_store.get(dead.key) == dead


async def test_abandon_ends_a_dead_letter_failed_with_the_operators_reason(
    lease_store: Any, clock: ManualClock
) -> None:
    running = await started(lease_store)
    stamp = PendingEffect(Effect.NON_IDEMPOTENT_WRITE, "charge", "task-1", running.epoch)
    stamped = await lease_store.mark_pending_effect(running, stamp, TTL)
    dead = await crash_and_take(lease_store, clock, stamped, "w1")
    assert dead.status is LeaseStatus.DEAD_LETTERED
    abandoned = await lease_store.abandon(dead.key, "  charge refunded by hand (ops-42) ")
    assert (abandoned.status, abandoned.holder, abandoned.expires_at, abandoned.reason) == (
        LeaseStatus.FAILED,
        None,
        None,
        "abandoned by operator: charge refunded by hand (ops-42)",
    )
    # The token never goes back; the settled write no longer stands.
    assert (abandoned.epoch, abandoned.pending_effects) == (dead.epoch, ())
    assert await lease_store.get(dead.key) == abandoned
    assert dead.key not in {c.key for c in await lease_store.takeover_candidates(limit=10_000)}
    # A new turn on the thread may start again on the failed execution.
    reopened = await lease_store.acquire(dead.key, "w2", TTL, reopen=True)
    assert reopened is not None
    assert reopened.epoch == dead.epoch + 1
    assert reopened.pending_effects == ()


async def test_abandon_refuses_what_is_not_a_dead_letter_and_an_empty_reason(
    lease_store: Any, clock: ManualClock
) -> None:
    running = await started(lease_store)
    with pytest.raises(ValueError, match="is running, not dead_lettered"):
        await lease_store.abandon(running.key, "checked")
    with pytest.raises(KeyError):
        await lease_store.abandon(LeaseKey(unique("t"), "never-started"), "checked")
    dead = await crash_and_take(lease_store, clock, running, "w1")
    dead = await lease_store.dead_letter(dead.key, "poison", epoch=dead.epoch)
    for bad in ("", "   "):
        with pytest.raises(ValueError, match="reason must be a non-empty text"):
            await lease_store.abandon(dead.key, bad)
    assert await lease_store.get(dead.key) == dead
    failed = await lease_store.abandon(dead.key, "checked")
    with pytest.raises(ValueError, match="is failed, not dead_lettered"):
        await lease_store.abandon(dead.key, "again")
    assert await lease_store.get(dead.key) == failed


@pytest.mark.parametrize("bad", [0, -1, True, 1.5, "3"])
async def test_a_bad_budget_is_refused_naming_it(
    lease_store: Any, clock: ManualClock, bad: Any
) -> None:
    lease = await started(lease_store)
    clock.advance(TTL)
    with pytest.raises(ValueError, match="max_takeovers must be an int >= 1"):
        await lease_store.take_over(lease, "w1", TTL, max_takeovers=bad)
    assert await lease_store.get(lease.key) == lease

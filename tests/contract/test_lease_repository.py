"""The lease contract, run against every store (memory, SQLite, PostgreSQL) as a parameter.

Every store runs on the same :class:`ManualClock` (``clock``), so expiry is exact: a hold ends
when the store clock reaches ``expires_at``. The PostgreSQL store on its own clock (``now()``)
has a test of its own at the end.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import replace
from types import SimpleNamespace
from typing import Any, TypedDict

import pytest
from sqlalchemy.ext.asyncio import AsyncEngine, create_async_engine

import langgraph_fence.lease.sql as sql_store
from langgraph_fence import (
    Effect,
    ExecutionFencedError,
    Lease,
    LeaseKey,
    LeaseStatus,
    PendingEffect,
    SqlLeaseRepository,
)
from langgraph_fence.database import create_engine, normalize_url
from langgraph_fence.testing import ManualClock
from tests.support.databases import pg_engine_options, unique
from tests.support.leases import TTL, Store, held, new_key, refused_unchanged, stamp
from tests.support.polling import eventually


async def taken_over(store: Store, clock: ManualClock, lease: Lease, holder: str = "B") -> Lease:
    """Let ``lease`` expire and have ``holder`` take its key."""
    clock.advance(TTL)
    newer = await store.acquire(lease.key, holder, TTL)
    assert newer is not None
    assert newer.epoch == lease.epoch + 1
    return newer


# -- acquire


async def test_acquire_absent_takes_epoch_one(lease_store: Store, clock: ManualClock) -> None:
    key = new_key()
    lease = await lease_store.acquire(key, "A", TTL)
    assert lease == Lease(
        key=key,
        holder="A",
        epoch=1,
        expires_at=clock() + TTL,
        pending_effects=(),
        status=LeaseStatus.RUNNING,
        reason=None,
        store_id=lease_store.store_id,
    )
    assert await lease_store.get(key) == lease
    assert lease.scope_key == key.scope_key


async def test_acquire_held_is_refused_for_everyone(lease_store: Store, clock: ManualClock) -> None:
    lease = await held(lease_store)
    clock.advance(TTL - 0.5)
    assert await lease_store.acquire(lease.key, "B", TTL) is None
    # Not re-entrant either: the holder itself may not take a second token while it holds.
    assert await lease_store.acquire(lease.key, "A", TTL) is None
    assert await lease_store.acquire(lease.key, "B", TTL, reopen=True) is None
    assert await lease_store.get(lease.key) == lease


async def test_acquire_expired_at_exactly_expires_at(
    lease_store: Store, clock: ManualClock
) -> None:
    lease = await held(lease_store)
    assert lease.expires_at is not None
    clock.advance(lease.expires_at - clock())  # the store clock reads expires_at exactly
    taken = await lease_store.acquire(lease.key, "B", 5.0)
    assert taken is not None
    assert (taken.epoch, taken.holder, taken.status) == (2, "B", LeaseStatus.RUNNING)
    assert taken.expires_at == clock() + 5.0


@pytest.mark.parametrize("status", [LeaseStatus.PENDING, LeaseStatus.WAITING])
async def test_acquire_released_lease_takes_next_epoch(
    lease_store: Store, status: LeaseStatus
) -> None:
    lease = await held(lease_store)
    await lease_store.release(lease, status, reason="handed back")
    taken = await lease_store.acquire(lease.key, "B", TTL)
    assert taken is not None
    assert (taken.epoch, taken.holder, taken.status, taken.reason) == (
        2,
        "B",
        LeaseStatus.RUNNING,
        None,
    )


async def test_epochs_count_per_key(lease_store: Store, clock: ManualClock) -> None:
    first, second = await held(lease_store), await held(lease_store)
    assert first.epoch == second.epoch == 1
    for expected in range(2, 6):
        clock.advance(TTL)
        again = await lease_store.acquire(first.key, "A", TTL)
        assert again is not None
        assert again.epoch == expected
    # The other key's token did not move with the first key's takes.
    other = await lease_store.get(second.key)
    assert other is not None
    assert other.epoch == 1


@pytest.mark.parametrize("status", [LeaseStatus.DONE, LeaseStatus.FAILED])
async def test_terminal_lease_is_only_reopened_on_request(
    lease_store: Store, status: LeaseStatus
) -> None:
    lease = await held(lease_store)
    ended = await lease_store.release(lease, status, reason="finished")
    assert await lease_store.acquire(lease.key, "B", TTL) is None
    assert await lease_store.get(lease.key) == ended
    reopened = await lease_store.acquire(lease.key, "B", TTL, reopen=True)
    assert reopened is not None
    assert (reopened.epoch, reopened.holder, reopened.status, reopened.reason) == (
        2,
        "B",
        LeaseStatus.RUNNING,
        None,
    )


async def test_dead_lettered_is_never_reopened(lease_store: Store) -> None:
    lease = await held(lease_store)
    ended = await lease_store.dead_letter(lease.key, "stamp standing")
    assert await lease_store.acquire(lease.key, "B", TTL) is None
    assert await lease_store.acquire(lease.key, "B", TTL, reopen=True) is None
    assert await lease_store.get(lease.key) == ended


async def test_reopen_of_absent_or_free_lease_is_a_plain_take(lease_store: Store) -> None:
    key = new_key()
    lease = await lease_store.acquire(key, "A", TTL, reopen=True)
    assert lease is not None
    assert lease.epoch == 1
    await lease_store.release(lease, LeaseStatus.WAITING)
    again = await lease_store.acquire(key, "A", TTL, reopen=True)
    assert again is not None
    assert again.epoch == 2


@pytest.mark.parametrize("bad", ["", None, 7])
async def test_acquire_refuses_bad_holder(lease_store: Store, bad: object) -> None:
    key = new_key()
    with pytest.raises(ValueError, match="holder"):
        await lease_store.acquire(key, bad, TTL)  # type: ignore[arg-type]
    assert await lease_store.get(key) is None


@pytest.mark.parametrize("bad", [0, -1.0, float("nan"), float("inf"), True, "10"])
async def test_acquire_refuses_bad_ttl(lease_store: Store, bad: object) -> None:
    key = new_key()
    with pytest.raises(ValueError, match="ttl"):
        await lease_store.acquire(key, "A", bad)  # type: ignore[arg-type]
    assert await lease_store.get(key) is None


async def test_acquire_refuses_a_non_key(lease_store: Store) -> None:
    with pytest.raises(ValueError, match="LeaseKey"):
        await lease_store.acquire(("t", "e"), "A", TTL)  # type: ignore[arg-type]


# -- get


async def test_get_absent_is_none(lease_store: Store) -> None:
    assert await lease_store.get(new_key()) is None


# -- renew


async def test_renew_extends_from_store_now(lease_store: Store, clock: ManualClock) -> None:
    lease = await held(lease_store)
    clock.advance(4.0)
    renewed = await lease_store.renew(lease, 20.0)
    assert renewed == replace(lease, expires_at=clock() + 20.0)
    assert await lease_store.get(lease.key) == renewed
    # Renewing with the older value of the same hold is fine: epoch and holder still match.
    again = await lease_store.renew(lease, 1.0)
    assert again.expires_at == clock() + 1.0


async def test_renew_after_expiry_without_takeover_is_allowed(
    lease_store: Store, clock: ManualClock
) -> None:
    lease = await held(lease_store)
    clock.advance(TTL * 3)
    renewed = await lease_store.renew(lease, TTL)
    assert (renewed.epoch, renewed.expires_at) == (1, clock() + TTL)
    assert await lease_store.acquire(lease.key, "B", TTL) is None


async def test_renew_after_takeover_is_fenced(lease_store: Store, clock: ManualClock) -> None:
    lease = await held(lease_store)
    newer = await taken_over(lease_store, clock, lease)
    with pytest.raises(ExecutionFencedError) as caught:
        await lease_store.renew(lease, TTL)
    error = caught.value
    assert (error.scope_key, error.token_held, error.token_seen) == (lease.scope_key, 1, 2)
    assert lease.scope_key in str(error)
    assert await lease_store.get(lease.key) == newer


@pytest.mark.parametrize("action", ["renew", "release", "mark", "clear"])
@pytest.mark.parametrize(
    "guard", ["wrong_holder", "older_epoch", "newer_epoch", "released", "dead_lettered", "no_row"]
)
async def test_holder_operations_are_guarded(
    lease_store: Store, clock: ManualClock, action: str, guard: str
) -> None:
    lease = await held(lease_store)
    probe = lease
    if guard == "wrong_holder":
        probe = replace(lease, holder="B")
    elif guard == "older_epoch":
        await taken_over(lease_store, clock, lease, holder="A")  # same holder, newer epoch
    elif guard == "newer_epoch":
        probe = replace(lease, epoch=lease.epoch + 1)
    elif guard == "released":
        await lease_store.release(lease, LeaseStatus.WAITING)
    elif guard == "dead_lettered":
        await lease_store.dead_letter(lease.key, "given up")
    elif guard == "no_row":
        probe = replace(lease, key=new_key())
    ops: dict[str, Callable[[], object]] = {
        "renew": lambda: lease_store.renew(probe, TTL),
        "release": lambda: lease_store.release(probe, LeaseStatus.DONE),
        "mark": lambda: lease_store.mark_pending_effect(probe, stamp(probe.epoch), TTL),
        "clear": lambda: lease_store.clear_pending_effects(probe),
    }
    await refused_unchanged(lease_store, probe.key, ops[action])
    if guard == "no_row":
        assert await lease_store.get(lease.key) == lease  # the real key is untouched too


async def test_operations_touch_only_their_own_key(lease_store: Store, clock: ManualClock) -> None:
    one, two = await held(lease_store), await held(lease_store)
    clock.advance(1.0)
    marked = await lease_store.mark_pending_effect(one, stamp(1), TTL)
    await lease_store.renew(marked, TTL)
    await lease_store.release(marked, LeaseStatus.DONE)
    assert await lease_store.get(two.key) == two


# -- release


@pytest.mark.parametrize(
    "status", [LeaseStatus.PENDING, LeaseStatus.WAITING, LeaseStatus.DONE, LeaseStatus.FAILED]
)
async def test_release_with_each_allowed_status(lease_store: Store, status: LeaseStatus) -> None:
    lease = await held(lease_store)
    released = await lease_store.release(lease, status, reason="why")
    assert released == replace(lease, holder=None, expires_at=None, status=status, reason="why")
    assert await lease_store.get(lease.key) == released
    # The release ended the hold: a second release with the same lease is refused.
    await refused_unchanged(
        lease_store, lease.key, lambda: lease_store.release(lease, LeaseStatus.DONE)
    )


async def test_release_accepts_status_values_as_str(lease_store: Store) -> None:
    lease = await held(lease_store)
    released = await lease_store.release(lease, "waiting")  # type: ignore[arg-type]
    assert released.status is LeaseStatus.WAITING
    assert released.reason is None


@pytest.mark.parametrize("status", [LeaseStatus.RUNNING, LeaseStatus.DEAD_LETTERED, "bogus", None])
async def test_release_refuses_other_statuses(lease_store: Store, status: object) -> None:
    lease = await held(lease_store)
    with pytest.raises(ValueError, match="status must be one of done, failed, pending, waiting"):
        await lease_store.release(lease, status)  # type: ignore[arg-type]
    assert await lease_store.get(lease.key) == lease


async def test_release_keeps_a_standing_stamp(lease_store: Store) -> None:
    lease = await held(lease_store)
    effect = stamp(1)
    marked = await lease_store.mark_pending_effect(lease, effect, TTL)
    released = await lease_store.release(marked, LeaseStatus.FAILED, reason="crashed")
    assert released.pending_effects == (effect,)


@pytest.mark.parametrize("status", [LeaseStatus.PENDING, LeaseStatus.WAITING])
async def test_release_hands_the_stamp_set_on(lease_store: Store, status: LeaseStatus) -> None:
    lease = await held(lease_store)
    marked = await lease_store.mark_pending_effect(lease, stamp(1), TTL)
    released = await lease_store.release(marked, status)
    assert released.pending_effects == marked.pending_effects
    assert await lease_store.get(lease.key) == released


async def test_release_done_clears_the_stamp_set(lease_store: Store) -> None:
    # A run that ended done recorded every step it ran: the next run on the thread must
    # not find its stamps (with durability="exit" no write cleared them on the way).
    lease = await held(lease_store)
    await lease_store.mark_pending_effect(lease, stamp(1), TTL)
    marked = await lease_store.mark_pending_effect(lease, stamp(1, Effect.IDEMPOTENT_WRITE), TTL)
    assert len(marked.pending_effects) == 2
    released = await lease_store.release(marked, LeaseStatus.DONE)
    assert released.pending_effects == ()
    assert await lease_store.get(lease.key) == released


# -- the pending-effect stamp


async def test_mark_stamps_and_renews(lease_store: Store, clock: ManualClock) -> None:
    lease = await held(lease_store)
    clock.advance(7.0)
    effect = stamp(lease.epoch)
    marked = await lease_store.mark_pending_effect(lease, effect, 30.0)
    assert marked == replace(lease, pending_effects=(effect,), expires_at=clock() + 30.0)
    assert await lease_store.get(lease.key) == marked
    cleared = await lease_store.clear_pending_effects(marked, [effect.key])
    # Clearing does not renew.
    assert cleared == replace(marked, pending_effects=())
    assert await lease_store.get(lease.key) == cleared


@pytest.mark.parametrize("effect", list(Effect))
async def test_every_effect_round_trips(lease_store: Store, effect: Effect) -> None:
    lease = await held(lease_store)
    marked = await lease_store.mark_pending_effect(lease, stamp(1, effect), TTL)
    assert marked.pending_effect is not None
    assert marked.pending_effect.effect is effect


async def test_a_mark_of_the_same_key_replaces_its_entry(lease_store: Store) -> None:
    lease = await held(lease_store)
    first = stamp(1, Effect.IDEMPOTENT_WRITE)
    await lease_store.mark_pending_effect(lease, first, TTL)
    second = replace(first, effect=Effect.NON_IDEMPOTENT_WRITE, node="charge-again")
    marked = await lease_store.mark_pending_effect(lease, second, TTL)
    assert marked.pending_effects == (second,)


async def test_parallel_tasks_stamp_entries_of_their_own(lease_store: Store) -> None:
    # The double charge of one stamp per lease: a fast task's clear removed the stamp of a
    # slow task still mid-write. Each entry is cleared alone.
    lease = await held(lease_store)
    fast, slow = stamp(1), stamp(1)
    tool_call = replace(fast, call="charge_card/1", node="tools:charge_card")
    for effect in (fast, slow, tool_call):
        lease = await lease_store.mark_pending_effect(lease, effect, TTL)
    assert {e.key for e in lease.pending_effects} == {fast.key, slow.key, tool_call.key}
    assert [e.key for e in lease.pending_effects] == sorted(e.key for e in lease.pending_effects)
    cleared = await lease_store.clear_pending_effects(lease, [fast.key, tool_call.key])
    assert cleared.pending_effects == (slow,)
    assert await lease_store.get(lease.key) == cleared
    # A key not in the set is no error and changes nothing else.
    again = await lease_store.clear_pending_effects(cleared, [fast.key])
    assert again.pending_effects == (slow,)
    emptied = await lease_store.clear_pending_effects(again)
    assert emptied.pending_effects == ()


async def test_entries_keep_every_field(lease_store: Store) -> None:
    lease = await held(lease_store)
    effect = PendingEffect(
        Effect.NON_IDEMPOTENT_WRITE,
        "tools:send_email ünï \"q\" 'x'",
        unique("task:%/"),
        1,
        checkpoint_id="1f1ed67a-a288-6759-8000-76d3032dbda9",
        call="send_email/ab:c%",
    )
    await lease_store.mark_pending_effect(lease, effect, TTL)
    stored = await lease_store.get(lease.key)
    assert stored is not None
    assert stored.pending_effects == (effect,)


async def test_clear_refuses_keys_that_are_not_a_collection(lease_store: Store) -> None:
    lease = await held(lease_store)
    marked = await lease_store.mark_pending_effect(lease, stamp(1), TTL)
    with pytest.raises(ValueError, match="keys must be a collection"):
        await lease_store.clear_pending_effects(marked, marked.pending_effects[0].key)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="keys"):
        await lease_store.clear_pending_effects(marked, [""])
    assert await lease_store.get(lease.key) == marked


async def test_a_lost_lease_stamps_nothing(lease_store: Store, clock: ManualClock) -> None:
    lease = await held(lease_store)
    newer = await taken_over(lease_store, clock, lease)
    await refused_unchanged(
        lease_store, lease.key, lambda: lease_store.mark_pending_effect(lease, stamp(1), TTL)
    )
    current = await lease_store.get(lease.key)
    assert current == newer
    assert current.pending_effects == ()


# -- acquire decides a standing stamp in its one statement, as take_over does (guarantee 3)


@pytest.mark.parametrize("ended", ["expired", "failed"])
async def test_acquire_dead_letters_a_standing_non_idempotent_stamp(
    lease_store: Store, clock: ManualClock, ended: str
) -> None:
    lease = await held(lease_store)
    charge = stamp(1)
    lookup = PendingEffect(Effect.IDEMPOTENT_WRITE, "lookup", unique("task"), 1)
    await lease_store.mark_pending_effect(lease, charge, TTL)
    marked = await lease_store.mark_pending_effect(lease, lookup, TTL)
    if ended == "expired":
        clock.advance(TTL)  # the holder died mid-write
    else:
        await lease_store.release(marked, LeaseStatus.FAILED, reason="crashed")

    verdict = await lease_store.acquire(lease.key, "B", TTL, reopen=True)
    assert verdict is not None
    assert verdict.status is LeaseStatus.DEAD_LETTERED
    assert (verdict.epoch, verdict.holder, verdict.expires_at) == (2, None, None)
    assert verdict.reason == (
        "resumed at token 2 by B: non-idempotent writes stamped and never cleared: "
        "node 'charge' at token 1; they may have happened, so the execution is not repeated"
    )
    assert set(verdict.pending_effects) == {charge, lookup}, "kept for inspection"
    assert await lease_store.get(lease.key) == verdict
    # Dead-lettered: no run takes it again, and the stale holder cannot clear the stamp.
    assert await lease_store.acquire(lease.key, "C", TTL, reopen=True) is None
    await refused_unchanged(
        lease_store, lease.key, lambda: lease_store.clear_pending_effects(lease)
    )


async def test_acquire_takes_over_idempotent_stamps_and_clears_them(
    lease_store: Store, clock: ManualClock
) -> None:
    lease = await held(lease_store)
    await lease_store.mark_pending_effect(lease, stamp(1, Effect.IDEMPOTENT_WRITE), TTL)
    newer = await taken_over(lease_store, clock, lease)
    assert (newer.status, newer.holder, newer.pending_effects) == (LeaseStatus.RUNNING, "B", ())
    assert await lease_store.get(lease.key) == newer
    # The stale holder can no longer stamp or clear: its writes repeat under B's token.
    await refused_unchanged(
        lease_store, lease.key, lambda: lease_store.clear_pending_effects(lease)
    )


async def test_mark_refuses_a_non_effect(lease_store: Store) -> None:
    lease = await held(lease_store)
    with pytest.raises(ValueError, match="PendingEffect"):
        await lease_store.mark_pending_effect(lease, "non_idempotent_write", TTL)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="ttl"):
        await lease_store.mark_pending_effect(lease, stamp(1), 0)
    assert await lease_store.get(lease.key) == lease


# -- dead letters


async def test_dead_letter_without_epoch_ends_even_a_held_lease(lease_store: Store) -> None:
    lease = await held(lease_store)
    marked = await lease_store.mark_pending_effect(lease, stamp(1), TTL)
    ended = await lease_store.dead_letter(lease.key, "non-idempotent write may have run")
    assert ended == replace(
        marked,
        holder=None,
        expires_at=None,
        status=LeaseStatus.DEAD_LETTERED,
        reason="non-idempotent write may have run",
    )
    assert await lease_store.get(lease.key) == ended


async def test_dead_letter_at_the_current_epoch(lease_store: Store, clock: ManualClock) -> None:
    lease = await held(lease_store)
    newer = await taken_over(lease_store, clock, lease)
    ended = await lease_store.dead_letter(lease.key, "found stamped", epoch=newer.epoch)
    assert (ended.status, ended.epoch, ended.reason) == (
        LeaseStatus.DEAD_LETTERED,
        2,
        "found stamped",
    )


async def test_dead_letter_at_a_stale_epoch_is_fenced(
    lease_store: Store, clock: ManualClock
) -> None:
    lease = await held(lease_store)
    await taken_over(lease_store, clock, lease)
    await refused_unchanged(
        lease_store, lease.key, lambda: lease_store.dead_letter(lease.key, "stale", epoch=1)
    )
    await refused_unchanged(
        lease_store, lease.key, lambda: lease_store.dead_letter(lease.key, "future", epoch=3)
    )


async def test_dead_letter_of_an_absent_key(lease_store: Store) -> None:
    key = new_key()
    with pytest.raises(KeyError):
        await lease_store.dead_letter(key, "nothing there")
    with pytest.raises(KeyError):
        await lease_store.dead_letter(key, "nothing there", epoch=1)
    assert await lease_store.get(key) is None


@pytest.mark.parametrize("reason", ["", None, 3])
async def test_dead_letter_needs_a_reason(lease_store: Store, reason: object) -> None:
    lease = await held(lease_store)
    with pytest.raises(ValueError, match="reason"):
        await lease_store.dead_letter(lease.key, reason)  # type: ignore[arg-type]
    assert await lease_store.get(lease.key) == lease


# -- takeover candidates


async def test_takeover_candidates(lease_store: Store, clock: ManualClock) -> None:
    expired = await held(lease_store, ttl=1.0)
    live = await held(lease_store, ttl=100.0)
    pending = await lease_store.release(await held(lease_store), LeaseStatus.PENDING)
    waiting = await lease_store.release(await held(lease_store), LeaseStatus.WAITING)
    done = await lease_store.release(await held(lease_store), LeaseStatus.DONE)
    dead = await lease_store.dead_letter((await held(lease_store, ttl=1.0)).key, "gone")
    mine = {lease.key for lease in (expired, live, pending, waiting, done, dead)}
    clock.advance(1.0)  # `expired` ends exactly now

    found = await lease_store.takeover_candidates(limit=10_000)
    assert {c.key for c in found} & mine == {expired.key, pending.key}
    assert next(c for c in found if c.key == expired.key) == expired
    assert next(c for c in found if c.key == pending.key) == pending
    # Round-robin by tenant: each tenant's first candidate, then each one's second, ...;
    # within a tenant (and within a round), the longest expired or waiting first.
    rounds: list[int] = []
    seen: dict[str, list[float]] = {}
    for c in found:
        ages = seen.setdefault(c.key.tenant_id, [])
        ages.append(c.expires_at or 0.0)
        rounds.append(len(ages))
    assert rounds == sorted(rounds)
    assert all(ages == sorted(ages) for ages in seen.values())

    # Once taken, a candidate is one no more.
    assert await lease_store.acquire(expired.key, "B", TTL) is not None
    found = await lease_store.takeover_candidates(limit=10_000)
    assert {c.key for c in found} & mine == {pending.key}


async def test_takeover_candidates_take_turns_by_tenant(lease_store: Store) -> None:
    """A burst of one tenant's handed-back (or submitted) executions does not hide another
    tenant's: the candidates come round-robin by tenant."""
    burst, few = unique("burst"), unique("few")
    for tenant, count in ((burst, 5), (few, 2)):
        for _ in range(count):
            lease = await lease_store.acquire(LeaseKey(tenant, unique("e")), "A", TTL)
            assert lease is not None
            await lease_store.release(lease, LeaseStatus.PENDING)
    found = await lease_store.takeover_candidates(limit=10_000)
    mine = [c.key.tenant_id for c in found if c.key.tenant_id in (burst, few)]
    assert sorted(mine[:4]) == sorted([burst, burst, few, few])
    assert mine[4:] == [burst] * 3


async def test_takeover_candidates_start_after_the_tenant_claimed_for_last(
    lease_store: Store,
) -> None:
    """The claim order is the store's, told where to start: at each rank, the tenants
    after ``after_tenant`` first (a worker that claimed for one tenant turns to the next)."""
    base = unique("turn")
    tenants = [f"{base}-a", f"{base}-b", f"{base}-c"]
    for tenant in tenants:
        for _ in range(2):
            lease = await lease_store.acquire(LeaseKey(tenant, unique("e")), "A", TTL)
            assert lease is not None
            await lease_store.release(lease, LeaseStatus.PENDING)

    async def order(after: str | None) -> list[str]:
        found = await lease_store.takeover_candidates(limit=10_000, after_tenant=after)
        return [c.key.tenant_id for c in found if c.key.tenant_id in tenants]

    a, b, c = tenants
    assert await order(None) == [a, b, c, a, b, c]
    assert await order(a) == [b, c, a, b, c, a]
    assert await order(c) == [a, b, c, a, b, c]


async def test_takeover_candidates_limit(lease_store: Store, clock: ManualClock) -> None:
    for _ in range(3):
        await held(lease_store, ttl=1.0)
    clock.advance(1.0)
    assert len(await lease_store.takeover_candidates(limit=2)) == 2
    assert len(await lease_store.takeover_candidates(limit=1)) == 1
    for bad in (0, -1, True, 2.5):
        with pytest.raises(ValueError, match="limit"):
            await lease_store.takeover_candidates(limit=bad)  # type: ignore[arg-type]


# -- the store clock


async def test_now_is_the_store_clock(lease_store: Store, clock: ManualClock) -> None:
    assert await lease_store.now() == clock()
    clock.advance(2.5)
    assert await lease_store.now() == clock()


async def test_postgres_judges_expiry_by_now(
    make_engine: Callable[[str], AsyncEngine], monkeypatch: pytest.MonkeyPatch
) -> None:
    # If the store read this process's clock, every hold would look long expired.
    monkeypatch.setattr(sql_store, "time", SimpleNamespace(time=lambda: 1e12))
    store = SqlLeaseRepository(make_engine("postgresql"))  # clock=None: the database's now()
    await store.setup()
    before = await store.now()
    assert before < 1e11
    key = new_key()
    lease = await store.acquire(key, "A", 60.0)
    after = await store.now()
    assert lease is not None
    assert lease.expires_at is not None
    assert before + 60.0 <= lease.expires_at <= after + 60.0
    assert await store.acquire(key, "B", 60.0) is None
    assert key not in {c.key for c in await store.takeover_candidates(limit=10_000)}

    # A short hold ends by the database clock: poll with a deadline, no fixed sleep.
    short = await store.acquire(new_key(), "A", 0.05)
    assert short is not None
    taken = await eventually(
        lambda: store.acquire(short.key, "B", 60.0),
        interval=0,
        what="the database clock to pass expires_at",
    )
    assert (taken.epoch, taken.holder) == (2, "B")
    assert taken.expires_at is not None
    assert short.expires_at is not None
    assert taken.expires_at >= short.expires_at + 60.0 - 0.05


# -- text every store can hold (PostgreSQL refuses NUL; no driver encodes a lone surrogate)


@pytest.mark.parametrize("bad", ["A\x00B", "A\ud800"])
async def test_unstorable_holder_is_refused_everywhere(lease_store: Store, bad: str) -> None:
    key = new_key()
    with pytest.raises(ValueError, match="holder"):
        await lease_store.acquire(key, bad, TTL)
    assert await lease_store.get(key) is None


async def test_reasons_are_cleaned_alike_everywhere(lease_store: Store) -> None:
    lease = await held(lease_store)
    released = await lease_store.release(lease, LeaseStatus.FAILED, reason="boom\x00\ud800!")
    assert released.reason == "boom\ufffd\ufffd!"
    assert await lease_store.get(lease.key) == released
    ended = await lease_store.dead_letter(lease.key, "\x00")
    assert ended.reason == "\ufffd"
    with pytest.raises(ValueError, match="reason"):
        await lease_store.release(lease, LeaseStatus.DONE, reason=3)  # type: ignore[arg-type]


@pytest.mark.parametrize(
    "effect",
    [
        PendingEffect(effect="sometimes", node="n", task_id="t", token=1),  # type: ignore[arg-type]
        PendingEffect(effect=Effect.NON_IDEMPOTENT_WRITE, node="", task_id="t", token=1),
        PendingEffect(effect=Effect.NON_IDEMPOTENT_WRITE, node="n\x00", task_id="t", token=1),
        PendingEffect(effect=Effect.NON_IDEMPOTENT_WRITE, node="n", task_id=None, token=1),  # type: ignore[arg-type]
        PendingEffect(effect=Effect.NON_IDEMPOTENT_WRITE, node="n", task_id="t", token=True),
        PendingEffect(effect=Effect.NON_IDEMPOTENT_WRITE, node="n", task_id="t", token=-1),
    ],
)
async def test_unstorable_stamp_is_refused_everywhere(
    lease_store: Store, effect: PendingEffect
) -> None:
    lease = await held(lease_store)
    with pytest.raises(ValueError, match="effect"):
        await lease_store.mark_pending_effect(lease, effect, TTL)
    assert await lease_store.get(lease.key) == lease


async def test_a_stamp_given_as_str_reads_back_as_effect(lease_store: Store) -> None:
    lease = await held(lease_store)
    given = PendingEffect(effect="idempotent_write", node="n", task_id="t", token=1)  # type: ignore[arg-type]
    marked = await lease_store.mark_pending_effect(lease, given, TTL)
    assert marked.pending_effects == (given,)
    stored = await lease_store.get(lease.key)
    assert stored is not None
    assert stored.pending_effect is not None
    assert stored.pending_effect.effect is Effect.IDEMPOTENT_WRITE


# -- the hot paths cost one round trip on PostgreSQL


class WireLog:
    """Wraps an asyncpg connection's protocol and records every call that talks to the server."""

    WIRE = frozenset(
        {
            "bind_execute",
            "bind_execute_many",
            "prepare",
            "query",
            "execute",
            "bind",
            "close_statement",
        }
    )

    def __init__(self, protocol: Any, log: list[str]) -> None:
        self._protocol = protocol
        self._log = log

    def __getattr__(self, name: str) -> Any:
        attr = getattr(self._protocol, name)
        if name not in self.WIRE:
            return attr

        def call(*args: Any, **kwargs: Any) -> Any:
            self._log.append(name)
            return attr(*args, **kwargs)

        return call


async def test_postgres_hot_paths_are_one_round_trip(pg_schema: tuple[str, str]) -> None:
    url, schema = pg_schema
    engine = create_engine(url, pool_size=1, max_overflow=0, **pg_engine_options(schema))
    clock = ManualClock()
    try:
        store = SqlLeaseRepository(engine, clock=clock)
        await store.setup()  # a transaction on this very connection, then back to autocommit
        wire: list[str] = []
        async with engine.connect() as conn:
            raw = await conn.get_raw_connection()
            driver = raw.driver_connection
            driver._protocol = WireLog(driver._protocol, wire)  # type: ignore[union-attr]
        # Warm up: each statement is prepared once per connection, then reused.
        warm = await store.acquire(new_key(), "A", TTL)
        assert warm is not None
        warm = await store.renew(warm, TTL)
        warm = await store.mark_pending_effect(warm, stamp(1), TTL)
        warm = await store.clear_pending_effects(warm)
        await store.release(warm, LeaseStatus.WAITING)

        key = new_key()
        wire.clear()
        lease = await store.acquire(key, "A", TTL)
        assert lease is not None
        assert wire == ["bind_execute"], f"acquire: {wire}"
        for name, call in [
            ("renew", lambda: store.renew(lease, TTL)),
            ("mark", lambda: store.mark_pending_effect(lease, stamp(1), TTL)),
            ("clear", lambda: store.clear_pending_effects(lease)),
            ("release", lambda: store.release(lease, LeaseStatus.WAITING)),
            ("take", lambda: store.acquire(key, "B", TTL)),
        ]:
            wire.clear()
            await call()
            # One Bind/Execute/Sync: no BEGIN or COMMIT, no re-prepare.
            assert wire == ["bind_execute"], f"{name}: {wire}"
        # Acquire over a standing stamp decides it in the same statement: it clears an
        # idempotent one and dead-letters at a non-idempotent one, one round trip each.
        for effect, status in [
            (Effect.IDEMPOTENT_WRITE, LeaseStatus.RUNNING),
            (Effect.NON_IDEMPOTENT_WRITE, LeaseStatus.DEAD_LETTERED),
        ]:
            stamped = await store.acquire(new_key(), "A", TTL)
            assert stamped is not None
            await store.mark_pending_effect(stamped, stamp(1, effect), TTL)
            clock.advance(TTL)
            wire.clear()
            verdict = await store.acquire(stamped.key, "B", TTL)
            assert wire == ["bind_execute"], f"acquire over a {effect.value} stamp: {wire}"
            assert verdict is not None
            assert verdict.status is status
    finally:
        await engine.dispose()


async def test_postgres_store_on_a_plain_engine_still_commits(pg_schema: tuple[str, str]) -> None:
    # An engine the user made without langgraph-fence's create_engine (no autocommit).
    url, schema = pg_schema
    options = pg_engine_options(schema)
    plain = create_async_engine(normalize_url(url), **options)
    other = create_engine(url, **options)
    try:
        store = SqlLeaseRepository(plain, clock=ManualClock())
        await store.setup()
        lease = await store.acquire(new_key(), "A", TTL)
        assert lease is not None
        renewed = await store.renew(lease, TTL * 2)
        seen = await SqlLeaseRepository(other, clock=ManualClock()).get(lease.key)
        assert seen == replace(renewed, store_id=seen.store_id if seen else "")
    finally:
        await plain.dispose()
        await other.dispose()


class Counter(TypedDict):
    n: int


class StatementLog(WireLog):
    """Records the SQL text of every statement executed with its arguments (Bind/Execute)."""

    def __getattr__(self, name: str) -> Any:
        attr = getattr(self._protocol, name)
        if name not in ("bind_execute", "bind_execute_many"):
            return attr

        def call(state: Any, *args: Any, **kwargs: Any) -> Any:
            self._log.append(str(getattr(state, "query", "")))
            return attr(state, *args, **kwargs)

        return call


@pytest.mark.parametrize("durability", ["sync", "async"])
async def test_a_write_step_costs_one_round_trip_more_than_a_read(
    pg_schema: tuple[str, str], durability: str
) -> None:
    """The stamp is one round trip (with its renewal); its clear rides inside the saver's
    own write statement, so a write step pays nothing more, in the whole run."""
    from langgraph.graph import END, START, StateGraph
    from sqlalchemy import event

    from checkpointers import SqlCheckpointer
    from langgraph_fence import Instance, fence_graph
    from langgraph_fence.lease.records import SqlExecutionRecords

    url, schema = pg_schema
    wire: list[str] = []
    engine = create_engine(url, **pg_engine_options(schema))

    @event.listens_for(engine.sync_engine, "connect")
    def count_round_trips(dbapi_connection: Any, _record: Any) -> None:
        driver = dbapi_connection.driver_connection
        driver._protocol = StatementLog(driver._protocol, wire)

    async def charge(state: Counter) -> dict[str, Any]:
        return {"n": state["n"] + 1}

    try:
        store = SqlLeaseRepository(engine)
        saver = SqlCheckpointer(engine)
        records = SqlExecutionRecords(engine)
        for part in (store, saver, records):
            await part.setup()
        instance = Instance(store, saver, records=records)
        counts: dict[Effect, int] = {}
        for effect in (Effect.READ_ONLY, Effect.NON_IDEMPOTENT_WRITE):
            builder = StateGraph(Counter)
            builder.add_node("charge", charge)
            builder.add_edge(START, "charge")
            builder.add_edge("charge", END)
            graph = fence_graph(builder, effects={"charge": effect}).compile(
                checkpointer=instance.checkpointer, name=f"wire_{effect.value}"
            )
            runs = []
            for _ in range(8):  # then warm: statements prepared, pool connections open
                wire.clear()
                thread = unique("wire")
                await instance.ainvoke(
                    graph,
                    {"n": 0},
                    {"configurable": {"thread_id": thread}},
                    tenant_id="acme",
                    durability=durability,  # type: ignore[arg-type]
                )
                runs.append(sum(1 for query in wire if "fence_" in query))
            # A fresh pooled connection's set-up, a renewal on a slow box, or (durability
            # "async") a step's writes landing before its checkpoint, whose proof then clears
            # the stamp in a statement of its own, adds statements to a run; the fewest a
            # warm run needed is what its steps cost (seven warm runs: under load on two
            # cores, three all took the slow order once).
            counts[effect] = min(runs[1:])
        assert counts[Effect.NON_IDEMPOTENT_WRITE] == counts[Effect.READ_ONLY] + 1, counts
        await saver.aclose()
    finally:
        await engine.dispose()

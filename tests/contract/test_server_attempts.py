"""Agent Server attempts at the lease store (every backend): the newest attempt of a run
holds the thread; a newer attempt takes the lease over from an earlier attempt of its run in
one step; an attempt older than its run's newest never starts; any other holder is left to
the take (:mod:`langgraph_fence.lease.attempts`)."""

from __future__ import annotations

from typing import Any

import pytest

from langgraph_fence import ExecutionFencedError, LeaseStatus
from langgraph_fence.errors import ExecutionSupersededError
from langgraph_fence.lease.attempts import Attempt, server_attempt
from langgraph_fence.testing import ManualClock
from tests.support.leases import TTL, Store, new_key, stamp

RUN = "01a242de-fb57-7303-8854-81b32a2fd5c1"
OTHER_RUN = "01a242de-fb60-7000-8000-000000000000"


def supersede(store: Store) -> Any:
    return store.supersede  # type: ignore[attr-defined]


async def start(store: Store, key: Any, attempt: Attempt, holder: str) -> Any:
    """An attempt's start as the run start makes it: record (and take over), else take and
    record the epoch taken."""
    taken = await supersede(store)(key, attempt, holder, TTL)
    if taken is not None:
        return taken
    taken = await store.acquire(key, holder, TTL, reopen=True)
    assert taken is not None
    assert await store.record_epoch(key, attempt, taken.epoch)  # type: ignore[attr-defined]
    return taken


async def test_a_newer_attempt_takes_the_thread_over_from_the_earlier_one_at_once(
    lease_store: Store, clock: ManualClock
) -> None:
    key = new_key()
    first = await start(lease_store, key, Attempt(RUN, 1), "server-a")
    assert first.epoch == 1

    second = await supersede(lease_store)(key, Attempt(RUN, 2), "server-b", TTL)

    assert second is not None
    assert (second.epoch, second.holder, second.status) == (2, "server-b", LeaseStatus.RUNNING)
    assert await lease_store.get(key) == second
    assert await lease_store.newest_attempt(key, RUN) == 2  # type: ignore[attr-defined]
    # The earlier attempt is fenced: its next renewal is refused at once, before its TTL.
    with pytest.raises(ExecutionFencedError):
        await lease_store.renew(first, TTL)


async def test_a_non_idempotent_write_the_earlier_attempt_began_dead_letters_the_take(
    lease_store: Store,
) -> None:
    key = new_key()
    first = await start(lease_store, key, Attempt(RUN, 1), "server-a")
    await lease_store.mark_pending_effect(first, stamp(first.epoch), TTL)
    taken = await supersede(lease_store)(key, Attempt(RUN, 2), "server-b", TTL)
    assert taken is not None
    assert (taken.epoch, taken.status, taken.holder) == (2, LeaseStatus.DEAD_LETTERED, None)
    assert "node 'charge' at token 1" in (taken.reason or "")
    assert await lease_store.get(key) == taken


async def test_an_older_attempt_never_starts_after_a_newer_one(lease_store: Store) -> None:
    key = new_key()
    newer = await start(lease_store, key, Attempt(RUN, 2), "server-b")
    with pytest.raises(ExecutionSupersededError, match=r"attempt 1 of run .* superseded by"):
        await supersede(lease_store)(key, Attempt(RUN, 1), "server-a", TTL)
    assert await lease_store.get(key) == newer  # nothing written
    await lease_store.release(newer, LeaseStatus.DONE)
    with pytest.raises(ExecutionSupersededError):  # ended too: still refused
        await supersede(lease_store)(key, Attempt(RUN, 1), "server-a", TTL)


async def test_an_older_attempt_whose_take_lands_late_cannot_record_it(
    lease_store: Store,
) -> None:
    key = new_key()
    assert await supersede(lease_store)(key, Attempt(RUN, 1), "server-a", TTL) is None
    assert await supersede(lease_store)(key, Attempt(RUN, 2), "server-b", TTL) is None
    late = await lease_store.acquire(key, "server-a", TTL, reopen=True)
    assert late is not None
    assert not await lease_store.record_epoch(key, Attempt(RUN, 1), late.epoch)  # type: ignore[attr-defined]


async def test_any_other_holder_is_left_to_the_take(lease_store: Store) -> None:
    key = new_key()
    # An earlier run of the thread: runs are not ordered against each other, only attempts.
    held = await start(lease_store, key, Attempt(RUN, 1), "server-a")
    assert await supersede(lease_store)(key, Attempt(OTHER_RUN, 1), "server-b", TTL) is None
    assert await lease_store.get(key) == held
    # A holder that is no server attempt (a run of an Instance, an admin's hold).
    other = new_key()
    instance_run = await lease_store.acquire(other, "instance-a", TTL)
    assert await supersede(lease_store)(other, Attempt(RUN, 1), "server-b", TTL) is None
    assert await supersede(lease_store)(other, Attempt(RUN, 2), "server-b", TTL) is None
    assert await lease_store.get(other) == instance_run
    # The same attempt again (a repeat): no change.
    assert await supersede(lease_store)(key, Attempt(RUN, 1), "server-a", TTL) is None
    assert await lease_store.get(key) == held


def test_run_ids_and_attempts_are_checked() -> None:
    assert Attempt(RUN.upper(), 1) == Attempt(RUN, 1)
    for run_id, number in [("", 1), ("a b", 1), ("x" * 65, 1), (RUN, 0), (RUN, True), (RUN, "1")]:
        with pytest.raises(ValueError, match=r"run_id must be|run_attempt must be"):
            Attempt(run_id, number)


def test_a_server_run_without_its_attempt_is_refused_not_run_unfenced() -> None:
    server = {"langgraph_api_version": "0.16.7"}
    assert server_attempt({"configurable": {"thread_id": "t"}}) is None  # not the server's
    assert server_attempt(
        {"configurable": {"run_id": RUN}, "metadata": {**server, "run_attempt": 3}}
    ) == Attempt(RUN, 3)
    with pytest.raises(ValueError, match="cannot be fenced apart"):
        server_attempt({"configurable": {"run_id": RUN}, "metadata": server})
    with pytest.raises(ValueError, match="cannot be fenced apart"):
        server_attempt({"configurable": {}, "metadata": {**server, "run_attempt": 1}})

"""Agent Server attempts at the lease store (every backend): the newest attempt of a thread
holds it, an earlier one holding the lease is fenced by the newer one's start, and an
attempt older than the newest never starts (:mod:`langgraph_fence.lease.attempts`)."""

from __future__ import annotations

from typing import Any

import pytest

from langgraph_fence import ExecutionFencedError, LeaseStatus
from langgraph_fence.errors import ExecutionSupersededError
from langgraph_fence.lease.attempts import attempt_stamp, decide_supersede, server_attempt
from langgraph_fence.testing import ManualClock
from tests.support.leases import TTL, Store, new_key, stamp

RUN = "01a242de-fb57-7303-8854-81b32a2fd5c1"
LATER_RUN = "01a242de-fb60-7000-8000-000000000000"


def supersede(store: Store) -> Any:
    return store.supersede  # type: ignore[attr-defined]


async def test_a_later_attempt_fences_the_earlier_one_holding_the_lease(
    lease_store: Store, clock: ManualClock
) -> None:
    key = new_key()
    assert await supersede(lease_store)(key, attempt_stamp(RUN, 1)) is None  # nothing held
    first = await lease_store.acquire(key, "server-a", TTL)
    assert first is not None
    first = await lease_store.mark_pending_effect(first, stamp(first.epoch), TTL)

    fenced = await supersede(lease_store)(key, attempt_stamp(RUN, 2))

    assert fenced is not None
    assert (fenced.epoch, fenced.holder, fenced.status) == (2, None, LeaseStatus.PENDING)
    assert "attempt 2 of run" in (fenced.reason or "")
    assert await lease_store.get(key) == fenced
    # The earlier attempt is fenced: its next renewal is refused at once, before its TTL.
    with pytest.raises(ExecutionFencedError):
        await lease_store.renew(first, TTL)
    # The later attempt's take decides what the earlier one stamped: a non-idempotent write
    # may have happened, so the execution is dead-lettered rather than run again.
    taken = await lease_store.acquire(key, "server-b", TTL, reopen=True)
    assert taken is not None
    assert (taken.epoch, taken.status) == (3, LeaseStatus.DEAD_LETTERED)
    assert "node 'charge' at token 1" in (taken.reason or "")


async def test_an_earlier_attempt_never_starts_after_a_later_one(lease_store: Store) -> None:
    key = new_key()
    await supersede(lease_store)(key, attempt_stamp(RUN, 2))
    taken = await lease_store.acquire(key, "server-b", TTL)
    assert taken is not None
    with pytest.raises(ExecutionSupersededError, match=r"attempt 1 of run .* superseded by"):
        await supersede(lease_store)(key, attempt_stamp(RUN, 1))
    assert await lease_store.get(key) == taken  # nothing written
    # Ended too: the later attempt released, the earlier one is still refused.
    await lease_store.release(taken, LeaseStatus.DONE)
    with pytest.raises(ExecutionSupersededError):
        await supersede(lease_store)(key, attempt_stamp(RUN, 1))


async def test_a_later_run_of_the_thread_supersedes_every_attempt_of_an_earlier_run(
    lease_store: Store,
) -> None:
    key = new_key()
    await supersede(lease_store)(key, attempt_stamp(RUN, 1))
    held = await lease_store.acquire(key, "server-a", TTL)
    assert held is not None
    fenced = await supersede(lease_store)(key, attempt_stamp(LATER_RUN, 1))
    assert fenced is not None
    assert fenced.epoch == held.epoch + 1
    with pytest.raises(ExecutionSupersededError):
        await supersede(lease_store)(key, attempt_stamp(RUN, 3))


async def test_a_lease_no_server_attempt_took_is_left_to_the_take(lease_store: Store) -> None:
    key = new_key()
    held = await lease_store.acquire(key, "instance-a", TTL)  # a run of an Instance
    assert await supersede(lease_store)(key, attempt_stamp(RUN, 1)) is None
    assert await lease_store.get(key) == held
    # The same attempt again (the in-memory server restarted and counts from 1): no fence;
    # the take waits for the lease as for any holder.
    assert await supersede(lease_store)(key, attempt_stamp(RUN, 1)) is None
    assert await lease_store.get(key) == held


def test_stamps_sort_by_run_then_attempt() -> None:
    assert attempt_stamp(RUN, 2) < attempt_stamp(RUN, 10) < attempt_stamp(LATER_RUN, 1)
    assert attempt_stamp(RUN.upper(), 1) == attempt_stamp(RUN, 1)


@pytest.mark.parametrize(
    ("run_id", "attempt"),
    [("", 1), ("a b", 1), ("x" * 65, 1), (RUN, 0), (RUN, True), (RUN, "1"), (RUN, 10**9)],
)
def test_a_malformed_run_id_or_attempt_is_refused(run_id: Any, attempt: Any) -> None:
    with pytest.raises(ValueError, match=r"run_id must be|run_attempt must be"):
        attempt_stamp(run_id, attempt)


def test_a_server_run_without_its_attempt_is_refused_not_run_unfenced() -> None:
    server = {"langgraph_api_version": "0.16.7"}
    assert server_attempt({"configurable": {"thread_id": "t"}}) is None  # not the server's
    assert server_attempt(
        {"configurable": {"run_id": RUN}, "metadata": {**server, "run_attempt": 3}}
    ) == attempt_stamp(RUN, 3)
    with pytest.raises(ValueError, match="cannot be fenced apart"):
        server_attempt({"configurable": {"run_id": RUN}, "metadata": server})
    with pytest.raises(ValueError, match="cannot be fenced apart"):
        server_attempt({"configurable": {}, "metadata": {**server, "run_attempt": 1}})


def test_the_decision_refuses_before_it_looks_at_the_lease() -> None:
    key = new_key()
    with pytest.raises(ExecutionSupersededError):
        decide_supersede(key, None, attempt_stamp(RUN, 2), attempt_stamp(RUN, 1))

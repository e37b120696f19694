"""Run-level retries (issue 37): ``serve(run_retries={graph: RunRetry(...)})`` runs a
submitted run that failed with its graph's own error again, after the backoff on the store's
clock (the ``leases`` fixture's ManualClock), from its last checkpoint, up to its attempts,
counted in ``RunState.attempts``; never an error the policy does not retry, never over a
standing non-idempotent stamp."""

from __future__ import annotations

import asyncio
import re
from typing import Any, TypedDict

import pytest
from langgraph.graph import END, START, StateGraph

from langgraph_fence import (
    Effect,
    Instance,
    Lease,
    LeaseKey,
    LeaseStatus,
    PendingEffect,
    RunFailedError,
    RunRetry,
    fence_graph,
)
from langgraph_fence.testing import Leases
from tests.support.databases import unique
from tests.support.serving import cfg, look, stepped


class Flaky(TypedDict, total=False):
    fails: int
    log: list[str]


class Boom(RuntimeError):
    pass


def flaky(instance: Instance, calls: list[str], effect: Effect = Effect.READ_ONLY) -> Any:
    """prepare -> call -> END: ``call`` fails (``Boom``) its first ``fails`` attempts."""

    async def prepare(state: Flaky) -> dict[str, Any]:
        calls.append("prepare")
        return {"log": ["prepare"]}

    async def call(state: Flaky) -> dict[str, Any]:
        calls.append("call")
        if calls.count("call") <= state["fails"]:
            raise Boom(f"failure {calls.count('call')}")
        return {"log": [*state["log"], "call"]}

    builder: StateGraph[Any] = StateGraph(Flaky)
    builder.add_node("prepare", prepare)
    builder.add_node("call", call)
    builder.add_edge(START, "prepare")
    builder.add_edge("prepare", "call")
    builder.add_edge("call", END)
    graph = fence_graph(builder, effects={"call": effect})
    return graph.compile(checkpointer=instance.checkpointer, name="flaky")


async def test_a_failed_run_runs_again_after_its_backoff_until_it_succeeds(
    leases: Leases,
) -> None:
    client, worker = leases.instance("client"), leases.instance("worker")
    calls: list[str] = []
    retry = RunRetry(attempts=3, backoff=10.0, factor=2.0)
    loop = stepped(worker, {"flaky": flaky(worker, calls)}, run_retries={"flaky": retry})
    run = await client.submit("flaky", {"fails": 2}, cfg(unique("t")), tenant_id="a")
    await look(loop)
    state = await run.state()
    assert (state.status, state.attempts) == (LeaseStatus.PENDING, 2)
    assert state.not_before == leases.clock() + 10.0
    assert "attempt 1 of 3 failed" in (state.reason or "")
    assert "Boom" in (state.reason or "")
    leases.advance(9.9)
    await look(loop)
    assert calls == ["prepare", "call"]  # not before its backoff
    leases.advance(0.1)
    await look(loop)
    state = await run.state()
    assert (state.attempts, state.not_before) == (3, leases.clock() + 20.0)  # backoff doubled
    leases.advance(20.0)
    await look(loop)
    assert await run.result(timeout=5) == {"fails": 2, "log": ["prepare", "call"]}
    # Resumed from the last checkpoint each time: the step before ran once.
    assert calls == ["prepare", "call", "call", "call"]
    final = await run.state()
    assert (final.status, final.attempts, final.epoch) == (LeaseStatus.DONE, 3, 3)


@pytest.mark.parametrize(
    ("retry", "attempts"),
    [
        (RunRetry(attempts=2, backoff=0.0), 2),  # its attempts run out
        (RunRetry(attempts=5, backoff=0.0, retry_on=KeyError), 1),  # not an error it retries
        (RunRetry(attempts=5, backoff=0.0, retry_on=lambda e: "retry me" in str(e)), 1),
    ],
)
async def test_a_run_fails_when_its_attempts_run_out_or_its_error_is_not_retried(
    leases: Leases, retry: RunRetry, attempts: int
) -> None:
    client, worker = leases.instance("client"), leases.instance("worker")
    calls: list[str] = []
    loop = stepped(worker, {"flaky": flaky(worker, calls)}, run_retries={"flaky": retry})
    run = await client.submit("flaky", {"fails": 10}, cfg(unique("t")), tenant_id="a")
    for _ in range(attempts):
        await look(loop)
    with pytest.raises(RunFailedError, match="Boom"):
        await run.result(timeout=5)
    state = await run.state()
    assert (state.status, state.attempts) == (LeaseStatus.FAILED, attempts)
    assert calls.count("call") == attempts


async def test_a_failed_write_whose_stamp_stands_is_never_retried(leases: Leases) -> None:
    """The failing step was a non-idempotent write: it may have happened, so the run is not
    run again; it is dead-lettered after one attempt, as without a retry policy."""
    client, worker = leases.instance("client"), leases.instance("worker")
    calls: list[str] = []
    graph = flaky(worker, calls, effect=Effect.NON_IDEMPOTENT_WRITE)
    loop = stepped(worker, {"flaky": graph}, run_retries={"flaky": RunRetry(backoff=0.0)})
    run = await client.submit("flaky", {"fails": 1}, cfg(unique("t")), tenant_id="a")
    await look(loop)
    await look(loop)
    state = await run.state()
    assert (state.status, state.attempts) == (LeaseStatus.DEAD_LETTERED, 1)
    assert calls.count("call") == 1


@pytest.mark.parametrize(
    ("options", "says"),
    [
        ({"attempts": 0}, "attempts must be an int >= 1"),
        ({"backoff": -1.0}, "backoff must be 0 to"),
        ({"factor": 0.5}, "factor must be a number from 1"),
        ({"retry_on": "Boom"}, "retry_on must be an exception class"),
        ({"retry_on": (Boom, int)}, "retry_on must be an exception class"),
    ],
)
def test_a_bad_retry_policy_is_refused_naming_it(options: dict[str, Any], says: str) -> None:
    with pytest.raises(ValueError, match=re.escape(says)):
        RunRetry(**options)


async def test_run_retries_for_a_graph_not_served_is_refused(leases: Leases) -> None:
    worker = leases.instance("worker")
    graphs = {"flaky": flaky(worker, [])}
    with pytest.raises(ValueError, match="which this loop does not serve"):
        stepped(worker, graphs, run_retries={"other": RunRetry()})
    with pytest.raises(ValueError, match="must be a RunRetry"):
        stepped(worker, graphs, run_retries={"flaky": 3})


async def test_a_run_failing_beside_a_write_that_stands_is_not_retried(leases: Leases) -> None:
    """``charge`` (a non-idempotent write) was stamped beside ``check``, which failed (and
    LangGraph cancelled ``charge``): its stamp stands in the store, so the run ends failed
    after one attempt, never handed back to charge again (a take would dead-letter it)."""
    client, worker = leases.instance("client"), leases.instance("worker")
    charged: list[int] = []
    charging = asyncio.Event()

    async def charge(state: Flaky) -> dict[str, Any]:
        charged.append(1)  # its body runs only once its stamp landed
        charging.set()
        await asyncio.Event().wait()  # cut off mid-charge by its sibling's failure
        return {}

    async def check(state: Flaky) -> dict[str, Any]:
        await charging.wait()
        raise Boom("the check failed")

    builder: StateGraph[Any] = StateGraph(Flaky)
    builder.add_node("charge", charge)
    builder.add_node("check", check)
    builder.add_edge(START, "charge")
    builder.add_edge(START, "check")
    builder.add_edge("charge", END)
    builder.add_edge("check", END)
    graph = fence_graph(builder, effects={"charge": Effect.NON_IDEMPOTENT_WRITE}).compile(
        checkpointer=worker.checkpointer, name="pair"
    )
    loop = stepped(worker, {"pair": graph}, run_retries={"pair": RunRetry(backoff=0.0)})
    run = await client.submit("pair", {"fails": 0}, cfg(unique("t")), tenant_id="a")
    await look(loop)
    await look(loop)
    state = await run.state()
    assert (state.status, state.attempts) == (LeaseStatus.FAILED, 1)
    assert charged == [1]


async def test_a_stamp_landing_after_the_failed_runs_read_still_ends_it_failed(
    leases: Leases, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The stamp of a step LangGraph cancelled lands when its write, in flight at the
    cancel, reaches the store: possibly after the failed run's settle read the lease. The
    hand-back for another attempt still sees it (it is refused while such a stamp stands),
    so the run ends failed after one attempt, never retried into a dead letter."""
    client, worker = leases.instance("client"), leases.instance("worker")

    async def check(state: Flaky) -> dict[str, Any]:
        raise Boom("the check failed")

    builder: StateGraph[Any] = StateGraph(Flaky)
    builder.add_node("check", check)
    builder.add_edge(START, "check")
    builder.add_edge("check", END)
    graph = fence_graph(builder).compile(checkpointer=worker.checkpointer, name="late")
    repository = worker.host.repository
    read = repository.get
    landed: list[PendingEffect] = []

    async def read_then_the_stamp_lands(key: LeaseKey) -> Lease | None:
        found = await read(key)
        if found is not None and found.status is LeaseStatus.RUNNING and not landed:
            landed.append(PendingEffect(Effect.NON_IDEMPOTENT_WRITE, "charge", "t1", found.epoch))
            await leases.store.mark_pending_effect(found, landed[0], 30.0)
        return found

    monkeypatch.setattr(repository, "get", read_then_the_stamp_lands)
    loop = stepped(worker, {"late": graph}, run_retries={"late": RunRetry(backoff=0.0)})
    run = await client.submit("late", {"fails": 0}, cfg(unique("t")), tenant_id="a")
    await look(loop)
    await look(loop)
    assert landed, "the settle never read the lease"
    state = await run.state()
    assert (state.status, state.attempts) == (LeaseStatus.FAILED, 1)

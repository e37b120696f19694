"""Durable sleep (issue 37): ``get_execution_context().sleep(...)`` gives the lease and the
worker's slot back, and any worker resumes the execution at the time (not before), on the
store's clock (the ``leases`` fixture's ManualClock); the step runs again and its sleep is
over. The worker processes (one SIGKILLed while the tree sleeps) are in
``tests/chaos/test_durable_sleep_chaos.py``."""

from __future__ import annotations

import operator
from datetime import UTC, datetime, timedelta
from typing import Annotated, Any, TypedDict

import pytest
from langgraph.graph import END, START, StateGraph

from langgraph_fence import (
    ChildPlacement,
    Effect,
    ExecutionSleeping,
    Instance,
    LeaseKey,
    LeaseStatus,
    fence_graph,
    get_execution_context,
)
from langgraph_fence.testing import Leases
from tests.support.databases import unique
from tests.support.graphs import one_step
from tests.support.serving import cfg, look, stepped
from tests.support.shout import Work, build
from tests.support.sleep_graphs import Nap, nap_graph


class Logged(TypedDict, total=False):
    log: Annotated[list[str], operator.add]


def napping(instance: Instance, seen: list[tuple[str, float]], clock: Any) -> Any:
    """before -> nap -> after (``nap`` sleeps ``seconds`` first thing); each node says when
    it ran, on the store's clock."""
    return nap_graph(instance, lambda node, config: seen.append((node, clock())))


@pytest.mark.parametrize("durability", ["async", "sync", "exit"])
async def test_a_sleeping_tree_holds_no_lease_or_slot_and_resumes_at_its_time(
    leases: Leases, durability: str
) -> None:
    client = leases.instance("client")
    worker = leases.instance("worker", max_held=1)
    seen: list[tuple[str, float]] = []
    work = Work()
    graphs = {"nap": napping(worker, seen, leases.clock), "shout": build(worker, work)}
    loop = stepped(worker, graphs)
    thread = unique("t")
    run = await client.submit(
        "nap", {"log": [], "seconds": 5.0}, cfg(thread), tenant_id="a", durability=durability
    )
    await look(loop)
    slept_at = leases.clock()
    assert [name for name, _ in seen] == ["before", "nap"]
    state = await run.state()
    assert state.status is LeaseStatus.PENDING
    assert state.holder is None  # no lease held while it sleeps
    assert state.not_before == slept_at + 5.0
    assert "sleeping until" in (state.reason or "")
    # No slot held either: an instance that holds one execution at most runs other work.
    assert worker.host.keeper.held == 0
    other = await client.submit("shout", {"text": "meanwhile"}, cfg(unique("t")), tenant_id="a")
    await look(loop)
    assert await other.result(timeout=5) == {"text": "meanwhile", "out": "MEANWHILE"}
    leases.advance(4.9)
    await look(loop)
    assert [name for name, _ in seen] == ["before", "nap"]  # not before its time
    leases.advance(0.1)
    await look(loop)
    assert await run.result(timeout=5) == {"log": ["before", "nap", "after"], "seconds": 5.0}
    # The sleeping step ran again and found its sleep over; the step before did not.
    assert [name for name, _ in seen] == ["before", "nap", "nap", "woke", "after"]
    assert all(at >= slept_at + 5.0 for name, at in seen[2:])
    final = await run.state()
    assert final.status is LeaseStatus.DONE
    assert final.epoch == 2  # taken again at the next token


async def test_ainvoke_ends_with_the_sleep_and_a_worker_resumes_it(leases: Leases) -> None:
    caller = leases.instance("caller")
    worker = leases.instance("worker")
    seen: list[tuple[str, float]] = []
    graph = napping(caller, seen, leases.clock)
    thread = unique("t")
    wake = datetime.fromtimestamp(leases.clock() + 60, UTC)
    with pytest.raises(ExecutionSleeping) as sleeping:
        await caller.ainvoke(graph, {"log": [], "seconds": 60.0}, cfg(thread), tenant_id="a")
    assert sleeping.value.wake_at == wake.timestamp()
    assert thread in str(sleeping.value)
    loop = stepped(worker, {"nap": napping(worker, seen, leases.clock)})
    leases.advance(timedelta(seconds=60).total_seconds())
    await look(loop)
    assert [name for name, _ in seen] == ["before", "nap", "nap", "woke", "after"]
    lease = await leases.store.get(LeaseKey("a", thread))
    assert lease is not None
    assert lease.status is LeaseStatus.DONE


@pytest.mark.parametrize(
    ("until", "error"),
    [(-1.0, ValueError), (datetime(2030, 1, 1), ValueError), ("soon", TypeError)],
)
async def test_a_bad_sleep_fails_the_step_naming_it(
    leases: Leases, until: Any, error: type[Exception]
) -> None:
    caller = leases.instance("caller")

    async def nap(state: Nap) -> dict[str, Any]:
        await get_execution_context().sleep(until)
        return {}

    builder: StateGraph[Any] = StateGraph(Nap)
    builder.add_node("nap", nap)
    builder.add_edge(START, "nap")
    builder.add_edge("nap", END)
    graph = fence_graph(builder).compile(checkpointer=caller.checkpointer, name="nap")
    with pytest.raises(error, match="not_before"):
        await caller.ainvoke(graph, {"log": []}, cfg(unique("t")), tenant_id="a")


async def test_a_sleep_beside_a_write_keeps_the_write_and_does_not_repeat_it(
    leases: Leases,
) -> None:
    """``charge`` (a non-idempotent write) and ``nap`` run in one superstep: ``nap`` sleeps,
    ``charge``'s writes are kept (its stamp cleared by them), and the wake resumes only
    ``nap``: charged once, never dead-lettered."""
    client, worker = leases.instance("client"), leases.instance("worker")
    charged: list[int] = []

    async def charge(state: Logged) -> dict[str, Any]:
        charged.append(1)
        return {"log": ["charge"]}

    async def nap(state: Logged) -> dict[str, Any]:
        await get_execution_context().sleep(5.0)
        return {"log": ["nap"]}

    builder: StateGraph[Any] = StateGraph(Logged)
    builder.add_node("charge", charge)
    builder.add_node("nap", nap)
    for node in ("charge", "nap"):
        builder.add_edge(START, node)
        builder.add_edge(node, END)
    graph = fence_graph(builder, effects={"charge": Effect.NON_IDEMPOTENT_WRITE})
    loop = stepped(worker, {"pair": graph.compile(checkpointer=worker.checkpointer, name="pair")})
    run = await client.submit("pair", {"log": []}, cfg(unique("t")), tenant_id="a")
    await look(loop)
    assert (await run.state()).status is LeaseStatus.PENDING
    leases.advance(5.0)
    await look(loop)
    assert sorted((await run.result(timeout=5))["log"]) == ["charge", "nap"]
    assert (await run.state()).status is LeaseStatus.DONE
    assert charged == [1]


class Fan(TypedDict, total=False):
    results: list[Any]


def fanning(child: Any) -> Any:
    """A step that runs ``child`` (the nap graph, sleeping 60 s) as a PARENT_INSTANCE child
    and waits for it with ``return_exceptions=True``."""

    async def fan(state: Fan) -> dict[str, Any]:
        ctx = get_execution_context()
        kid = await ctx.spawn_child(
            "nap", {"log": [], "seconds": 60.0},
            placement=ChildPlacement.PARENT_INSTANCE, key="c0", graph=child,
        )  # fmt: skip
        results = await ctx.wait_children([kid], timeout=30, return_exceptions=True)
        return {
            "results": [type(r).__name__ if isinstance(r, BaseException) else r for r in results]
        }

    return fan


async def test_a_sleep_in_a_parent_instance_child_stops_the_tree_and_wakes_with_it(
    leases: Leases,
) -> None:
    """A PARENT_INSTANCE child whose step sleeps stops the whole tree, never handed to the
    parent's step as the child's result (even with return_exceptions=True); at the time a
    worker resumes the tree and the child goes on after its sleep."""
    instance = leases.instance("here")
    seen: list[str] = []
    child = nap_graph(instance, lambda node, config: seen.append(node))
    parent = one_step(instance, Fan, "fan", fanning(child), name="fan")
    thread = unique("t")
    with pytest.raises(ExecutionSleeping):
        await instance.ainvoke(parent, {"results": []}, cfg(thread), tenant_id="a")
    assert seen == ["before", "nap"]
    leases.advance(60.0)
    worker = leases.instance("worker")
    wchild = nap_graph(worker, lambda node, config: seen.append(node))
    loop = stepped(worker, {"fan": one_step(worker, Fan, "fan", fanning(wchild), name="fan")})
    await look(loop)
    assert seen[2:] == ["nap", "woke", "after"]  # from its own checkpoint: woke, went on
    lease = await leases.store.get(LeaseKey("a", thread))
    assert lease is not None
    assert lease.status is LeaseStatus.DONE

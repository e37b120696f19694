"""Issue 32, item 7: the takeover budget blames the poison pill, not its neighbours.

Worker A runs a poison pill and a healthy execution side by side and dies (frozen), as do
the two workers after it (two takeovers each, spent together): both executions are one
take from the budget. Worker B takes them: before, it took both and ran them together, the
pill killed it, and the next take dead-lettered both ("crashed 3 workers"), the healthy
one too. Now an execution's last take within its budget runs alone: B runs the pill alone
and dies, the pill is dead-lettered saying so, and worker C runs the healthy one, alone,
to its end. Both databases.
"""

from __future__ import annotations

import asyncio
import operator
from typing import Annotated, Any, TypedDict

import pytest
from langgraph.graph import END, START, StateGraph

from langgraph_fence import LeaseKey, LeaseStatus, fence_graph
from langgraph_fence.execution.serve import Server
from langgraph_fence.instance import Instance
from langgraph_fence.testing import Leases
from tests.support.databases import SQL_BACKENDS, unique
from tests.support.polling import eventually
from tests.support.serving import serving, until_status

RUNS_ON = SQL_BACKENDS

TTL = 30.0
BUDGET = 3


class Log(TypedDict, total=False):
    log: Annotated[list[str], operator.add]


class Fleet:
    """The pill (hangs its worker forever: the worker "dies") and the healthy graph (its
    step waits for ``go``), and who entered which step."""

    def __init__(self) -> None:
        self.entered: dict[tuple[str, str], asyncio.Event] = {}
        self.go = asyncio.Event()

    def inside(self, graph: str, instance: str) -> asyncio.Event:
        return self.entered.setdefault((graph, instance), asyncio.Event())

    def graph(self, instance: Instance, name: str) -> Any:
        async def prepare(state: Log) -> dict[str, Any]:
            return {"log": ["prepare"]}

        async def work(state: Log) -> dict[str, Any]:
            self.inside(name, instance.instance_id).set()
            if name == "pill":
                await asyncio.Event().wait()  # kills its worker
            await self.go.wait()
            return {"log": [f"{name} by {instance.instance_id}"]}

        builder = StateGraph(Log).add_sequence([prepare, work])
        builder.add_edge(START, "prepare")
        builder.add_edge("work", END)
        return fence_graph(builder).compile(checkpointer=instance.checkpointer, name=name)

    def graphs(self, instance: Instance) -> dict[str, Any]:
        return {name: self.graph(instance, name) for name in ("pill", "healthy")}


async def mark_of(db: Leases, key: LeaseKey) -> str:
    latest = await db.saver.aget_tuple(
        {"configurable": {"thread_id": key.execution_id, "tenant_id": key.tenant_id}}
    )
    assert latest is not None
    return str(latest.config["configurable"]["checkpoint_id"])


async def test_a_healthy_execution_that_shared_a_poison_pill_s_workers_is_not_blamed(
    db: Leases, monkeypatch: pytest.MonkeyPatch
) -> None:
    polls = 0
    take_work = Server.take_work

    async def counted(server: Server, free: int, **options: Any) -> None:
        nonlocal polls
        await take_work(server, free, **options)
        polls += 1

    monkeypatch.setattr(Server, "take_work", counted)
    fleet = Fleet()
    tenant = unique("acme")  # the session's schema may hold other tests' candidates
    pill = LeaseKey(tenant, unique("a-pill"))  # sorts first among equal expiries
    healthy = LeaseKey(tenant, unique("b-healthy"))
    a = db.instance("A", max_takeovers=BUDGET)
    runs_a = []
    for key, name in ((pill, "pill"), (healthy, "healthy")):
        graph = fleet.graphs(a)[name]
        config: Any = {"configurable": {"thread_id": key.execution_id}}
        runs_a.append(
            asyncio.create_task(
                a.ainvoke(graph, {"log": []}, config, tenant_id=tenant, durability="sync")
            )
        )
        await asyncio.wait_for(fleet.inside(name, "A").wait(), 10)
    db.stall(a)  # A dies running both
    marks = {key: await mark_of(db, key) for key in (pill, healthy)}
    for n in (1, 2):  # two more workers die running both, with no new checkpoint
        db.advance(TTL + 1)
        for key in (pill, healthy):
            lease = await db.store.get(key)
            assert lease is not None
            taken = await db.store.take_over(
                lease, f"dead-{n}", TTL, progress_mark=marks[key], max_takeovers=BUDGET
            )
            assert taken is not None
            assert (taken.takeovers, taken.status) == (n, LeaseStatus.RUNNING)
    db.advance(TTL + 1)
    b = db.instance("B", max_takeovers=BUDGET)
    stop_b = asyncio.Event()
    serve_b = asyncio.create_task(
        b.serve(
            fleet.graphs(b), concurrency=2, poll_interval=0.02, stop=stop_b, handle_signals=False
        )
    )
    c = db.instance("C", max_takeovers=BUDGET)
    try:
        await asyncio.wait_for(fleet.inside("pill", "B").wait(), 10)
        seen = polls
        await eventually(lambda: polls >= seen + 1)  # the look that took the pill is over
        db.stall(b)  # the pill kills B too
        db.advance(TTL + 1)
        async with serving(c, fleet.graphs(c)):

            async def decided() -> bool:  # taken by C, or dead-lettered by its take
                lease = await db.store.get(healthy)
                return lease is not None and (
                    lease.holder == "C" or lease.status is LeaseStatus.DEAD_LETTERED
                )

            await eventually(decided)
            # Only now may its step end (a frozen B's write landing first would be progress).
            fleet.go.set()
            await until_status(db, healthy, LeaseStatus.DONE, LeaseStatus.DEAD_LETTERED)
            await until_status(db, pill, LeaseStatus.DEAD_LETTERED)  # once C is free again
    finally:
        for instance in (a, b):
            db.resume(instance)
        serve_b.cancel()
        for run in runs_a:
            run.cancel()
        await asyncio.gather(serve_b, *runs_a, return_exceptions=True)
    done = await db.store.get(healthy)
    assert done is not None
    assert done.status is LeaseStatus.DONE, done.reason  # not blamed for the pill's deaths
    dead = await db.store.get(pill)
    assert dead is not None
    assert dead.reason is not None
    assert "crashed 3 workers in a row" in dead.reason, dead.reason
    assert "the last B at token 4, where serve() ran it alone: the likely cause" in dead.reason
    assert ("healthy", "B") not in fleet.entered  # B ran the pill's last take alone

"""What a fenced run costs on the wire beyond its checkpoints (issue 14): two round trips.

The take (the thread's binding, the execution record and the acquire) is ONE statement on
PostgreSQL and one ``BEGIN IMMEDIATE`` transaction on SQLite; the release carries the
outcome, known from how the graph ended (LangGraph's lifecycle callbacks), so the thread's
state is not read back. Counted at the driver on every connection but the checkpointer's
(:class:`Statements`) and, for the checkpointer, by its reads: a fenced run reads the thread
as often as the same run unfenced.
"""

from __future__ import annotations

import itertools
from collections.abc import AsyncIterator, Callable
from typing import Any, TypedDict

import pytest
from langchain_core.callbacks import AsyncCallbackManager, BaseCallbackHandler
from langgraph.graph import END, START, StateGraph
from langgraph.types import interrupt
from sqlalchemy.ext.asyncio import AsyncEngine

from checkpointers import SqlCheckpointer
from langgraph_fence import Instance, LeaseKey, LeaseStatus, fence_graph
from langgraph_fence.lease.records import SqlExecutionRecords
from langgraph_fence.lease.sql import SqlLeaseRepository
from tests.support.databases import SQL_BACKENDS, setup_all, unique
from tests.support.statements import Statements

RUNS_ON = SQL_BACKENDS


class Steps(TypedDict):
    n: int


class Counting(SqlCheckpointer):
    """The SQL saver, counting the checkpoint reads it is asked for."""

    reads = 0

    async def aget_tuple(self, config: Any) -> Any:
        self.reads += 1
        return await super().aget_tuple(config)


def linear(approve: bool = False) -> StateGraph[Steps]:
    def step(state: Steps) -> dict[str, Any]:
        return {"n": state["n"] + 1}

    def ask(state: Steps) -> dict[str, Any]:
        return {"n": state["n"] + int(interrupt("go on?"))}

    builder: StateGraph[Steps] = StateGraph(Steps)
    names = ["a", "b", "c"]
    for name in names:
        builder.add_node(name, ask if approve and name == "b" else step)
    builder.add_edge(START, names[0])
    for left, right in itertools.pairwise(names):
        builder.add_edge(left, right)
    builder.add_edge(names[-1], END)
    return builder


@pytest.fixture
async def parts(
    backend: str, make_engine: Callable[[str], AsyncEngine]
) -> AsyncIterator[tuple[AsyncEngine, Counting, Instance]]:
    engine = make_engine(backend)
    await setup_all(engine)
    saver = Counting(engine)
    await saver.setup()  # on this loop
    instance = Instance(
        SqlLeaseRepository(engine), saver, records=SqlExecutionRecords(engine), lease_ttl=60
    )
    yield engine, saver, instance
    await instance.aclose()
    await saver.aclose()
    await engine.dispose()


async def test_a_fenced_run_sends_two_round_trips_beyond_its_checkpoints(
    backend: str, parts: tuple[AsyncEngine, Counting, Instance]
) -> None:
    engine, saver, instance = parts
    fenced = fence_graph(linear()).compile(checkpointer=instance.checkpointer, name="steps")
    plain = linear().compile(checkpointer=saver, name="steps")
    tenant = unique("acme")
    statements = Statements(engine)

    async def run(graph: Any, thread: str) -> tuple[list[str], int]:
        await statements.take()
        reads = saver.reads
        config = {"configurable": {"thread_id": thread}}
        if graph is fenced:
            out = await instance.ainvoke(graph, {"n": 0}, config, tenant_id=tenant)
        else:
            out = await graph.ainvoke({"n": 0}, config)
        assert out == {"n": 3}
        return await statements.take(), saver.reads - reads

    for _ in range(2):  # warm: statements compiled and prepared, pool connections open
        await run(fenced, unique("warm"))
        await run(plain, unique("warm"))
    thread = unique("thread")
    _, plain_reads = await run(plain, unique("plain"))
    for turn in ("first run of the thread", "a later run"):
        sent, reads = await run(fenced, thread)
        # The same checkpoint reads as the unfenced run: the outcome is not read back.
        assert reads == plain_reads, (turn, reads, plain_reads)
        if backend == "postgresql":
            # The take (bind + record + acquire) in one statement, the release in one.
            assert sent == ["WITH EXISTING AS", "UPDATE FENCE_LEASES SET"], (turn, sent)
        else:
            # The take in one transaction (the write lock held from BEGIN IMMEDIATE), then
            # the release in one statement.
            assert sent == [
                "BEGIN IMMEDIATE",
                "INSERT INTO FENCE_THREAD_BINDINGS",
                "INSERT INTO FENCE_LEASES",
                "INSERT INTO FENCE_EXECUTIONS",
                "COMMIT",
                "UPDATE FENCE_LEASES SET",
            ], (turn, sent)
    lease = await instance.repository.get(LeaseKey(tenant, thread))
    assert lease is not None
    assert (lease.status, lease.epoch) == (LeaseStatus.DONE, 2)
    record = await instance.records.get(LeaseKey(tenant, thread))
    assert record is not None
    assert (record.graph, record.thread_id, record.input) == ("steps", thread, {"n": 0})


async def test_an_interrupt_is_told_by_the_graph_not_read_back(
    parts: tuple[AsyncEngine, Counting, Instance],
) -> None:
    """The run that stops at ``interrupt()`` releases ``waiting``, its resume ``done``; the
    thread's state is read by neither."""
    from langgraph.types import Command

    _, saver, instance = parts
    graph = fence_graph(linear(approve=True)).compile(
        checkpointer=instance.checkpointer, name="approve"
    )
    tenant, thread = unique("acme"), unique("thread")
    key = LeaseKey(tenant, thread)
    config = {"configurable": {"thread_id": thread}}
    reads = saver.reads
    out = await instance.ainvoke(graph, {"n": 0}, config, tenant_id=tenant)
    assert "__interrupt__" in out
    lease = await instance.repository.get(key)
    assert lease is not None
    assert lease.status is LeaseStatus.WAITING
    assert saver.reads - reads == 1  # LangGraph's own read at the start of the run
    reads = saver.reads
    out = await instance.ainvoke(graph, Command(resume=10), config, tenant_id=tenant)
    assert out == {"n": 12}
    lease = await instance.repository.get(key)
    assert lease is not None
    assert lease.status is LeaseStatus.DONE
    assert saver.reads - reads == 1


@pytest.mark.parametrize(
    ("breakpoint", "expected"),
    [
        ({"interrupt_before": ["b"]}, LeaseStatus.WAITING),
        ({"interrupt_after": ["b"]}, LeaseStatus.WAITING),
        # After the last step nothing is left to run: done, as the thread's state says.
        ({"interrupt_after": ["c"]}, LeaseStatus.DONE),
    ],
)
async def test_a_breakpoint_leaves_the_status_the_threads_state_says(
    parts: tuple[AsyncEngine, Counting, Instance],
    breakpoint: dict[str, list[str]],
    expected: LeaseStatus,
) -> None:
    _, _, instance = parts
    graph = fence_graph(linear()).compile(checkpointer=instance.checkpointer, name="pause")
    tenant, thread = unique("acme"), unique("thread")
    config = {"configurable": {"thread_id": thread}}
    await instance.ainvoke(graph, {"n": 0}, config, tenant_id=tenant, **breakpoint)
    lease = await instance.repository.get(LeaseKey(tenant, thread))
    assert lease is not None
    assert lease.status is expected
    state = await graph.aget_state({"configurable": {"thread_id": thread, "tenant_id": tenant}})
    assert bool(state.next) is (expected is LeaseStatus.WAITING)


async def test_an_update_of_the_state_reads_where_the_thread_stands(
    parts: tuple[AsyncEngine, Counting, Instance],
) -> None:
    """``aupdate_state`` runs no loop (LangGraph tells nothing of its end): the thread's
    state decides, ``waiting`` with a step left."""
    _, _, instance = parts
    graph = fence_graph(linear()).compile(checkpointer=instance.checkpointer, name="edit")
    tenant, thread = unique("acme"), unique("thread")
    config = {"configurable": {"thread_id": thread}}
    await instance.ainvoke(graph, {"n": 0}, config, tenant_id=tenant)
    await instance.aupdate_state(graph, config, {"n": 5}, as_node="a", tenant_id=tenant)
    lease = await instance.repository.get(LeaseKey(tenant, thread))
    assert lease is not None
    assert lease.status is LeaseStatus.WAITING
    out = await instance.ainvoke(graph, None, config, tenant_id=tenant)
    assert out == {"n": 7}


class Seen(BaseCallbackHandler):
    """A user's callback handler: the names of the runs it hears start."""

    run_inline = True

    def __init__(self) -> None:
        self.names: list[str] = []

    def on_chain_start(self, serialized: Any, inputs: Any, **kwargs: Any) -> None:
        self.names.append(str(kwargs.get("name")))


@pytest.mark.parametrize("kind", ["list", "manager"])
async def test_the_users_callbacks_hear_the_run_as_before(
    parts: tuple[AsyncEngine, Counting, Instance], kind: str
) -> None:
    """The run's own lifecycle handler is added beside the user's callbacks (a list or a
    manager), for the root graph only: the user's handler still hears every step."""
    _, saver, instance = parts
    graph = fence_graph(linear()).compile(checkpointer=instance.checkpointer, name="heard")
    seen = Seen()
    callbacks: Any = [seen] if kind == "list" else AsyncCallbackManager([seen], [seen])
    tenant, thread = unique("acme"), unique("thread")
    config = {"configurable": {"thread_id": thread}, "callbacks": callbacks}
    reads = saver.reads
    assert await instance.ainvoke(graph, {"n": 0}, config, tenant_id=tenant) == {"n": 3}
    assert {"heard", "a", "b", "c"} <= set(seen.names), seen.names
    assert saver.reads - reads == 1  # told by LangGraph, not read back
    lease = await instance.repository.get(LeaseKey(tenant, thread))
    assert lease is not None
    assert lease.status is LeaseStatus.DONE

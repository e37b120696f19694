"""Bad input writes nothing (issue 9 item 6), the same way on SQLite and PostgreSQL.

Every id, name and number the public entry points take is refused up front with a
``ValueError`` that names the argument, and afterwards no lease, execution record, thread
binding or checkpoint row exists (``Instance.open`` creates no table either).
"""

from __future__ import annotations

import asyncio
import re
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass
from typing import Any, TypedDict

import pytest
from langgraph.graph import END, START, StateGraph
from sqlalchemy import text
from sqlalchemy.ext.asyncio import AsyncEngine

from checkpointers import SqlCheckpointer
from langgraph_fence import Instance, SqlLeaseRepository, fence_graph
from langgraph_fence.database import create_engine
from langgraph_fence.lease.records import SqlExecutionRecords
from tests.support.databases import Database, pg_engine_options, setup_all, unique

#: A refusal comes before any I/O; an accepted serve() would run until this bound.
REFUSED_WITHIN = 30.0
BAD_TEXT = {"nul": "order\x0042", "surrogate": "order\ud80042"}
ROW_TABLES = (
    "fence_leases",
    "fence_executions",
    "fence_thread_bindings",
    "fence_checkpoints",
    "fence_checkpoint_writes",
)


class State(TypedDict, total=False):
    order: str


async def step(state: State) -> dict[str, Any]:
    return {"order": "done"}


@dataclass
class World:
    database: Database
    engine: AsyncEngine
    instance: Instance
    graph: Any

    async def rows(self) -> dict[str, int]:
        """How many rows each of the run tables holds (the database is this test's own)."""
        async with self.engine.connect() as conn:
            return {
                table: int((await conn.execute(text(f"SELECT count(*) FROM {table}"))).scalar_one())
                for table in ROW_TABLES
            }


def engine_options(database: Database) -> dict[str, Any]:
    return pg_engine_options(database.schema) if database.schema else {}


@pytest.fixture
async def world(database: Database) -> AsyncIterator[World]:
    engine = create_engine(database.url, **engine_options(database))
    await setup_all(engine)
    saver = SqlCheckpointer(engine)
    await saver.setup()  # on this loop
    records = SqlExecutionRecords(engine)
    instance = Instance(
        SqlLeaseRepository(engine), saver, instance_id=unique("inst"), records=records
    )
    graph = fence_graph(_builder()).compile(checkpointer=instance.checkpointer, name="orders")
    yield World(database, engine, instance, graph)
    await instance.aclose()
    await saver.aclose()
    await engine.dispose()


def config(thread_id: str) -> dict[str, Any]:
    return {"configurable": {"thread_id": thread_id}}


async def consume(stream: Any) -> None:
    async for _ in stream:
        pass


#: entry point -> (the argument the message must name, the call with the bad value).
RUN_CALLS: dict[str, tuple[str, Callable[[World, str], Awaitable[Any]]]] = {
    "ainvoke thread_id": (
        "thread_id",
        lambda w, bad: w.instance.ainvoke(w.graph, {"order": "1"}, config(bad), tenant_id="t"),
    ),
    "ainvoke thread_id with execution_id": (
        "thread_id",
        lambda w, bad: w.instance.ainvoke(
            w.graph, {"order": "1"}, config(bad), tenant_id="t", execution_id=unique("e")
        ),
    ),
    "ainvoke tenant_id": (
        "tenant_id",
        lambda w, bad: w.instance.ainvoke(w.graph, {"order": "1"}, config(unique()), tenant_id=bad),
    ),
    "ainvoke execution_id": (
        "execution_id",
        lambda w, bad: w.instance.ainvoke(
            w.graph, {"order": "1"}, config(unique()), tenant_id="t", execution_id=bad
        ),
    ),
    "ainvoke graph_name": (
        "graph_name",
        lambda w, bad: w.instance.ainvoke(
            w.graph, {"order": "1"}, config(unique()), tenant_id="t", graph_name=bad
        ),
    ),
    "astream thread_id": (
        "thread_id",
        lambda w, bad: consume(
            w.instance.astream(w.graph, {"order": "1"}, config(bad), tenant_id="t")
        ),
    ),
    "graph.ainvoke thread_id": (
        "thread_id",
        lambda w, bad: w.graph.ainvoke(
            {"order": "1"}, {"configurable": {"thread_id": bad, "tenant_id": "t"}}
        ),
    ),
    "Instance instance_id": (
        "instance_id",
        lambda w, bad: first_run(
            Instance(w.instance.repository, w.instance.checkpointer, instance_id=bad), w
        ),
    ),
    "serve graph name": (
        "graphs' names",
        lambda w, bad: w.instance.serve({bad: w.graph}, handle_signals=False),
    ),
}


async def first_run(instance: Instance, world: World) -> None:  # never reached: refused
    graph = fence_graph(_builder()).compile(checkpointer=instance.checkpointer, name="orders")
    await instance.ainvoke(graph, {"order": "1"}, config(unique()), tenant_id="t")


def _builder() -> StateGraph[State]:
    builder = StateGraph(State)
    builder.add_node("step", step)
    builder.add_edge(START, "step")
    builder.add_edge("step", END)
    return builder


@pytest.mark.parametrize("kind", sorted(BAD_TEXT))
@pytest.mark.parametrize("call", sorted(RUN_CALLS))
async def test_bad_text_is_refused_naming_the_argument_and_writes_nothing(
    world: World, call: str, kind: str
) -> None:
    argument, run = RUN_CALLS[call]
    with pytest.raises(ValueError, match=re.escape(argument)) as refused:
        await asyncio.wait_for(run(world, BAD_TEXT[kind]), timeout=REFUSED_WITHIN)
    assert type(refused.value) is not UnicodeEncodeError, "a bare encoding error names nothing"
    assert await world.rows() == dict.fromkeys(ROW_TABLES, 0)


OPEN_OPTIONS: dict[str, tuple[str, dict[str, Any]]] = {
    "instance_id nul": ("instance_id", {"instance_id": BAD_TEXT["nul"]}),
    "instance_id surrogate": ("instance_id", {"instance_id": BAD_TEXT["surrogate"]}),
    "lease_ttl 10**400": ("lease_ttl", {"lease_ttl": 10**400}),
    "lease_ttl inf": ("lease_ttl", {"lease_ttl": float("inf")}),
    "lease_ttl nan": ("lease_ttl", {"lease_ttl": float("nan")}),
    "lease_ttl True": ("lease_ttl", {"lease_ttl": True}),
    "lease_ttl 0": ("lease_ttl", {"lease_ttl": 0}),
    "renew_interval 10**400": ("renew_interval", {"renew_interval": 10**400}),
    "max_takeovers 0": ("max_takeovers", {"max_takeovers": 0}),
    "max_takeovers 10**400": ("max_takeovers", {"max_takeovers": 10**400}),
    "an unknown option": ("lease_tll", {"lease_tll": 3.0}),
}


@pytest.mark.parametrize("case", sorted(OPEN_OPTIONS))
async def test_instance_open_refuses_bad_options_before_creating_anything(
    database: Database, case: str
) -> None:
    argument, options = OPEN_OPTIONS[case]
    with pytest.raises(ValueError, match=argument):
        async with Instance.open(database.url, engine_options=engine_options(database), **options):
            pytest.fail("opened with bad options")
    engine = create_engine(database.url, **engine_options(database))
    try:
        async with engine.connect() as conn:
            if engine.dialect.name == "sqlite":
                query = "SELECT name FROM sqlite_master WHERE type = 'table'"
            else:
                query = "SELECT tablename FROM pg_tables WHERE schemaname = current_schema()"
            assert (await conn.execute(text(query))).all() == [], "no table, no row"
    finally:
        await engine.dispose()


SERVE_OPTIONS: dict[str, dict[str, Any]] = {
    "concurrency": {"concurrency": 0},
    "concurrency ": {"concurrency": 10**400},
    "poll_interval": {"poll_interval": 10**400},
    "max_takeovers": {"max_takeovers": 0},
}


@pytest.mark.parametrize("case", sorted(SERVE_OPTIONS))
async def test_serve_refuses_bad_numbers_naming_them(world: World, case: str) -> None:
    serving = world.instance.serve(
        {"orders": world.graph}, handle_signals=False, **SERVE_OPTIONS[case]
    )
    with pytest.raises(ValueError, match=case.strip()):
        await asyncio.wait_for(serving, timeout=REFUSED_WITHIN)
    assert await world.rows() == dict.fromkeys(ROW_TABLES, 0)


#: The calls that take a tenant, execution or thread id (issue 32, item 10: a 1 MB one
#: ended in PostgreSQL's ProgramLimitExceededError, after a first row was written).
ID_CALLS = sorted(call for call in RUN_CALLS if RUN_CALLS[call][0].endswith("_id"))


@pytest.mark.parametrize("call", [c for c in ID_CALLS if not c.startswith("Instance")])
async def test_an_over_long_id_is_refused_naming_it_and_its_limit(world: World, call: str) -> None:
    argument, run = RUN_CALLS[call]
    with pytest.raises(ValueError, match=re.escape(argument)) as refused:
        await asyncio.wait_for(run(world, "x" * (1 << 20)), timeout=REFUSED_WITHIN)
    assert "at most 256 bytes" in str(refused.value)
    assert len(str(refused.value)) < 1000  # the message does not repeat the megabyte
    assert await world.rows() == dict.fromkeys(ROW_TABLES, 0)

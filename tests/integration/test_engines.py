"""Every store over an engine the user made, and an instance built from parts (issue 9, 1 and 3).

A SQLite engine made with plain ``create_async_engine`` is refused by every store (its
driver's deferred transactions are rolled back by the pool: a lease would be granted that
was never stored); any PostgreSQL engine is accepted and every guarantee holds on it. An
``Instance(repository, saver)`` built from parts keeps its execution records in the lease
store's database, where another instance taking the execution over finds them.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any, TypedDict

import pytest
from langgraph.graph import END, START, StateGraph
from sqlalchemy import text
from sqlalchemy.ext.asyncio import AsyncEngine, create_async_engine

from checkpointers import SqlCheckpointer
from langgraph_fence import (
    ExecutionFencedError,
    Instance,
    LeaseKey,
    LeaseStatus,
    SqlLeaseRepository,
    fence_graph,
)
from langgraph_fence.database import create_engine, normalize_url
from langgraph_fence.lease.records import SqlExecutionRecords
from tests.support.databases import Database, pg_engine_options, unique
from tests.support.polling import eventually
from tests.support.serving import cfg, look, stepped
from tests.support.stream_graphs import orders

ENGINES = 8
ACQUIRES = 40
REFUSAL = r"langgraph_fence\.database\.create_engine"


def plain_engine(database: Database) -> AsyncEngine:
    """An engine as a user makes it from the SQLAlchemy docs: no langgraph-fence option."""
    url = normalize_url(database.url).render_as_string(hide_password=False)
    options = pg_engine_options(database.schema) if database.schema else {}
    return create_async_engine(url, **options)


def fence_engine(database: Database) -> AsyncEngine:
    options = pg_engine_options(database.schema) if database.schema else {}
    return create_engine(database.url, **options)


def users_engine(database: Database) -> AsyncEngine:
    """The engine a user builds an instance from parts with: plain where it is accepted
    (PostgreSQL), langgraph-fence's where the refusal says to (SQLite)."""
    return fence_engine(database) if database.url.startswith("sqlite") else plain_engine(database)


async def tables(engine: AsyncEngine) -> set[str]:
    async with engine.connect() as conn:
        if engine.dialect.name == "sqlite":
            rows = await conn.execute(text("SELECT name FROM sqlite_master WHERE type='table'"))
        else:
            rows = await conn.execute(
                text("SELECT tablename FROM pg_tables WHERE schemaname = current_schema()")
            )
        return {str(row[0]) for row in rows}


async def test_a_plain_sqlite_engine_is_refused_by_every_store(tmp_path: Path) -> None:
    plain = plain_engine(Database(f"sqlite+aiosqlite:///{tmp_path / 'plain.db'}", ""))
    try:
        for build in (SqlLeaseRepository, SqlCheckpointer, SqlExecutionRecords):
            with pytest.raises(ValueError, match=REFUSAL) as refused:
                build(plain)
            assert "sqlite+aiosqlite:///" in str(refused.value), "the message shows the fix"
        assert await tables(plain) == set(), "a refused engine is never written to"
    finally:
        await plain.dispose()


async def test_forty_acquires_from_eight_plain_engines_store_one_lease(
    database: Database,
) -> None:
    """The race of the issue: 40 concurrent acquires of one key from 8 engines the user
    made. Never a lease that was not stored: refused at construction, or exactly one
    holder, and it is the one the database keeps."""
    engines = [plain_engine(database) for _ in range(ENGINES)]
    checker = fence_engine(database)
    try:
        if database.url.startswith("sqlite"):
            for engine in engines:
                with pytest.raises(ValueError, match=REFUSAL):
                    SqlLeaseRepository(engine)
            # What the refusal says to do: the same race on create_engine's engines holds.
            await asyncio.gather(*(engine.dispose() for engine in engines))
            engines = [fence_engine(database) for _ in range(ENGINES)]
        stores = [SqlLeaseRepository(engine) for engine in engines]
        await stores[0].setup()
        key = LeaseKey(unique("tenant"), unique("race"))
        leases = await asyncio.gather(
            *(stores[i % ENGINES].acquire(key, f"holder-{i}", 30.0) for i in range(ACQUIRES))
        )
        won = [lease for lease in leases if lease is not None]
        assert len(won) == 1, f"{len(won)} of {ACQUIRES} acquires got the lease"
        stored = await SqlLeaseRepository(checker).get(key)
        assert stored is not None, "the lease handed out was never stored"
        assert (stored.holder, stored.epoch, stored.status) == (
            won[0].holder,
            1,
            LeaseStatus.RUNNING,
        )
    finally:
        await asyncio.gather(*(engine.dispose() for engine in [*engines, checker]))


class State(TypedDict, total=False):
    order: str
    charged: str


def order_graph(instance: Instance, entered: asyncio.Event, hang: asyncio.Event) -> Any:
    async def charge(state: State) -> dict[str, Any]:
        entered.set()
        if not hang.is_set():
            hang.set()  # only the first run (instance A) hangs here; the takeover goes on
            await asyncio.Event().wait()
        return {"charged": state["order"]}

    builder = StateGraph(State)
    builder.add_node("charge", charge)
    builder.add_edge(START, "charge")
    builder.add_edge("charge", END)
    fence_graph(builder)
    return builder.compile(checkpointer=instance.checkpointer, name="orders")


@asynccontextmanager
async def instance_from_parts(database: Database, name: str) -> AsyncIterator[Instance]:
    """An instance as docs/instances.md builds one from parts: a store and a saver, no
    records."""
    engine = users_engine(database)
    repository = SqlLeaseRepository(engine)
    await repository.setup()
    saver = SqlCheckpointer(engine)
    await saver.setup()
    instance = Instance(repository, saver, instance_id=unique(name), lease_ttl=3.0)
    try:
        yield instance
    finally:
        await instance.aclose()
        await saver.aclose()
        await engine.dispose()


@asynccontextmanager
async def instance_opened(database: Database, name: str) -> AsyncIterator[Instance]:
    options = pg_engine_options(database.schema) if database.schema else {}
    async with Instance.open(
        database.url, engine_options=options, instance_id=unique(name), lease_ttl=3.0
    ) as instance:
        yield instance


TAKERS: dict[str, Callable[[Database, str], Any]] = {
    "parts": instance_from_parts,
    "open": instance_opened,
}


@pytest.mark.parametrize("taker", sorted(TAKERS))
async def test_an_instance_from_parts_is_taken_over_elsewhere(
    database: Database, taker: str
) -> None:
    """A run started by an instance built from parts, abandoned mid-step, is taken over by
    another instance (built the same way, or by Instance.open) and finished there."""
    entered, hang = asyncio.Event(), asyncio.Event()
    key = LeaseKey("acme", unique("order"))
    config = {"configurable": {"thread_id": key.execution_id}}
    async with instance_from_parts(database, "a") as a:
        graph_a = order_graph(a, entered, hang)
        run_a = asyncio.create_task(
            a.ainvoke(graph_a, {"order": "42"}, config, tenant_id=key.tenant_id)
        )
        await asyncio.wait_for(entered.wait(), timeout=60)
        await a.aclose()  # A stops renewing, as a frozen or dead process does
        entered.clear()
        async with TAKERS[taker](database, "b") as b:
            stop = asyncio.Event()
            serving = asyncio.create_task(
                b.serve({"orders": order_graph(b, entered, hang)}, poll_interval=0.1, stop=stop)
            )
            try:

                async def done() -> Any:
                    lease = await b.repository.get(key)
                    if lease is not None and lease.status is LeaseStatus.DONE:
                        return lease
                    if serving.done():
                        serving.result()
                        pytest.fail("serve() ended before the takeover finished")
                    return None

                lease = await eventually(done, timeout=90, what="the takeover to finish")
            finally:
                stop.set()
                await asyncio.wait_for(serving, timeout=60)
            assert lease.epoch == 2, "taken over once, at the next token"
            state = await order_graph(b, entered, hang).aget_state(
                {"configurable": {"thread_id": key.execution_id, "tenant_id": key.tenant_id}}
            )
            assert state.values == {"order": "42", "charged": "42"}
        run_a.cancel()
        with pytest.raises((ExecutionFencedError, asyncio.CancelledError)):
            await run_a  # taken over: never done


async def test_a_run_served_from_parts_is_pinned_on_the_users_engine(database: Database) -> None:
    """A submitted run served by instances built from parts on the user's engine (plain
    ``create_async_engine`` on PostgreSQL: not in autocommit) keeps its pin: the checkpoint
    its input follows and its start are stored, not rolled back with the connection."""
    async with (
        instance_from_parts(database, "client") as client,
        instance_from_parts(database, "worker") as worker,
    ):
        thread = unique("t")
        await client.submit("orders", {"item": "b"}, cfg(thread), tenant_id="acme")
        await look(stepped(worker, {"orders": orders(worker)}))
        engine = client.repository.engine  # type: ignore[attr-defined]
        async with engine.connect() as conn:
            pinned = (
                await conn.execute(
                    text(
                        "SELECT e.input_after, e.started_at, r.started_at FROM "
                        "fence_executions e JOIN fence_runs r ON r.tenant_id = e.tenant_id "
                        "AND r.execution_id = e.execution_id WHERE e.execution_id = :t"
                    ),
                    {"t": thread},
                )
            ).one()
    input_after, started, run_started = pinned
    assert input_after is not None, "the pin was not stored"
    assert started is not None
    assert run_started is not None, "the run's start was not stored"

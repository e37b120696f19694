"""A PostgreSQL schema, chosen the same way everywhere (``Instance.open(url, schema=...)``,
``from_conn_string(..., schema=...)``, ``create_engine(url, schema=...)``) and created by
the stores' ``setup()`` when it does not exist yet (issue 33). Each test works in a schema
name that does not exist when it starts, and drops it at the end."""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any, TypedDict

import asyncpg
import pytest
from langgraph.graph import END, START, StateGraph
from sqlalchemy import text

from checkpointers import SqlCheckpointer
from langgraph_fence import Instance, LeaseKey, SqlLeaseRepository, fence_graph
from langgraph_fence.database import create_engine, normalize_url
from tests.support.databases import pg_admin


def _dsn(url: str) -> str:
    return normalize_url(url).set(drivername="postgresql").render_as_string(hide_password=False)


async def _tables(url: str, schema: str) -> set[str]:
    conn = await asyncpg.connect(_dsn(url), timeout=5)
    try:
        rows = await conn.fetch("SELECT tablename FROM pg_tables WHERE schemaname = $1", schema)
    finally:
        await conn.close()
    return {row["tablename"] for row in rows}


@pytest.fixture
def fresh_schema(pg_schema: tuple[str, str]) -> Iterator[tuple[str, str]]:
    """``(url, name)``: a schema name that does not exist yet; dropped after the test."""
    url, _ = pg_schema
    name = f"lgf_fresh_{uuid.uuid4().hex[:12]}"
    try:
        yield url, name
    finally:
        pg_admin(url, f'DROP SCHEMA IF EXISTS "{name}" CASCADE')


class State(TypedDict):
    n: int


def _graph(instance: Instance) -> Any:
    builder = StateGraph(State)
    builder.add_node("step", lambda state: {"n": state["n"] + 1})
    builder.add_edge(START, "step")
    builder.add_edge("step", END)
    return fence_graph(builder).compile(checkpointer=instance.checkpointer, name="count")


async def test_instance_open_creates_a_missing_schema_and_runs_in_it(
    fresh_schema: tuple[str, str],
) -> None:
    url, schema = fresh_schema
    async with Instance.open(url, schema=schema) as instance:
        graph = _graph(instance)
        config = {"configurable": {"thread_id": "t1", "tenant_id": "acme"}}
        assert await graph.ainvoke({"n": 1}, config) == {"n": 2}
    tables = await _tables(url, schema)
    assert {"fence_leases", "fence_checkpoints", "fence_executions"} <= tables
    # Nothing of the run outside the schema: the instance worked in it alone.
    async with Instance.open(url, schema=schema) as again:
        lease = await again.repository.get(LeaseKey("acme", "t1"))
        assert lease is not None
        assert lease.epoch == 1


async def test_from_conn_string_takes_the_schema_as_instance_open_does(
    fresh_schema: tuple[str, str],
) -> None:
    url, schema = fresh_schema
    async with SqlCheckpointer.from_conn_string(url, schema=schema) as saver:
        assert saver.engine.dialect.name == "postgresql"
    assert "fence_checkpoints" in await _tables(url, schema)
    async with SqlLeaseRepository.from_conn_string(url, schema=schema) as repository:
        assert await repository.get(LeaseKey("acme", "none")) is None
    assert "fence_leases" in await _tables(url, schema)


async def test_several_connections_create_one_missing_schema_at_once(
    fresh_schema: tuple[str, str],
) -> None:
    """Four stores set up at the same moment, each on an engine (and connections) of its
    own, as four processes starting together: each finds the schema made, once."""
    url, schema = fresh_schema
    engines = [create_engine(url, schema=schema) for _ in range(4)]
    try:
        await asyncio.gather(*(SqlLeaseRepository(engine).setup() for engine in engines))
        async with engines[0].connect() as conn:
            found = await conn.execute(
                text("SELECT count(*) FROM pg_namespace WHERE nspname = :s"), {"s": schema}
            )
            assert found.scalar() == 1
            assert (await conn.execute(text("SELECT current_schema()"))).scalar() == schema
    finally:
        for engine in engines:
            await engine.dispose()
    assert "fence_leases" in await _tables(url, schema)


async def test_a_role_that_may_not_create_the_schema_is_told_in_one_line(
    fresh_schema: tuple[str, str],
) -> None:
    url, schema = fresh_schema
    role = f"lgf_role_{uuid.uuid4().hex[:10]}"
    pg_admin(url, f'CREATE ROLE "{role}" LOGIN')
    try:
        as_role = normalize_url(url).set(username=role, password=None)
        with pytest.raises(ValueError, match="may not create it") as refused:
            async with Instance.open(as_role.render_as_string(hide_password=False), schema=schema):
                pass
        message = str(refused.value)
        assert len(message.splitlines()) == 1, message
        assert f"schema {schema!r} does not exist and this role may not create it" in message
        assert f'CREATE SCHEMA "{schema}"' in message
        assert refused.value.__suppress_context__  # one line, not the driver's chain
    finally:
        pg_admin(url, f'DROP ROLE IF EXISTS "{role}"')
    assert await _tables(url, schema) == set()


async def test_a_schema_with_a_sqlite_url_is_refused_naming_schema(tmp_path: Path) -> None:
    url = f"sqlite+aiosqlite:///{tmp_path / 'fence.db'}"
    with pytest.raises(ValueError, match=r"^schema: SQLite has no schemas .*leave schema out"):
        create_engine(url, schema="fence")
    with pytest.raises(ValueError, match=r"^schema: SQLite has no schemas"):
        async with Instance.open(url, schema="fence"):
            pass
    with pytest.raises(ValueError, match=r"^schema: SQLite has no schemas"):
        async with SqlCheckpointer.from_conn_string(url, schema="fence"):
            pass
    # Refused before anything was created.
    assert await asyncio.to_thread(lambda: list(tmp_path.iterdir())) == []


async def test_the_schema_is_given_once(pg_schema: tuple[str, str]) -> None:
    url, schema = pg_schema
    options = {"connect_args": {"server_settings": {"search_path": "other"}}}
    with pytest.raises(ValueError, match=r"pass it once, as schema="):
        create_engine(url, schema=schema, **options)
    with pytest.raises(ValueError, match=r"pass the schema once, as schema="):
        async with Instance.open(url, schema=schema, engine_options={"schema": "other"}):
            pass

"""Fixtures of more than one contract module: the sink's engines (``test_sinks.py`` and
``test_sinks_sync.py``) and an empty database to migrate (``test_lease_migrations.py`` and
``test_table_shapes.py``)."""

from __future__ import annotations

import uuid
from collections.abc import AsyncIterator, Callable
from pathlib import Path

import pytest
from sqlalchemy import text
from sqlalchemy.ext.asyncio import AsyncEngine

from langgraph_fence.database import create_engine, transaction
from langgraph_fence.sinks import setup_sink
from tests.support.databases import pg_admin, pg_engine_options
from tests.support.sinks import USER_TABLE


@pytest.fixture
async def engines(
    backend: str, make_engine: Callable[[str], AsyncEngine]
) -> AsyncIterator[tuple[AsyncEngine, AsyncEngine]]:
    """Two engines on one database (two instances), the sink set up, a user table beside it."""
    first, second = make_engine(backend), make_engine(backend)
    assert await setup_sink(first) == 1
    assert await setup_sink(second) == 1  # a second instance migrating is a no-op
    async with transaction(first) as conn:
        await conn.execute(text(USER_TABLE[backend]))
    yield first, second
    await first.dispose()
    await second.dispose()


@pytest.fixture
def engine(engines: tuple[AsyncEngine, AsyncEngine]) -> AsyncEngine:
    return engines[0]


@pytest.fixture
async def fresh_engine(
    backend: str, request: pytest.FixtureRequest, tmp_path: Path
) -> AsyncIterator[AsyncEngine]:
    """An engine on an empty database: a new SQLite file, or a PostgreSQL schema of its own."""
    if backend == "sqlite":
        engine = create_engine(f"sqlite+aiosqlite:///{tmp_path / 'old.db'}")
        yield engine
        await engine.dispose()
        return
    url, _ = request.getfixturevalue("pg_schema")
    schema = f"lgf_migrate_{uuid.uuid4().hex[:12]}"
    pg_admin(url, f'CREATE SCHEMA "{schema}"')
    engine = create_engine(url, **pg_engine_options(schema))
    try:
        yield engine
    finally:
        await engine.dispose()
        pg_admin(url, f'DROP SCHEMA IF EXISTS "{schema}" CASCADE')

"""Databases for tests: the backends, PostgreSQL schemas and engines, every table.

The fixtures built on these (``backend``, ``pg_schema``, ``own_schema``, ``database``,
``make_engine``...) are in ``tests/conftest.py``; test modules import what is here.
PostgreSQL is found at ``LANGGRAPH_FENCE_PG_URL`` (default :data:`DEFAULT_PG_URL`);
``LANGGRAPH_FENCE_REQUIRE_PG=1`` makes its absence a failure instead of a skip.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import os
import sys
import uuid
from pathlib import Path
from typing import Any

import pytest
import sqlalchemy as sa
from sqlalchemy.ext.asyncio import AsyncEngine

from langgraph_fence.database import normalize_url
from langgraph_fence.lease.stores import SqlLeaseRepository
from tests.support.write_steps import Database, engine_options

__all__ = [
    "BACKENDS",
    "DEFAULT_PG_URL",
    "SQL_BACKENDS",
    "SQL_ONLY",
    "Database",
    "engine_options",
    "pg_admin",
    "pg_admin_async",
    "pg_drop_schema",
    "pg_engine_options",
    "pg_required",
    "pg_url_from_env",
    "setup_all",
    "sync_engine_for",
    "unique",
]

DEFAULT_PG_URL = "postgresql://postgres@127.0.0.1:5432/test"
BACKENDS = ["memory", "sqlite", "postgresql"]
SQL_BACKENDS = ["sqlite", "postgresql"]
#: For one test that runs on the SQL backends only: ``@SQL_ONLY``. A module whose tests all
#: do says ``RUNS_ON = SQL_BACKENDS``.
SQL_ONLY = pytest.mark.parametrize("backend", SQL_BACKENDS, indirect=True)


def pg_url_from_env() -> str:
    return os.environ.get("LANGGRAPH_FENCE_PG_URL", DEFAULT_PG_URL)


def pg_required() -> bool:
    return os.environ.get("LANGGRAPH_FENCE_REQUIRE_PG", "") not in ("", "0", "false", "no")


def pg_admin(url: str, sql: str) -> None:
    """Run one statement on a connection of its own, off any running event loop."""
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        pool.submit(asyncio.run, pg_admin_async(url, sql)).result()


async def pg_admin_async(url: str, sql: str) -> None:
    import asyncpg

    dsn = normalize_url(url).set(drivername="postgresql").render_as_string(hide_password=False)
    conn = await asyncpg.connect(dsn, timeout=5)
    try:
        await conn.execute(sql)
    finally:
        await conn.close()


def pg_drop_schema(url: str, schema: str) -> None:
    """Drop a test's schema. A connection the test left behind holding a lock in it (a
    statement cancelled between its messages, never read to its end) would make the DROP
    wait forever: after 10 s such connections are ended, loudly, and the DROP runs again."""
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        pool.submit(asyncio.run, _drop_schema(url, schema)).result()


async def _drop_schema(url: str, schema: str) -> None:
    import asyncpg

    dsn = normalize_url(url).set(drivername="postgresql").render_as_string(hide_password=False)
    conn = await asyncpg.connect(dsn, timeout=5)
    drop = f'DROP SCHEMA IF EXISTS "{schema}" CASCADE'
    try:
        await conn.execute("SET lock_timeout = '10s'")
        try:
            await conn.execute(drop)
            return
        except asyncpg.exceptions.LockNotAvailableError:
            pass
        holders = await conn.fetch(
            "SELECT DISTINCT l.pid, a.state, left(a.query, 200) AS query FROM pg_locks l "
            "JOIN pg_class c ON c.oid = l.relation "
            "JOIN pg_namespace n ON n.oid = c.relnamespace "
            "LEFT JOIN pg_stat_activity a ON a.pid = l.pid "
            "WHERE n.nspname = $1 AND l.pid <> pg_backend_pid()",
            schema,
        )
        for holder in holders:
            print(
                f"\nschema {schema}: ending a connection left holding a lock "
                f"(pid {holder['pid']}, {holder['state']}): {holder['query']}",
                file=sys.stderr,
            )
            await conn.execute("SELECT pg_terminate_backend($1)", holder["pid"])
        await conn.execute("SET lock_timeout = 0")
        await conn.execute(drop)
    finally:
        await conn.close()


async def setup_all(engine: AsyncEngine) -> None:
    """Create every table of langgraph-fence on ``engine``'s database, as its users do: the
    leases (and the execution records beside them), the checkpoints, the store, the sink."""
    from checkpointers import SqlCheckpointer, SqlStore
    from langgraph_fence.sinks import setup_sink

    await SqlLeaseRepository(engine).setup()
    saver = SqlCheckpointer(engine)
    await saver.setup()
    await saver.aclose()
    await SqlStore(engine).setup()
    await setup_sink(engine)


def pg_engine_options(schema: str) -> dict[str, Any]:
    """Engine options that put every connection in ``schema``."""
    return {"connect_args": {"server_settings": {"search_path": schema}}}


def sync_engine_for(backend: str, database: str | Path, schema: str = "") -> sa.Engine:
    """A sync engine (stdlib sqlite3, or psycopg) on the database an async engine uses.

    ``database`` is the SQLite file, or the PostgreSQL URL (any driver); ``schema`` the
    PostgreSQL schema every connection is put in.
    """
    if backend == "sqlite":
        return sa.create_engine(f"sqlite:///{database}")
    url = normalize_url(str(database)).set(drivername="postgresql+psycopg")
    options = {"options": f"-csearch_path={schema}"} if schema else {}
    return sa.create_engine(url, connect_args=options)


def unique(prefix: str = "x") -> str:
    """A key part no other test (or earlier run on the same database) uses."""
    return f"{prefix}-{uuid.uuid4().hex[:10]}"

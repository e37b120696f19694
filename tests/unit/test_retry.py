"""The retry policy: connection errors are retried while the window lasts, nothing else is.

The errors are the real ones, raised by the real drivers (a refused connect, a unique
violation, a syntax error, a connection killed under a statement) where a database can
produce them, and the drivers' own classes where only a server outage could.
"""

from __future__ import annotations

import logging
import sqlite3
from collections.abc import Callable
from pathlib import Path

import asyncpg
import pytest
import sqlalchemy as sa
from sqlalchemy import exc as sa_exc
from sqlalchemy.ext.asyncio import AsyncEngine

from langgraph_fence import ExecutionFencedError
from langgraph_fence.database import create_engine, read_only
from langgraph_fence.database.retry import (
    FixedWindow,
    backoff,
    is_connection_error,
    is_database_connection_error,
    is_lock_conflict,
    retry_connection_errors,
    retry_window,
)
from langgraph_fence.testing import ManualClock
from tests.support.processes import free_port


async def _raised(engine: AsyncEngine, sql: str) -> Exception:
    try:
        async with engine.connect() as conn:
            await conn.execute(sa.text(sql))
    except Exception as exc:
        return exc
    raise AssertionError(f"{sql!r} did not fail")


async def test_a_refused_connect_is_a_connection_error() -> None:
    engine = create_engine(f"postgresql://postgres@127.0.0.1:{free_port()}/none")
    try:
        assert is_connection_error(await _raised(engine, "SELECT 1"))
    finally:
        await engine.dispose()


async def test_a_killed_connection_is_a_connection_error(
    make_engine: Callable[..., AsyncEngine],
) -> None:
    engine = make_engine("postgresql")
    async with engine.connect() as victim:
        pid = (await victim.execute(sa.text("SELECT pg_backend_pid()"))).scalar_one()
        async with engine.connect() as killer:
            await killer.execute(sa.text("SELECT pg_terminate_backend(:pid)"), {"pid": pid})
        # Whatever the driver raises for a killed backend: is_connection_error must know it.
        with pytest.raises(Exception) as caught:  # noqa: PT011
            await victim.execute(sa.text("SELECT 1"))
    assert is_connection_error(caught.value), repr(caught.value)
    await engine.dispose()


@pytest.mark.parametrize("backend", ["sqlite", "postgresql"])
async def test_integrity_and_programming_errors_are_not(
    backend: str, make_engine: Callable[..., AsyncEngine]
) -> None:
    engine = make_engine(backend)
    table = f"retry_{backend}_{free_port()}"
    async with engine.begin() as conn:
        await conn.execute(sa.text(f"CREATE TABLE {table} (id INTEGER PRIMARY KEY)"))
        await conn.execute(sa.text(f"INSERT INTO {table} VALUES (1)"))
    duplicate = await _raised(engine, f"INSERT INTO {table} VALUES (1)")
    assert isinstance(duplicate, sa_exc.IntegrityError)
    assert not is_connection_error(duplicate)
    syntax = await _raised(engine, "SELEC 1")
    assert not is_connection_error(syntax)
    async with engine.begin() as conn:
        await conn.execute(sa.text(f"DROP TABLE {table}"))
    await engine.dispose()


@pytest.mark.parametrize(
    "error",
    [
        asyncpg.exceptions.ConnectionDoesNotExistError("connection was closed in the middle"),
        asyncpg.exceptions.InterfaceError(
            "cannot call Connection.fetchrow(): connection is closed"
        ),
        asyncpg.exceptions.AdminShutdownError(
            "terminating connection due to administrator command"
        ),
        asyncpg.exceptions.CannotConnectNowError("the database system is starting up"),
        ConnectionResetError(104, "Connection reset by peer"),
        sa_exc.DBAPIError("SELECT 1", {}, OSError("gone"), connection_invalidated=True),
        # A session that landed on a standby (a failover under way): the next one may find
        # the primary.
        asyncpg.exceptions.ReadOnlySQLTransactionError(
            "cannot execute UPDATE in a read-only transaction"
        ),
        asyncpg.exceptions.ObjectNotInPrerequisiteStateError("recovery is in progress"),
        asyncpg.exceptions.TargetServerAttributeNotMatched(
            'None of the hosts match the target attribute requirement <"read-write">'
        ),
    ],
    ids=repr,
)
def test_driver_disconnects_are_connection_errors(error: Exception) -> None:
    assert is_connection_error(error)
    wrapped = RuntimeError("the step failed")
    wrapped.__cause__ = error
    assert is_connection_error(wrapped)  # found in the cause chain


@pytest.mark.parametrize(
    "error",
    [
        ValueError("thread_id must be a non-empty str"),
        KeyError("x"),
        FileNotFoundError(2, "No such file"),
        asyncpg.exceptions.UniqueViolationError("duplicate key value"),
        ExecutionFencedError("fenced", scope_key="t:e", token_held=1, token_seen=2),
    ],
    ids=repr,
)
def test_other_errors_are_not(error: Exception) -> None:
    assert not is_connection_error(error)


def test_backoff_doubles_up_to_its_cap() -> None:
    assert 0.025 <= backoff(0) <= 0.05
    assert 0.05 <= backoff(1) <= 0.1
    assert all(0.5 <= backoff(n) <= 1.0 for n in (5, 10, 100))


class _Window:
    """A run's window on a controlled clock: the clock moves with each attempt."""

    def __init__(self, clock: ManualClock, seconds: float) -> None:
        self.clock = clock
        self.confirmed_until = clock() + seconds
        self.ttl = 60.0


async def test_a_connection_error_is_retried_until_it_heals() -> None:
    calls = 0

    async def op() -> str:
        nonlocal calls
        calls += 1
        if calls < 3:
            raise asyncpg.exceptions.ConnectionDoesNotExistError("connection was closed")
        return "landed"

    with retry_window(_Window(ManualClock(), 10.0)):
        assert await retry_connection_errors(op, what="renew") == "landed"
    assert calls == 3


async def test_retries_give_up_when_the_window_runs_out() -> None:
    clock = ManualClock()
    calls = 0

    async def op() -> None:
        nonlocal calls
        calls += 1
        clock.advance(1.0)  # each attempt costs a second of the run's window
        raise asyncpg.exceptions.InterfaceError("connection is closed")

    with retry_window(_Window(clock, 3.0)), pytest.raises(asyncpg.exceptions.InterfaceError):
        await retry_connection_errors(op, what="renew")
    assert calls == 3  # failing at 1, 2 and 3 s: the window ends at 3 s, no fourth attempt


async def test_other_errors_are_raised_at_once() -> None:
    calls = 0

    async def op() -> None:
        nonlocal calls
        calls += 1
        raise asyncpg.exceptions.UniqueViolationError("duplicate key value")

    with pytest.raises(asyncpg.exceptions.UniqueViolationError):
        await retry_connection_errors(op, what="put")
    assert calls == 1


async def test_an_enclosing_window_stands() -> None:
    outer = FixedWindow.lasting(5.0)
    clock = ManualClock()
    calls = 0

    async def op() -> None:
        nonlocal calls
        calls += 1
        if calls == 1:
            raise asyncpg.exceptions.InterfaceError("connection is closed")

    # The inner window is over already; the outer (a loss being classified) still lasts.
    with retry_window(outer), retry_window(_Window(clock, 0.0)):
        await retry_connection_errors(op, what="renew")
    assert calls == 2


async def test_a_fixed_window_bounds_the_retries() -> None:
    window = FixedWindow.lasting(0.2)
    calls = 0

    async def op() -> None:
        nonlocal calls
        calls += 1
        raise ConnectionRefusedError(111, "Connection refused")

    with retry_window(window), pytest.raises(ConnectionRefusedError):
        await retry_connection_errors(op, what="get")
    assert 1 < calls < 10


async def test_only_a_database_connection_error_is_infrastructure() -> None:
    # A node's own HTTP client hanging up is the graph's error: the run may end failed.
    def http_call() -> None:
        raise ConnectionError("the payment provider hung up mid-request")

    with pytest.raises(ConnectionError) as http:
        http_call()
    assert is_connection_error(http.value)
    assert not is_database_connection_error(http.value)
    # The same kind of error from inside the database driver is infrastructure.
    engine = create_engine(f"postgresql://postgres@127.0.0.1:{free_port()}/none")
    try:
        refused = await _raised(engine, "SELECT 1")
    finally:
        await engine.dispose()
    assert is_database_connection_error(refused)
    wrapped = RuntimeError("During task with name 'charge'")
    wrapped.__cause__ = refused
    assert is_database_connection_error(wrapped)


@pytest.mark.parametrize("backend", ["postgresql"])
def test_a_killed_psycopg_connection_is_infrastructure(
    backend: str, make_sync_engine: Callable[[str], sa.Engine]
) -> None:
    """A node's own psycopg connection killed under it is handed back like asyncpg's, not
    the graph's own error (which would end the run failed)."""
    import psycopg

    url = make_sync_engine(backend).url.set(drivername="postgresql")
    dsn = url.render_as_string(hide_password=False)
    with psycopg.connect(dsn, autocommit=True) as victim:
        pid = victim.execute("SELECT pg_backend_pid()").fetchone()
        with psycopg.connect(dsn, autocommit=True) as killer:
            killer.execute("SELECT pg_terminate_backend(%s)", pid)
        with pytest.raises(psycopg.Error) as caught:
            victim.execute("SELECT 1")
    wrapped = RuntimeError("During task with name 'charge'")
    wrapped.__cause__ = caught.value
    assert is_database_connection_error(wrapped), repr(caught.value)


async def test_a_sqlite_write_refused_as_locked_is_retried_on_a_fresh_connection(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """SQLite refuses at once (whatever the busy timeout) a write from a connection whose
    read snapshot is older than another writer's lock: the write did not apply, and the
    retry, on a fresh connection, waits for the lock and lands once."""
    path = tmp_path / "locked.db"
    engine = create_engine(f"sqlite+aiosqlite:///{path}")
    async with engine.begin() as conn:
        await conn.execute(sa.text("CREATE TABLE t (n INTEGER)"))
    other = sqlite3.connect(path, isolation_level=None)
    attempts: list[Exception | None] = []

    async def write() -> None:
        async with read_only(engine).connect() as conn:
            await conn.execute(sa.text("SELECT count(*) FROM t"))  # a read snapshot
            if not attempts:
                other.execute("BEGIN IMMEDIATE")  # another writer takes the lock meanwhile
            try:
                await conn.execute(sa.text("INSERT INTO t VALUES (1)"))
                await conn.commit()
            except Exception as exc:
                attempts.append(exc)
                other.execute("COMMIT")  # its transaction ends; the lock is free again
                raise
            attempts.append(None)

    with caplog.at_level(logging.WARNING, "langgraph_fence.retry"):
        await retry_connection_errors(write, what="a write")
    refused = attempts[0]
    assert refused is not None
    assert is_lock_conflict(refused)
    assert not is_connection_error(refused)  # the connection is fine: only the lock was taken
    assert attempts[1:] == [None]
    assert other.execute("SELECT count(*) FROM t").fetchone() == (1,)
    assert "a write: the SQLite database was locked" in caplog.text
    other.close()
    await engine.dispose()


def test_a_syntax_error_of_sqlite_is_no_lock_conflict() -> None:
    with pytest.raises(sqlite3.OperationalError) as caught:
        sqlite3.connect(":memory:").execute("SELEC 1")
    assert not is_lock_conflict(caught.value)

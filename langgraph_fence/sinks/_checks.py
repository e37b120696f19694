"""What the sink refuses before its first statement: arguments of the wrong kind, and a
connection whose statements would not commit or roll back together with the caller's.
"""

from __future__ import annotations

from typing import Any

from sqlalchemy import Connection
from sqlalchemy.ext.asyncio import AsyncConnection

from langgraph_fence._compat import sqlalchemy_told_autocommit
from langgraph_fence.database import dialect_of
from langgraph_fence.fence import ExecutionFence
from langgraph_fence.validate import text_id

__all__ = ["check_arguments", "check_sync_arguments"]

#: The sync PostgreSQL driver the sync sink is tested with.
_SYNC_PG_DRIVERS = frozenset({"psycopg"})


def _check_fence_and_key(fence: object, idempotency_key: object) -> None:
    if not isinstance(fence, ExecutionFence):
        raise TypeError(
            "fence must be an ExecutionFence (get_execution_context().fence inside a step), "
            f"got {type(fence).__name__}"
        )
    text_id(
        "idempotency_key",
        idempotency_key,
        what="names the write: the same for every attempt of it",
    )


async def check_arguments(conn: object, fence: object, idempotency_key: object) -> None:
    """The checks of :func:`~langgraph_fence.sinks.fenced_write`."""
    _check_fence_and_key(fence, idempotency_key)
    if not isinstance(conn, AsyncConnection):
        raise TypeError(
            "conn must be a SQLAlchemy AsyncConnection inside your transaction, got "
            f"{type(conn).__name__}"
        )
    dialect = dialect_of(conn)
    if not conn.in_transaction():
        raise ValueError(
            "conn is not in a transaction: call fenced_write inside `async with conn.begin():` "
            "so the sink's rows commit or roll back with your own statements"
        )
    if await conn.run_sync(_is_autocommit, dialect):
        raise ValueError(
            "conn is in AUTOCOMMIT: each statement would commit on its own and nothing would "
            "roll back together; take the connection out of it before conn.begin() "
            "(`conn = await conn.execution_options(isolation_level='READ COMMITTED')` on "
            "PostgreSQL), or use langgraph_fence.database.transaction(engine)"
        )


def check_sync_arguments(conn: object, fence: object, idempotency_key: object) -> None:
    """The checks of :func:`~langgraph_fence.sinks.fenced_write_sync`."""
    _check_fence_and_key(fence, idempotency_key)
    if isinstance(conn, AsyncConnection):
        raise TypeError(
            "conn is an AsyncConnection: use `async with fenced_write(conn, ...)` in async "
            "code; fenced_write_sync takes a sync Connection"
        )
    if not isinstance(conn, Connection):
        raise TypeError(
            "conn must be a SQLAlchemy Connection inside your transaction, got "
            f"{type(conn).__name__}"
        )
    name, driver = conn.dialect.name, conn.dialect.driver
    if name == "postgresql" and driver not in _SYNC_PG_DRIVERS:
        raise ValueError(
            f"conn uses the PostgreSQL driver {driver!r}; the sync sink supports psycopg "
            "(postgresql+psycopg://...): install psycopg[binary] and use that URL"
        )
    if name not in ("sqlite", "postgresql"):
        raise ValueError(f"conn is for {name!r}; the sink supports SQLite and PostgreSQL")
    if not conn.in_transaction():
        raise ValueError(
            "conn is not in a transaction: call fenced_write_sync inside `with engine.begin() "
            "as conn:` (or `with conn.begin():`) so the sink's rows commit or roll back with "
            "your own statements"
        )
    if _is_autocommit(conn, name):
        raise ValueError(
            "conn is in AUTOCOMMIT: each statement would commit on its own and nothing would "
            "roll back together; take the connection out of it before conn.begin() "
            "(`conn.execution_options(isolation_level='READ COMMITTED')` on PostgreSQL)"
        )


def _is_autocommit(conn: Connection, dialect: str) -> bool:
    # What SQLAlchemy was told (an execution option, or the engine's isolation_level).
    if sqlalchemy_told_autocommit(conn):
        return True
    # What the driver does (an autocommit set on the raw connection behind SQLAlchemy's back).
    fairy = conn.connection
    raw: Any = fairy.dbapi_connection
    if dialect == "postgresql":
        return bool(conn.dialect.detect_autocommit_setting(raw))
    # isolation_level None: the driver opens no transaction of its own, so one must be open
    # now (langgraph_fence's engines send BEGIN IMMEDIATE when SQLAlchemy begins; sqlite3 on
    # a sync engine alike).
    return raw.isolation_level is None and (
        getattr(fairy.driver_connection, "in_transaction", None) is False
    )

"""The sink's tables on the user's database: their migrations, the statements the sink runs on
them, creating them (:func:`setup_sink`) and erasing a scope key's results.

Two tables: ``fence_high_water`` keeps the highest token seen per scope key, and
``fence_applied`` each applied ``(scope_key, idempotency_key)`` with its token and result.
"""

from __future__ import annotations

from sqlalchemy import text
from sqlalchemy.ext.asyncio import AsyncConnection, AsyncEngine

from langgraph_fence.database import transaction
from langgraph_fence.database.migrations import Migration, migrate

__all__ = [
    "CHECK_AND_RAISE_MARK_SQL",
    "CLAIM_KEY_SQL",
    "READ_KEY_SQL",
    "READ_MARK_SQL",
    "RECORD_SQL",
    "RELEASE_SQL",
    "SINK_COMPONENT",
    "SINK_MIGRATIONS",
    "erase_results",
    "setup_sink",
]

#: The component name of the sink's tables in ``fence_schema_versions``.
SINK_COMPONENT = "sink"

_CREATE_HIGH_WATER = """
CREATE TABLE IF NOT EXISTS fence_high_water (
    scope_key TEXT PRIMARY KEY,
    token BIGINT NOT NULL CHECK (token >= 1)
)
"""
_CREATE_APPLIED = """
CREATE TABLE IF NOT EXISTS fence_applied (
    scope_key TEXT NOT NULL,
    idempotency_key TEXT NOT NULL,
    token BIGINT NOT NULL CHECK (token >= 1),
    result TEXT,
    applied_at {applied_at},
    PRIMARY KEY (scope_key, idempotency_key)
)
"""

SINK_MIGRATIONS = [
    Migration(
        version=1,
        description="the high-water mark and applied-key tables of the exactly-once sink",
        sqlite=[
            _CREATE_HIGH_WATER,
            _CREATE_APPLIED.format(
                applied_at="TEXT NOT NULL DEFAULT (strftime('%Y-%m-%dT%H:%M:%fZ', 'now'))"
            ),
        ],
        postgresql=[
            _CREATE_HIGH_WATER,
            _CREATE_APPLIED.format(applied_at="TIMESTAMPTZ NOT NULL DEFAULT now()"),
        ],
    ),
]

#: Checks the token against the mark and raises the mark, in one statement (both dialects).
#: A row back: the token is at or above the mark, which is now the token. No row back: the
#: mark is above the token; the write is stale. On PostgreSQL the conflicting row is locked
#: either way until the transaction ends, so no newer writer can slip in before the commit.
CHECK_AND_RAISE_MARK_SQL = (
    "INSERT INTO fence_high_water (scope_key, token) VALUES (:scope_key, :token) "
    "ON CONFLICT (scope_key) DO UPDATE SET token = excluded.token "
    "WHERE fence_high_water.token <= excluded.token "
    "RETURNING token"
)
#: Claims the idempotency key (both dialects). A row back: this transaction applies the
#: write. No row back: a committed transaction (or this one) applied it already.
CLAIM_KEY_SQL = (
    "INSERT INTO fence_applied (scope_key, idempotency_key, token) "
    "VALUES (:scope_key, :idempotency_key, :token) "
    "ON CONFLICT (scope_key, idempotency_key) DO NOTHING "
    "RETURNING token"
)
READ_MARK_SQL = text("SELECT token FROM fence_high_water WHERE scope_key = :scope_key")
READ_KEY_SQL = text(
    "SELECT token, result FROM fence_applied "
    "WHERE scope_key = :scope_key AND idempotency_key = :idempotency_key"
)
RECORD_SQL = text(
    "UPDATE fence_applied SET result = :result "
    "WHERE scope_key = :scope_key AND idempotency_key = :idempotency_key AND token = :token"
)
RELEASE_SQL = text(
    "DELETE FROM fence_applied "
    "WHERE scope_key = :scope_key AND idempotency_key = :idempotency_key AND token = :token"
)


async def setup_sink(engine_or_conn: AsyncEngine | AsyncConnection) -> int:
    """Create or upgrade the sink's tables on the user's database; return the schema version.

    Runs the ``"sink"`` component's migrations through
    :func:`langgraph_fence.database.migrations.migrate`: safe from several processes at once and a
    no-op when up to date. SQLite and PostgreSQL (SQLAlchemy async) are supported.

    Args:
        engine_or_conn: an engine, or a connection whose engine is used. The migration
            commits on a connection of its own, so a connection must not be inside a
            transaction (on SQLite that transaction would hold the lock the migration needs).

    Raises:
        TypeError: ``engine_or_conn`` is neither an ``AsyncEngine`` nor an ``AsyncConnection``.
        ValueError: the connection is inside a transaction, or the database is neither
            SQLite nor PostgreSQL.
    """
    if isinstance(engine_or_conn, AsyncConnection):
        if engine_or_conn.in_transaction():
            raise ValueError(
                "engine_or_conn is a connection inside a transaction; setup_sink migrates on a "
                "connection of its own and commits: call it before your transaction, or pass "
                "the engine"
            )
        engine = engine_or_conn.engine
    elif isinstance(engine_or_conn, AsyncEngine):
        engine = engine_or_conn
    else:
        raise TypeError(
            "engine_or_conn must be a SQLAlchemy AsyncEngine or AsyncConnection, got "
            f"{type(engine_or_conn).__name__}"
        )
    return await migrate(engine, SINK_COMPONENT, SINK_MIGRATIONS)


async def erase_results(engine: AsyncEngine, scope_key: str) -> int:
    """Delete every stored result (applied key) of ``scope_key``; return how many.

    For an erasure: the results may hold what the write was about. The high-water mark row
    of the scope key stays: it holds the scope key and a token, no result, and a write made
    later under a token below it must still be refused. A database without the sink's
    tables has nothing to erase (0).
    """
    async with engine.connect() as conn:
        versions = await conn.execute(
            text("SELECT 1 FROM fence_schema_versions WHERE component = :c"),
            {"c": SINK_COMPONENT},
        )
        if versions.first() is None:
            return 0
    async with transaction(engine) as conn:
        result = await conn.execute(
            text("DELETE FROM fence_applied WHERE scope_key = :scope_key"), {"scope_key": scope_key}
        )
    return int(result.rowcount)

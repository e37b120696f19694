"""Versioned schema migrations, safe to run from several processes at once.

Each component (the lease table, the checkpoint tables, the sink tables) keeps its own
version in ``fence_schema_versions``. :func:`migrate` applies the missing steps in one
transaction that first takes a lock every migrating process waits for: a PostgreSQL
transaction-scoped advisory lock, or SQLite's write lock (``BEGIN IMMEDIATE``).
"""

from __future__ import annotations

import logging
import zlib
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass

from sqlalchemy import text
from sqlalchemy.ext.asyncio import AsyncConnection, AsyncEngine

from .database import Dialect, dialect_of, transaction

__all__ = ["Migration", "migrate"]

logger = logging.getLogger(__name__)

MigrationStep = str | Callable[[AsyncConnection, Dialect], Awaitable[None]]


@dataclass(frozen=True, slots=True)
class Migration:
    """One schema step: SQL per dialect (one or more statements), or a callable."""

    version: int
    description: str
    sqlite: Sequence[MigrationStep]
    postgresql: Sequence[MigrationStep]

    def steps(self, dialect: Dialect) -> Sequence[MigrationStep]:
        """The steps of this migration for ``dialect``."""
        return self.sqlite if dialect == "sqlite" else self.postgresql


_VERSIONS_DDL = (
    "CREATE TABLE IF NOT EXISTS fence_schema_versions ("
    " component TEXT PRIMARY KEY,"
    " version INTEGER NOT NULL)"
)


async def migrate(engine: AsyncEngine, component: str, migrations: Sequence[Migration]) -> int:
    """Bring ``component``'s schema to its newest version; return that version.

    Safe to call from several processes at once, and a no-op when up to date.
    """
    versions = [m.version for m in migrations]
    if versions != list(range(1, len(migrations) + 1)):
        raise ValueError(f"migrations of {component!r} must be numbered 1..n, got {versions}")
    dialect = dialect_of(engine)
    async with transaction(engine) as conn:
        if dialect == "postgresql":
            lock_id = zlib.crc32(b"langgraph_fence.migrations")
            await conn.execute(text("SELECT pg_advisory_xact_lock(:id)"), {"id": lock_id})
        await conn.execute(text(_VERSIONS_DDL))
        row = await conn.execute(
            text("SELECT version FROM fence_schema_versions WHERE component = :c"),
            {"c": component},
        )
        current = row.scalar_one_or_none() or 0
        if current > len(migrations):
            raise RuntimeError(
                f"the database's {component!r} schema is at version {current}, newer than this "
                f"langgraph-fence knows ({len(migrations)}): upgrade langgraph-fence"
            )
        for migration in migrations[current:]:
            logger.info(
                "migrating %s to version %d: %s",
                component,
                migration.version,
                migration.description,
            )
            for step in migration.steps(dialect):
                if isinstance(step, str):
                    await conn.execute(text(step))
                else:
                    await step(conn, dialect)
        newest = len(migrations)
        if newest != current:
            await conn.execute(
                text(
                    "INSERT INTO fence_schema_versions (component, version) VALUES (:c, :v) "
                    "ON CONFLICT (component) DO UPDATE SET version = excluded.version"
                ),
                {"c": component, "v": newest},
            )
        return newest

"""Versioned schema migrations, safe to run from several processes at once.

Each component (the lease table, the checkpoint tables, the sink tables) keeps its own
version in ``fence_schema_versions``. :func:`migrate` applies the missing steps in one
transaction that first takes a lock every migrating process waits for: a PostgreSQL
transaction-scoped advisory lock, or SQLite's write lock (``BEGIN IMMEDIATE``).

On PostgreSQL the schema the connections work in (their ``search_path``, e.g. from
``create_engine(url, schema=...)``) is created first when it does not exist, under the same
lock (:func:`ensure_schema`).
"""

from __future__ import annotations

import logging
import zlib
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass

from sqlalchemy import text
from sqlalchemy.exc import DBAPIError
from sqlalchemy.ext.asyncio import AsyncConnection, AsyncEngine

from langgraph_fence.database import Dialect, dialect_of, transaction
from langgraph_fence.errors import linked_errors

__all__ = ["MIGRATION_LOCK_ID", "Migration", "ensure_schema", "migrate", "search_path_schema"]

logger = logging.getLogger("langgraph_fence.migrations")  # the name it had in 0.1.0

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

    @classmethod
    def typed(cls, version: int, description: str, *statements: str) -> Migration:
        """A step of the same ``statements`` on both dialects, with ``{double}`` and
        ``{binary}`` in them as each dialect's column type (``REAL`` and ``BLOB`` on SQLite,
        ``DOUBLE PRECISION`` and ``BYTEA`` on PostgreSQL). ``str.format`` fills them in: a
        literal brace is written twice."""

        def of(dialect: Dialect) -> list[MigrationStep]:
            return [statement.format(**_COLUMN_TYPES[dialect]) for statement in statements]

        return cls(version, description, of("sqlite"), of("postgresql"))


#: The column types a statement of :meth:`Migration.typed` names, per dialect.
_COLUMN_TYPES: dict[Dialect, dict[str, str]] = {
    "sqlite": {"double": "REAL", "binary": "BLOB"},
    "postgresql": {"double": "DOUBLE PRECISION", "binary": "BYTEA"},
}


#: The advisory lock every migration (and schema creation) of a database waits for.
# The advisory lock every process of every version takes to migrate: a constant shared
# across processes and releases, so it must never follow this module's path (it is the
# text the module had in 0.1.0). tests/unit/test_migrations_lock.py pins it.
MIGRATION_LOCK_ID = zlib.crc32(b"langgraph_fence.migrations")
#: SQLSTATEs of a CREATE SCHEMA that lost a race to another creator, or was not allowed.
_UNIQUE_VIOLATION = "23505"
_DUPLICATE_SCHEMA = "42P06"
_INSUFFICIENT_PRIVILEGE = "42501"

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
    if dialect == "postgresql":
        await ensure_schema(engine)
    async with transaction(engine) as conn:
        if dialect == "postgresql":
            await conn.execute(text("SELECT pg_advisory_xact_lock(:id)"), {"id": MIGRATION_LOCK_ID})
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


async def ensure_schema(engine: AsyncEngine) -> None:
    """Create the schema a PostgreSQL ``engine``'s connections work in, if it is missing.

    A no-op (one read) when a schema of the connections' ``search_path`` exists. Otherwise
    the search_path must name exactly one schema (as ``create_engine(url, schema=...)``
    sets it): it is created with ``CREATE SCHEMA IF NOT EXISTS``, under the advisory lock
    every migration takes, so several processes starting at once create it once; one
    created meanwhile by anyone else is taken as it is.

    Raises:
        ValueError: no schema of the search_path exists and it names none to create (the
            role's default), or the role may not create the schema; the message names the
            fix.
    """
    async with engine.connect() as conn:
        if (await conn.execute(text("SELECT current_schema()"))).scalar() is not None:
            return
        setting = str((await conn.execute(text("SELECT current_setting('search_path')"))).scalar())
    schema = search_path_schema(setting)
    if schema is None:
        raise ValueError(
            f"no schema of the search_path {setting!r} exists in the database: choose one "
            "(schema= in Python, --schema on the command line; it is created if missing), "
            "or create one (CREATE SCHEMA ...)"
        )
    quoted = engine.dialect.identifier_preparer.quote_identifier(schema)
    # A transaction of its own: the next one (the migration's) starts with the catalog as
    # committed by whoever created the schema while this one waited for the lock.
    async with transaction(engine) as conn:
        await conn.execute(text("SELECT pg_advisory_xact_lock(:id)"), {"id": MIGRATION_LOCK_ID})
        found = await conn.execute(
            text("SELECT 1 FROM pg_namespace WHERE nspname = :s"), {"s": schema}
        )
        if found.scalar() is not None:
            return
        try:
            async with conn.begin_nested():
                await conn.execute(text(f"CREATE SCHEMA IF NOT EXISTS {quoted}"))
        except DBAPIError as exc:
            state = _sqlstate(exc)
            if state in (_UNIQUE_VIOLATION, _DUPLICATE_SCHEMA):
                return  # created by someone outside the lock at the same moment
            if state == _INSUFFICIENT_PRIVILEGE:
                first = str(exc.orig).splitlines()[0] if exc.orig is not None else str(exc)
                raise ValueError(
                    f"schema {schema!r} does not exist and this role may not create it "
                    f"({first}): create it as a role that may (CREATE SCHEMA {quoted}), "
                    "or choose an existing schema"
                ) from None
            raise
    logger.info("created schema %s", schema)


def search_path_schema(setting: str) -> str | None:
    """The schema a ``search_path`` setting names when it names exactly one, as PostgreSQL
    reads it (``"Fence"`` quoted keeps its case, ``Fence`` is ``fence``), else ``None``
    (a list, or ``$user``)."""
    value = setting.strip()
    if value.startswith('"'):
        name, rest = [], value[1:]
        while rest:
            if rest.startswith('""'):
                name.append('"')
                rest = rest[2:]
            elif rest.startswith('"'):
                return "".join(name) if not rest[1:].strip() and name else None
            else:
                name.append(rest[0])
                rest = rest[1:]
        return None
    if not value or value == "$user" or any(c in value for c in ', \t\n"'):
        return None
    return "".join(c.lower() if "A" <= c <= "Z" else c for c in value)


def _sqlstate(exc: BaseException) -> str | None:
    for error in linked_errors(exc):
        state = getattr(error, "sqlstate", None)
        if isinstance(state, str):
            return state
    return None

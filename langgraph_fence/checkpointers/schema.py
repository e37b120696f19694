"""The checkpoint tables of :class:`~checkpointers.SqlCheckpointer` and their migrations.

The split follows the official PostgreSQL saver, for the same reason: a channel's value is
written once per *version*, not once per checkpoint. ``fence_checkpoint_blobs`` holds one
row per ``(thread, namespace, channel, version)``; a checkpoint row keeps only the small
primitive values inline and the channel versions it was taken at, so a superstep that
changed one channel of a large state writes that channel alone. ``fence_checkpoint_writes``
holds the pending writes of the tasks of a checkpoint (what a resumed run reuses).

Differences from the official schema:

* every checkpoint and write row carries ``fence_token``: the lease epoch it was written
  under (``NULL`` when written without a run handle, or copied by ``copy_thread``);
* the checkpoint itself is stored serialized by the saver's serde (msgpack), not as JSON,
  so no value is lost to JSON and PostgreSQL's NUL-byte rule does not apply to it;
* ``channel_versions`` and ``metadata`` are JSON (``JSONB`` on PostgreSQL, ``TEXT`` on
  SQLite) so pruning and metadata filters can run in SQL; ``run_id`` is its own indexed
  column so ``delete_for_runs`` does not scan metadata.

Table names carry the ``fence_`` prefix: they can live beside the official savers' tables.

Tenants (version 2): every row carries ``tenant_id``, first in each primary key. A thread is
``(tenant_id, thread_id)``: a tenant's ``chat-1`` and another's ``chat-1`` are two threads
that never meet. Rows written with no tenant given (plain LangGraph use) belong to the
default tenant, ``"default"`` (:data:`langgraph_fence.fence.tenancy.DEFAULT_TENANT`), the
tenant an instance runs a graph under when its config names none. Rows that existed before
version 2 get the tenant of the thread's lease:
the tenant of the execution records naming the thread, or of the lease whose execution id
is the thread id. A thread that no lease names, or that leases of two tenants name (their
writes are mixed in one chain and cannot be told apart), goes to the empty tenant ``''``
(the default tenant before version 3), so no tenant is shown rows another tenant may have
written.

One default tenant (version 3): the default tenant was ``''`` for a bare saver and
``"default"`` for an instance, so a thread a run wrote under ``"default"`` was erased by a
call naming no tenant under ``''`` (nothing). The rows of ``''`` move to ``"default"``,
except a thread that has rows of ``"default"`` too (two threads are never merged) or that a
lease or record of another tenant names (left as version 2 left it): those stay under
``''`` (:data:`langgraph_fence.saver.checkpoint.LEGACY_TENANT`), read with ``tenant_id=""``.
"""

from __future__ import annotations

from sqlalchemy import text
from sqlalchemy.ext.asyncio import AsyncConnection

from langgraph_fence.database import Dialect
from langgraph_fence.database.migrations import Migration, MigrationStep

__all__ = ["CHECKPOINT_MIGRATIONS", "COMPONENT"]

#: The component name in ``fence_schema_versions``.
COMPONENT = "checkpoints"

#: Each table's columns as version 1 made them, and its primary key; version 2 puts
#: ``tenant_id`` first in both.
_TABLES: dict[str, tuple[str, str]] = {
    "fence_checkpoints": (
        """thread_id TEXT NOT NULL,
    checkpoint_ns TEXT NOT NULL DEFAULT '',
    checkpoint_id TEXT NOT NULL,
    parent_checkpoint_id TEXT,
    type TEXT NOT NULL,
    checkpoint {binary} NOT NULL,
    channel_versions {json} NOT NULL,
    metadata {json} NOT NULL,
    run_id TEXT,
    fence_token BIGINT""",
        "thread_id, checkpoint_ns, checkpoint_id",
    ),
    "fence_checkpoint_blobs": (
        """thread_id TEXT NOT NULL,
    checkpoint_ns TEXT NOT NULL DEFAULT '',
    channel TEXT NOT NULL,
    version TEXT NOT NULL,
    type TEXT NOT NULL,
    blob {binary}""",
        "thread_id, checkpoint_ns, channel, version",
    ),
    "fence_checkpoint_writes": (
        """thread_id TEXT NOT NULL,
    checkpoint_ns TEXT NOT NULL DEFAULT '',
    checkpoint_id TEXT NOT NULL,
    task_id TEXT NOT NULL,
    idx INTEGER NOT NULL,
    channel TEXT NOT NULL,
    type TEXT NOT NULL,
    blob {binary} NOT NULL,
    task_path TEXT NOT NULL DEFAULT '',
    fence_token BIGINT""",
        "thread_id, checkpoint_ns, checkpoint_id, task_id, idx",
    ),
}

_RUN_ID_INDEX = "CREATE INDEX IF NOT EXISTS fence_checkpoints_run_id ON fence_checkpoints (run_id)"


def _column_names(table: str) -> list[str]:
    """The names of the table's version 1 columns, in order."""
    columns, _ = _TABLES[table]
    return [line.split()[0] for line in columns.split(",\n")]


def _steps(*, binary: str, json: str) -> list[str]:
    steps = [
        f"\nCREATE TABLE IF NOT EXISTS {table} (\n    {columns},\n    PRIMARY KEY ({key})\n)\n"
        for table, (columns, key) in _TABLES.items()
    ]
    return [step.format(binary=binary, json=json) for step in steps] + [_RUN_ID_INDEX]


# -- version 2: the tenant in every key

_OWNERS = "fence_thread_owners_v2"


async def _table_exists(conn: AsyncConnection, dialect: Dialect, table: str) -> bool:
    if dialect == "postgresql":
        found = await conn.execute(text("SELECT to_regclass(:t) IS NOT NULL"), {"t": table})
    else:
        found = await conn.execute(
            text("SELECT count(*) > 0 FROM sqlite_master WHERE type = 'table' AND name = :t"),
            {"t": table},
        )
    return bool(found.scalar_one())


async def _thread_owners(conn: AsyncConnection, dialect: Dialect) -> None:
    """A temporary table: ``(thread_id, tenant_id)`` of each thread exactly one tenant's
    lease names (execution records first, else a lease whose execution id is the thread)."""
    named = []
    if await _table_exists(conn, dialect, "fence_executions"):
        named.append("SELECT tenant_id, thread_id FROM fence_executions")
    if await _table_exists(conn, dialect, "fence_leases"):
        named.append("SELECT tenant_id, execution_id AS thread_id FROM fence_leases")
    if not named:
        named.append("SELECT '' AS tenant_id, '' AS thread_id WHERE 1 = 0")
    await conn.execute(
        text(
            f"CREATE TEMPORARY TABLE {_OWNERS} AS SELECT thread_id, min(tenant_id) AS tenant_id"
            f" FROM ({' UNION '.join(named)}) named GROUP BY thread_id"
            " HAVING count(DISTINCT tenant_id) = 1"
        )
    )


def _rebuilt(table: str, *, binary: str, json: str) -> list[str]:
    columns, key = _TABLES[table]
    names = _column_names(table)
    copied = ", ".join(names)
    old = f"{table}_v1"
    values = ", ".join(f"r.{name}" for name in names)
    tenant_columns = (
        f"tenant_id TEXT NOT NULL,\n    {columns},\n    CONSTRAINT {table}_tenant_pkey\n"
        f"        PRIMARY KEY (tenant_id, {key})"
    )
    return [
        f"ALTER TABLE {table} RENAME TO {old}",
        f"CREATE TABLE {table} (\n    {tenant_columns.format(binary=binary, json=json)}\n)",
        f"INSERT INTO {table} (tenant_id, {copied})"
        f" SELECT coalesce(o.tenant_id, ''), {values}"
        f" FROM {old} r LEFT JOIN {_OWNERS} o ON o.thread_id = r.thread_id",
        f"DROP TABLE {old}",
    ]


def _steps_v2(*, binary: str, json: str) -> list[MigrationStep]:
    steps: list[MigrationStep] = [_thread_owners]
    for table in _TABLES:
        steps.extend(_rebuilt(table, binary=binary, json=json))
    steps += [_RUN_ID_INDEX, f"DROP TABLE {_OWNERS}"]
    return steps


# -- version 3: one default tenant ("default", as the instance's), no longer the empty string

_MOVES = "fence_default_tenant_moves_v3"


async def _default_moves(conn: AsyncConnection, dialect: Dialect) -> None:
    """A temporary table: the threads of the old default tenant ``''`` that move to
    ``'default'``: each one with no row of ``'default'`` (two threads are never merged) and
    that no lease or record of another tenant names (a thread version 2 could not give one
    tenant stays where no tenant sees it)."""
    tables = list(_TABLES)
    old = " UNION ".join(f"SELECT thread_id FROM {t} WHERE tenant_id = ''" for t in tables)
    taken = " UNION ".join(f"SELECT thread_id FROM {t} WHERE tenant_id = 'default'" for t in tables)
    named = []
    if await _table_exists(conn, dialect, "fence_executions"):
        named.append("SELECT thread_id FROM fence_executions WHERE tenant_id <> 'default'")
    if await _table_exists(conn, dialect, "fence_leases"):
        named.append(
            "SELECT execution_id AS thread_id FROM fence_leases WHERE tenant_id <> 'default'"
        )
    other = " UNION ".join([taken, *named])
    await conn.execute(
        text(
            f"CREATE TEMPORARY TABLE {_MOVES} AS SELECT DISTINCT thread_id FROM ({old}) o"
            f" WHERE thread_id NOT IN (SELECT thread_id FROM ({other}) t)"
        )
    )


def _steps_v3() -> list[MigrationStep]:
    steps: list[MigrationStep] = [_default_moves]
    steps += [
        f"UPDATE {table} SET tenant_id = 'default' WHERE tenant_id = ''"
        f" AND thread_id IN (SELECT thread_id FROM {_MOVES})"
        for table in _TABLES
    ]
    return [*steps, f"DROP TABLE {_MOVES}"]


CHECKPOINT_MIGRATIONS = [
    Migration(
        version=1,
        description="checkpoints, channel blobs and pending writes, with fence tokens",
        sqlite=_steps(binary="BLOB", json="TEXT"),
        postgresql=_steps(binary="BYTEA", json="JSONB"),
    ),
    Migration(
        version=2,
        description="the tenant in every checkpoint, blob and write key (from the lease)",
        sqlite=_steps_v2(binary="BLOB", json="TEXT"),
        postgresql=_steps_v2(binary="BYTEA", json="JSONB"),
    ),
    Migration(
        version=3,
        description="one default tenant: the rows of the old default '' move to 'default'",
        sqlite=_steps_v3(),
        postgresql=_steps_v3(),
    ),
]

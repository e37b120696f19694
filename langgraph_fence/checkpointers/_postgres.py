"""The PostgreSQL hot paths: one statement per write, one per read, on the raw asyncpg
connection of the engine's pool.

Why raw: SQLAlchemy Core costs about 0.5 ms per statement over asyncpg (see
``benchmarks/README.md``), as much as the statement itself. asyncpg prepares each distinct
SQL text once per connection and reuses it, so these constant texts are parsed and planned
once. The engine runs in autocommit, so each statement is its own transaction: atomic, and
one round trip.

The fenced write is ONE statement: a ``guard`` CTE reads the lease row ``FOR SHARE`` (a
take-over racing the write waits until the write commits; a take-over that committed first
leaves the guard empty under READ COMMITTED's re-check), and every insert selects ``FROM
guard``, so an empty guard inserts nothing. Unfenced, the guard is a one-row constant and
the statement is the same.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from typing import Any

from sqlalchemy.ext.asyncio import AsyncEngine

from langgraph_fence.checkpointers._rows import (
    CheckpointQuery,
    CheckpointRow,
    Guard,
    StoredCheckpoint,
    TaskWrites,
)
from langgraph_fence.database.driver import Connections
from langgraph_fence.database.retry import retry_connection_errors
from langgraph_fence.lease.guard import guard_sql
from langgraph_fence.lease.schema import STAMP_SQL, stamp_patch

__all__ = ["PostgresDriver"]

_LEASE_WHERE = guard_sql(tenant_id="$a", execution_id="$b", holder="$c", epoch="$d")
_GUARD_NONE = "SELECT NULL::bigint AS epoch, false AS cleared"
_GUARD_SHARE = f"SELECT epoch, false AS cleared FROM fence_leases WHERE {_LEASE_WHERE} FOR SHARE"
_PATCH = STAMP_SQL["postgresql"]["patch"].format(param="$e")
# A checkpoint's guard: the entries it clears go with it, in the same statement.
_GUARD_CLEAR = f"""UPDATE fence_leases SET pending_effects = {_PATCH},
    updated_at = extract(epoch from now())
WHERE {_LEASE_WHERE}
RETURNING epoch, true AS cleared"""
# A task's writes clear its entries only when their checkpoint and every ancestor's are
# stored (``$f``/``$g``: the proof's namespaces and ids; a resume from the root sees the
# writes then); writes racing one of those checkpoints leave the entries to the root
# checkpoint that follows. Every SET expression reads the row as it was.
_GUARD_CLEAR_IF_STORED = f"""UPDATE fence_leases SET
    pending_effects = CASE WHEN stored.yes THEN {_PATCH} ELSE pending_effects END,
    updated_at = extract(epoch from now())
FROM (SELECT (SELECT count(*) FROM fence_checkpoints c,
        unnest($f::text[], $g::text[]) AS p(ns, id)
    WHERE c.tenant_id = $1 AND c.thread_id = $2 AND c.checkpoint_ns = p.ns
        AND c.checkpoint_id = p.id) = cardinality($g::text[]) AS yes) AS stored
WHERE {_LEASE_WHERE}
RETURNING epoch, stored.yes AS cleared"""

_PUT = """WITH guard AS ({guard}),
blobs AS (
    INSERT INTO fence_checkpoint_blobs (tenant_id, thread_id, checkpoint_ns, channel, version,
        type, blob)
    SELECT $1, $2, $3, b.channel, b.version, b.type, b.blob
    FROM guard, unnest($11::text[], $12::text[], $13::text[], $14::bytea[])
        AS b(channel, version, type, blob)
    ON CONFLICT (tenant_id, thread_id, checkpoint_ns, channel, version) DO NOTHING
)
INSERT INTO fence_checkpoints (tenant_id, thread_id, checkpoint_ns, checkpoint_id,
    parent_checkpoint_id, type, checkpoint, channel_versions, metadata, run_id, fence_token)
SELECT $1, $2, $3, $4, $5, $6, $7, $8::jsonb, $9::jsonb, $10, guard.epoch FROM guard
ON CONFLICT (tenant_id, thread_id, checkpoint_ns, checkpoint_id) DO UPDATE SET
    type = excluded.type, checkpoint = excluded.checkpoint,
    channel_versions = excluded.channel_versions, metadata = excluded.metadata,
    run_id = excluded.run_id, fence_token = excluded.fence_token
RETURNING fence_token"""

_PUT_WRITES = """WITH guard AS ({guard}),
ins AS (
    INSERT INTO fence_checkpoint_writes (tenant_id, thread_id, checkpoint_ns, checkpoint_id,
        task_id, task_path, idx, channel, type, blob, fence_token)
    SELECT $1, $2, $3, $4, $5, $6, w.idx, w.channel, w.type, w.blob, guard.epoch
    FROM guard, unnest($7::int[], $8::text[], $9::text[], $10::bytea[])
        AS w(idx, channel, type, blob)
    ON CONFLICT (tenant_id, thread_id, checkpoint_ns, checkpoint_id, task_id, idx) {conflict}
)
SELECT epoch, cleared FROM guard"""

_WRITES_UPSERT = (
    "DO UPDATE SET channel = excluded.channel, type = excluded.type, blob = excluded.blob,"
    " fence_token = excluded.fence_token"
)

# One round trip per read: the channel blobs the checkpoint references and its pending
# writes come back as arrays of anonymous records beside the checkpoint row.
_SELECT = """SELECT c.thread_id, c.checkpoint_ns, c.checkpoint_id, c.parent_checkpoint_id,
    c.type, c.checkpoint, c.metadata,
    ARRAY(SELECT ROW(b.channel, b.type, b.blob)
        FROM jsonb_each_text(c.channel_versions) AS v
        JOIN fence_checkpoint_blobs b ON b.tenant_id = c.tenant_id
            AND b.thread_id = c.thread_id AND b.checkpoint_ns = c.checkpoint_ns
            AND b.channel = v.key AND b.version = v.value
    ) AS blobs,
    ARRAY(SELECT ROW(w.task_id, w.channel, w.type, w.blob, w.task_path, w.idx)
        FROM fence_checkpoint_writes w WHERE w.tenant_id = c.tenant_id
            AND w.thread_id = c.thread_id AND w.checkpoint_ns = c.checkpoint_ns
            AND w.checkpoint_id = c.checkpoint_id
    ) AS writes
FROM fence_checkpoints c"""


def _numbered(sql: str, first: int, names: str) -> str:
    """Replace the named slots ``$a``, ``$b``... with positional ones from ``first`` on."""
    for offset, name in enumerate(names):
        sql = sql.replace(f"${name}", f"${first + offset}")
    return sql


def _guarded(template: str, first: int, clear: str, **fmt: str) -> dict[str, str]:
    return {
        "none": template.format(guard=_GUARD_NONE, **fmt),
        "share": template.format(guard=_numbered(_GUARD_SHARE, first, "abcd"), **fmt),
        "clear": template.format(guard=_numbered(clear, first, "abcdefg"), **fmt),
    }


_PUT_SQL = _guarded(_PUT, 15, _GUARD_CLEAR)
_PUT_WRITES_SQL = {
    upsert: _guarded(
        _PUT_WRITES,
        11,
        _GUARD_CLEAR_IF_STORED,
        conflict=_WRITES_UPSERT if upsert else "DO NOTHING",
    )
    for upsert in (False, True)
}


def _guard_args(
    guard: Guard | None, proof: Sequence[tuple[str, str]] | None = None
) -> tuple[str, list[Any]]:
    """The guard's kind and its arguments; ``proof`` (a task's writes only) the checkpoints
    that must be stored for ``guard.clear_keys`` to clear."""
    if guard is None:
        return "none", []
    args: list[Any] = [guard.tenant_id, guard.execution_id, guard.holder, guard.epoch]
    if not guard.clear_keys:
        return "share", args
    args.append(stamp_patch(remove=guard.clear_keys))
    if proof is not None:
        args += [[ns for ns, _ in proof], [id_ for _, id_ in proof]]
    return "clear", args


def _arrays(rows: Sequence[Sequence[Any]]) -> list[list[Any]]:
    """Rows of four columns (blobs, writes) as four arrays, for ``unnest``."""
    return [[r[i] for r in rows] for i in range(4)]


class PostgresDriver:
    """Hot paths on PostgreSQL through asyncpg (see the module docstring)."""

    def __init__(self, engine: AsyncEngine) -> None:
        self._connections = Connections(engine)
        self.aclose = self._connections.aclose

    async def _fetchrow(self, sql: str, args: Sequence[Any], *, what: str) -> Any:
        """One guarded write, repeated on a fresh connection after a connection error: the
        same checkpoint id under the same token, so the guard decides again."""

        async def once() -> Any:
            async with self._connections() as conn:
                return await conn.fetchrow(sql, *args)

        return await retry_connection_errors(once, what=what)

    async def put(self, row: CheckpointRow, guard: Guard | None) -> bool:
        kind, guard_args = _guard_args(guard)
        args = [*row.columns(), *_arrays(row.blobs), *guard_args]
        landed = await self._fetchrow(_PUT_SQL[kind], args, what="checkpoint put")
        return landed is not None

    async def put_writes(self, task: TaskWrites, guard: Guard | None) -> tuple[bool, bool]:
        proof = guard.proof if guard is not None and guard.proof else None
        kind, guard_args = _guard_args(guard, proof or ((task.checkpoint_ns, task.checkpoint_id),))
        args = [*task.key(), *_arrays(task.writes), *guard_args]
        sql = _PUT_WRITES_SQL[task.upsert][kind]
        landed = await self._fetchrow(sql, args, what="put_writes")
        return (False, False) if landed is None else (True, bool(landed[1]))

    async def select(self, query: CheckpointQuery) -> list[StoredCheckpoint]:
        wheres: list[str] = []
        args: list[Any] = []

        def arg(value: Any) -> str:
            args.append(value)
            return f"${len(args)}"

        wheres.append(f"c.tenant_id = {arg(query.tenant_id)}")
        if query.thread_id is not None:
            wheres.append(f"c.thread_id = {arg(query.thread_id)}")
        if query.checkpoint_ns is not None:
            wheres.append(f"c.checkpoint_ns = {arg(query.checkpoint_ns)}")
        if query.checkpoint_id is not None:
            wheres.append(f"c.checkpoint_id = {arg(query.checkpoint_id)}")
        if query.metadata_filter:
            wheres.append(f"c.metadata @> {arg(json.dumps(query.metadata_filter))}::jsonb")
        if query.before_id is not None:
            wheres.append(f"c.checkpoint_id < {arg(query.before_id)}")
        sql = _SELECT + " WHERE " + " AND ".join(wheres)
        sql += " ORDER BY c.checkpoint_id DESC"
        if query.limit is not None:
            sql += f" LIMIT {arg(int(query.limit))}"

        async def fetch() -> list[Any]:
            async with self._connections() as conn:
                return list(await conn.fetch(sql, *args))

        rows = await retry_connection_errors(fetch, what="checkpoint read")
        return [
            StoredCheckpoint.selected(
                query.tenant_id, r, [tuple(b) for b in r[7]], [tuple(w) for w in r[8]]
            )
            for r in rows
        ]

"""The SQLite hot paths: each write is ONE ``BEGIN IMMEDIATE`` transaction (a savepoint of one,
when writes arriving together are committed as a group) run in ONE hop to the aiosqlite
connection's thread.

Why one hop: aiosqlite runs every call on its connection's thread and wakes the event loop
for each answer; a transaction of five calls (begin, guard, blobs, checkpoint, commit) pays
five of those round trips. Here the whole transaction is one function queued on that thread
(aiosqlite's private ``Connection._execute``, the method its own public calls use, through
``langgraph_fence._compat``), so it pays one.
``BEGIN IMMEDIATE`` takes the database's write lock first, so the guard's read of the lease
row and the inserts see no other writer in between: a take-over (an UPDATE of the lease row)
either committed before the guard read it, or waits until this transaction ends.
"""

from __future__ import annotations

import asyncio
import json
import sqlite3
import time
from collections.abc import Callable, Sequence
from functools import partial
from typing import Any, TypeVar

from sqlalchemy.ext.asyncio import AsyncEngine

from langgraph_fence._compat import aiosqlite_call
from langgraph_fence.checkpointers._rows import (
    CheckpointQuery,
    CheckpointRow,
    Guard,
    StoredCheckpoint,
    TaskWrites,
)
from langgraph_fence.database.driver import Connections
from langgraph_fence.lease.guard import guard_sql
from langgraph_fence.lease.schema import STAMP_SQL, stamp_patch

__all__ = ["SqliteDriver"]

T = TypeVar("T")

_LEASE_WHERE = guard_sql(
    tenant_id=":tenant_id", execution_id=":execution_id", holder=":holder", epoch=":epoch"
)
_GUARD = f"SELECT epoch FROM fence_leases WHERE {_LEASE_WHERE}"
_GUARD_CLEAR = f"""UPDATE fence_leases SET
    pending_effects = {STAMP_SQL["sqlite"]["patch"].format(param=":patch")},
    updated_at = :now
WHERE {_LEASE_WHERE}
RETURNING epoch"""
_CHECKPOINT_STORED = """SELECT 1 FROM fence_checkpoints
WHERE tenant_id = ? AND thread_id = ? AND checkpoint_ns = ? AND checkpoint_id = ?"""

_INSERT_BLOB = """INSERT INTO fence_checkpoint_blobs
    (tenant_id, thread_id, checkpoint_ns, channel, version, type, blob)
VALUES (?, ?, ?, ?, ?, ?, ?)
ON CONFLICT (tenant_id, thread_id, checkpoint_ns, channel, version) DO NOTHING"""
_INSERT_CHECKPOINT = """INSERT INTO fence_checkpoints (tenant_id, thread_id, checkpoint_ns,
    checkpoint_id, parent_checkpoint_id, type, checkpoint, channel_versions, metadata, run_id,
    fence_token)
VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?)
ON CONFLICT (tenant_id, thread_id, checkpoint_ns, checkpoint_id) DO UPDATE SET
    type = excluded.type, checkpoint = excluded.checkpoint,
    channel_versions = excluded.channel_versions, metadata = excluded.metadata,
    run_id = excluded.run_id, fence_token = excluded.fence_token"""
_INSERT_WRITE = """INSERT INTO fence_checkpoint_writes (tenant_id, thread_id, checkpoint_ns,
    checkpoint_id, task_id, task_path, idx, channel, type, blob, fence_token)
VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?)
ON CONFLICT (tenant_id, thread_id, checkpoint_ns, checkpoint_id, task_id, idx) {conflict}"""
_INSERT_WRITE_SQL = {
    False: _INSERT_WRITE.format(conflict="DO NOTHING"),
    True: _INSERT_WRITE.format(
        conflict="DO UPDATE SET channel = excluded.channel, type = excluded.type,"
        " blob = excluded.blob, fence_token = excluded.fence_token"
    ),
}
_SELECT = """SELECT thread_id, checkpoint_ns, checkpoint_id, parent_checkpoint_id, type,
    checkpoint, metadata, channel_versions FROM fence_checkpoints"""
_SELECT_BLOBS = """SELECT b.channel, b.type, b.blob FROM json_each(?) AS v
JOIN fence_checkpoint_blobs b ON b.tenant_id = ? AND b.thread_id = ? AND b.checkpoint_ns = ?
    AND b.channel = v.key AND b.version = v.value"""
_SELECT_WRITES = """SELECT task_id, channel, type, blob, task_path, idx
FROM fence_checkpoint_writes
WHERE tenant_id = ? AND thread_id = ? AND checkpoint_ns = ? AND checkpoint_id = ?"""


def _check_guard(
    conn: sqlite3.Connection, guard: Guard | None, *, clear: bool = True
) -> int | bool | None:
    """The epoch the guard found (``None`` unfenced), or ``False`` when it found none.

    With ``clear`` and ``guard.clear_keys``, the same check clears those entries of the
    stamp set.
    """
    if guard is None:
        return None
    params: dict[str, Any] = {
        "tenant_id": guard.tenant_id,
        "execution_id": guard.execution_id,
        "holder": guard.holder,
        "epoch": guard.epoch,
    }
    if clear and guard.clear_keys:
        params.update(patch=stamp_patch(remove=guard.clear_keys), now=time.time())
        row = conn.execute(_GUARD_CLEAR, params).fetchone()
    else:
        row = conn.execute(_GUARD, params).fetchone()
    return False if row is None else int(row[0])


Body = Callable[[sqlite3.Connection], bool]


def _commit_group(conn: sqlite3.Connection, bodies: Sequence[Body]) -> list[bool | Exception]:
    """Run each write in its own savepoint of ONE ``BEGIN IMMEDIATE`` transaction.

    A write whose guard refused it (``False``) or that raised is rolled back to its
    savepoint alone; the others commit together, with one sync to disk for the group.
    """
    conn.execute("BEGIN IMMEDIATE")
    results: list[bool | Exception] = []
    try:
        for body in bodies:
            conn.execute("SAVEPOINT fence_write")
            try:
                landed: bool | Exception = body(conn)
            except Exception as exc:
                landed = exc
            if landed is not True:
                conn.execute("ROLLBACK TO fence_write")
            conn.execute("RELEASE fence_write")
            results.append(landed)
        conn.execute("COMMIT")
    except BaseException:
        conn.execute("ROLLBACK")
        raise
    return results


class SqliteDriver:
    """Hot paths on SQLite through aiosqlite (see the module docstring)."""

    def __init__(self, engine: AsyncEngine) -> None:
        self._connections = Connections(engine)
        self.aclose = self._connections.aclose
        self._pending: list[tuple[Body, asyncio.Future[bool]]] = []
        self._flusher: asyncio.Task[None] | None = None

    async def _run(self, fn: Callable[[sqlite3.Connection], T]) -> T:
        async with self._connections() as aio:
            return await aiosqlite_call(aio, fn)

    async def _write(self, body: Body) -> bool:
        """Queue a write for the next group commit and wait for its own outcome.

        SQLite admits one writer at a time, and each commit waits for the disk. Writes of
        this process that arrive while a commit is under way (a fan-out superstep's writes,
        a checkpoint racing its tasks' writes under ``durability="async"``) are committed
        together by the next one: each in its own savepoint, so a refused or failing write
        takes no other with it, and each caller learns only its own outcome once the group
        is on disk. Queueing here also keeps two of this process's writers from sleeping in
        SQLite's busy handler; other processes still wait through the busy timeout.
        """
        future: asyncio.Future[bool] = asyncio.get_running_loop().create_future()
        self._pending.append((body, future))
        if self._flusher is None or self._flusher.done():
            # A task of its own: a caller cancelled while waiting must not stop the others'
            # commit (a write already handed to SQLite lands or fails as a whole anyway).
            self._flusher = asyncio.ensure_future(self._flush())
        return await future

    async def _flush(self) -> None:
        while self._pending:
            group, self._pending = self._pending, []
            bodies = [body for body, _ in group]
            try:
                results = await self._run(partial(_commit_group, bodies=bodies))
            except BaseException as exc:
                for _, future in group:
                    if future.done():
                        continue
                    if isinstance(exc, asyncio.CancelledError):
                        future.cancel()
                    else:
                        future.set_exception(exc)
                if not isinstance(exc, Exception):
                    raise
                continue
            for (_, future), landed in zip(group, results, strict=True):
                if future.done():
                    continue
                if isinstance(landed, Exception):
                    future.set_exception(landed)
                else:
                    future.set_result(landed)

    async def put(self, row: CheckpointRow, guard: Guard | None) -> bool:
        def body(conn: sqlite3.Connection) -> bool:
            token = _check_guard(conn, guard)
            if token is False:
                return False
            if row.blobs:
                conn.executemany(
                    _INSERT_BLOB,
                    [(row.tenant_id, row.thread_id, row.checkpoint_ns, *b) for b in row.blobs],
                )
            conn.execute(_INSERT_CHECKPOINT, (*row.columns(), token))
            return True

        return await self._write(body)

    async def put_writes(self, task: TaskWrites, guard: Guard | None) -> tuple[bool, bool]:
        cleared: list[bool] = []
        tenant_id, thread_id = task.tenant_id, task.thread_id
        at = (task.checkpoint_ns, task.checkpoint_id)

        def body(conn: sqlite3.Connection) -> bool:
            # In the write lock: checkpoints seen here stay stored with the writes. The
            # proof names the writes' checkpoint and every ancestor's (a resume from the
            # root sees the writes only when all of them are stored).
            stored = (
                guard is not None
                and bool(guard.clear_keys)
                and all(
                    conn.execute(_CHECKPOINT_STORED, (tenant_id, thread_id, ns, id_)).fetchone()
                    is not None
                    for ns, id_ in guard.proof or (at,)
                )
            )
            token = _check_guard(conn, guard, clear=stored)
            if token is False:
                return False
            cleared[:] = [stored]
            key = task.key()
            conn.executemany(
                _INSERT_WRITE_SQL[task.upsert], [(*key, *w, token) for w in task.writes]
            )
            return True

        landed = await self._write(body)
        return landed, landed and bool(cleared and cleared[0])

    async def select(self, query: CheckpointQuery) -> list[StoredCheckpoint]:
        wheres: list[str] = ["tenant_id = ?"]
        args: list[Any] = [query.tenant_id]
        if query.thread_id is not None:
            wheres.append("thread_id = ?")
            args.append(query.thread_id)
        if query.checkpoint_ns is not None:
            wheres.append("checkpoint_ns = ?")
            args.append(query.checkpoint_ns)
        if query.checkpoint_id is not None:
            wheres.append("checkpoint_id = ?")
            args.append(query.checkpoint_id)
        for key, value in (query.metadata_filter or {}).items():
            wheres.append("json_extract(metadata, ?) IS json_extract(?, '$')")
            args.extend([f"$.{json.dumps(key)}", json.dumps(value)])
        if query.before_id is not None:
            wheres.append("checkpoint_id < ?")
            args.append(query.before_id)
        sql = _SELECT + " WHERE " + " AND ".join(wheres)
        sql += " ORDER BY checkpoint_id DESC"
        if query.limit is not None:
            sql += " LIMIT ?"
            args.append(int(query.limit))

        def read(conn: sqlite3.Connection) -> list[StoredCheckpoint]:
            out = []
            for r in conn.execute(sql, args).fetchall():
                tenant = query.tenant_id
                blobs = conn.execute(_SELECT_BLOBS, (r[7], tenant, r[0], r[1])).fetchall()
                writes = conn.execute(_SELECT_WRITES, (tenant, r[0], r[1], r[2])).fetchall()
                out.append(StoredCheckpoint.selected(tenant, r, blobs, writes))
            return out

        # No transaction: blobs are never rewritten once a checkpoint references them, and a
        # write landing between two statements only makes the answer newer.
        return await self._run(read)

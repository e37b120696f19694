"""What an instance needs to resume an execution it did not start: its graph, thread, input.

A run started with input records ``(graph name, thread id, input)`` for its execution key
once, before the graph runs. Any instance's :meth:`~langgraph_fence.Instance.serve` loop that
takes the execution over reads it back: it resumes from the last checkpoint, or, if the
first run died before its first checkpoint landed, starts again from the recorded input.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any, Protocol

from langgraph.checkpoint.serde.jsonplus import JsonPlusSerializer
from sqlalchemy import text
from sqlalchemy.ext.asyncio import AsyncEngine

from .database import dialect_of, single_statement
from .lease import LeaseKey
from .migrations import Migration, migrate

__all__ = [
    "ExecutionRecord",
    "ExecutionRecords",
    "MemoryExecutionRecords",
    "SqlExecutionRecords",
]

_serde = JsonPlusSerializer()


@dataclass(frozen=True, slots=True)
class ExecutionRecord:
    """How to resume an execution: the graph it runs, its thread, and its first input."""

    key: LeaseKey
    graph: str
    thread_id: str
    input: Any


class ExecutionRecords(Protocol):
    """Where execution records are kept (next to the leases)."""

    async def record(self, record: ExecutionRecord, *, unless_held: bool = False) -> bool:
        """Keep ``record`` (the latest run with input of a key replaces the one before).

        With ``unless_held``, nothing is written while the execution's lease is held (or
        the execution was dead-lettered): a start that will be refused must not rewrite the
        record of the run in flight. Returns whether the record was written.
        """
        ...

    async def get(self, key: LeaseKey) -> ExecutionRecord | None:
        """The record of ``key``, or ``None``."""
        ...


class MemoryExecutionRecords:
    """Execution records in this process's memory (for tests and one process)."""

    def __init__(self) -> None:
        self._rows: dict[LeaseKey, ExecutionRecord] = {}

    async def record(self, record: ExecutionRecord, *, unless_held: bool = False) -> bool:
        """Keep ``record``; in memory nothing knows the lease, so ``unless_held`` is moot."""
        self._rows[record.key] = record
        return True

    async def get(self, key: LeaseKey) -> ExecutionRecord | None:
        """The record of ``key``, or ``None``."""
        return self._rows.get(key)


_CREATE = """
CREATE TABLE IF NOT EXISTS fence_executions (
    tenant_id TEXT NOT NULL,
    execution_id TEXT NOT NULL,
    graph TEXT NOT NULL,
    thread_id TEXT NOT NULL,
    input_type TEXT NOT NULL,
    input {binary} NOT NULL,
    recorded_at {double} NOT NULL,
    PRIMARY KEY (tenant_id, execution_id)
)
"""

EXECUTION_MIGRATIONS = [
    Migration(
        version=1,
        description="execution records: graph, thread and input of each execution",
        sqlite=[_CREATE.format(binary="BLOB", double="REAL")],
        postgresql=[_CREATE.format(binary="BYTEA", double="DOUBLE PRECISION")],
    )
]

_UPSERT = text(
    "INSERT INTO fence_executions "
    "(tenant_id, execution_id, graph, thread_id, input_type, input, recorded_at) "
    "VALUES (:tenant_id, :execution_id, :graph, :thread_id, :input_type, :input, :at) "
    "ON CONFLICT (tenant_id, execution_id) DO UPDATE SET graph = excluded.graph, "
    "thread_id = excluded.thread_id, input_type = excluded.input_type, "
    "input = excluded.input, recorded_at = excluded.recorded_at"
)
# The same upsert, skipped while the lease is held by anyone (expired or not: a start that
# takes an expired lease over writes its record again once it holds it) or dead-lettered.
_NOT_HELD = (
    "NOT EXISTS (SELECT 1 FROM fence_leases l WHERE l.tenant_id = :tenant_id "
    "AND l.execution_id = :execution_id AND ((l.status = 'running' AND l.holder IS NOT NULL) "
    "OR l.status = 'dead_lettered'))"
)
_UPSERT_UNLESS_HELD = text(
    "INSERT INTO fence_executions "
    "(tenant_id, execution_id, graph, thread_id, input_type, input, recorded_at) "
    "SELECT :tenant_id, :execution_id, :graph, :thread_id, :input_type, :input, :at "
    f"WHERE {_NOT_HELD} "
    "ON CONFLICT (tenant_id, execution_id) DO UPDATE SET graph = excluded.graph, "
    "thread_id = excluded.thread_id, input_type = excluded.input_type, "
    f"input = excluded.input, recorded_at = excluded.recorded_at WHERE {_NOT_HELD}"
)
_SELECT = text(
    "SELECT graph, thread_id, input_type, input FROM fence_executions "
    "WHERE tenant_id = :tenant_id AND execution_id = :execution_id"
)


class SqlExecutionRecords:
    """Execution records in ``fence_executions`` (SQLite or PostgreSQL), one statement each."""

    def __init__(self, engine: AsyncEngine) -> None:
        dialect_of(engine)
        self._engine = engine
        self._writer = single_statement(engine)

    async def setup(self) -> None:
        """Create or upgrade the table; safe from several processes at once."""
        await migrate(self._engine, "executions", EXECUTION_MIGRATIONS)

    async def record(self, record: ExecutionRecord, *, unless_held: bool = False) -> bool:
        """Keep ``record`` (one upsert); with ``unless_held``, not while the lease is held.

        The lease table must be on the same database (as :meth:`Instance.open` puts it).
        """
        input_type, blob = _serde.dumps_typed(record.input)
        async with self._writer.begin() as conn:
            result = await conn.execute(
                _UPSERT_UNLESS_HELD if unless_held else _UPSERT,
                {
                    "tenant_id": record.key.tenant_id,
                    "execution_id": record.key.execution_id,
                    "graph": record.graph,
                    "thread_id": record.thread_id,
                    "input_type": input_type,
                    "input": blob,
                    "at": time.time(),
                },
            )
            return bool(result.rowcount)

    async def get(self, key: LeaseKey) -> ExecutionRecord | None:
        """The record of ``key``, or ``None``."""
        async with self._engine.connect() as conn:
            row = (
                await conn.execute(
                    _SELECT, {"tenant_id": key.tenant_id, "execution_id": key.execution_id}
                )
            ).first()
        if row is None:
            return None
        return ExecutionRecord(
            key=key,
            graph=row.graph,
            thread_id=row.thread_id,
            input=_serde.loads_typed((row.input_type, bytes(row.input))),
        )

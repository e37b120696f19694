"""What an instance needs to resume an execution it did not start, and which execution owns
each thread.

A run started with input records ``(graph name, thread id, input, run config)`` for its
execution key once, before the graph runs (the run config: what of its config and options a
takeover runs with again, :mod:`langgraph_fence.lease.run_config`). Any instance's
:meth:`~langgraph_fence.Instance.serve` loop that takes the execution over reads it back and
runs it with that config again: it resumes from the last checkpoint, or, if the
first run died before its first checkpoint landed, starts again from the recorded input.

One thread, one execution: a tenant's thread is bound to the first execution key that runs
it (:meth:`ExecutionRecords.bind`). A run of that thread under another execution id would
hold another lease, pass every guard and fork the thread; the instance refuses it before it
takes a lease. The binding is keyed by ``(tenant_id, thread_id)``: another tenant's thread
of the same id is another thread, with a binding of its own.
"""

from __future__ import annotations

import time
from collections.abc import Collection, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

from langgraph.checkpoint.serde.base import SerializerProtocol
from sqlalchemy import Double, LargeBinary, Text, bindparam, column, table, text
from sqlalchemy.ext.asyncio import AsyncEngine

from langgraph_fence.database import check_engine, dialect_of, single_statement, transaction
from langgraph_fence.database.driver import Connections
from langgraph_fence.database.migrations import Migration, migrate
from langgraph_fence.database.retry import retry_connection_errors
from langgraph_fence.errors import ExecutionThreadBoundError
from langgraph_fence.lease import LeaseKey
from langgraph_fence.lease.run_config import RecordedRun
from langgraph_fence.lease.schema import yielded_sql
from langgraph_fence.serde import loads_checked, safe_serializer, with_allowlist

__all__ = [
    "ExecutionHead",
    "ExecutionRecord",
    "ExecutionRecords",
    "MemoryExecutionRecords",
    "SqlExecutionRecords",
    "check_thread_binding",
]


@dataclass(frozen=True, slots=True)
class ExecutionRecord:
    """How to resume an execution: the graph it runs, its thread, its first input, and the
    recorded part of the config and options it was started with."""

    key: LeaseKey
    graph: str
    thread_id: str
    input: Any
    run: RecordedRun = field(default_factory=RecordedRun)


@dataclass(frozen=True, slots=True)
class ExecutionHead:
    """What a worker reads of a record before it takes the execution: graph, thread, and
    whether it is a submitted run (whose claim pins the checkpoint its input follows).

    Never the input: that is decoded only when a run needs it, by an instance serving
    ``graph``.
    """

    graph: str
    thread_id: str
    submitted: bool = False


class ExecutionRecords(Protocol):
    """Where execution records are kept (next to the leases)."""

    async def record(self, record: ExecutionRecord, *, unless_held: bool = False) -> bool:
        """Keep ``record`` (the latest run with input of a key replaces the one before).

        With ``unless_held``, nothing is written while the execution's lease is held (or
        the execution was dead-lettered): a start that will be refused must not rewrite the
        record of the run in flight. Returns whether the record was written.
        """
        ...

    async def get(
        self, key: LeaseKey, *, allow: Collection[tuple[str, ...]] = (), with_input: bool = True
    ) -> ExecutionRecord | None:
        """The record of ``key``, or ``None``.

        Args:
            key: the execution.
            allow: ``(module, name)`` pairs the input and run config may construct besides
                what the serializer allows (the served graph's schema and context types).
            with_input: decode the input (else the record's ``input`` is ``None``: a run
                resumed from a checkpoint needs only its run config).

        Raises:
            ValueError: the stored input or run config cannot be decoded, or names a type
                outside the serializer's allow-list (nothing of it was imported or called).
        """
        ...

    async def heads_of(self, keys: Sequence[LeaseKey]) -> Mapping[LeaseKey, ExecutionHead]:
        """Graph and thread of each of ``keys`` that has a record; no input is decoded."""
        ...

    async def bind(self, key: LeaseKey, thread_id: str) -> str:
        """Bind the tenant's ``thread_id`` to ``key`` unless it is bound already; return the
        execution id it is bound to (``key.execution_id`` when this call bound it).

        Two first runs racing with different execution ids: exactly one binds.
        """
        ...

    async def forget(self, key: LeaseKey, thread_id: str) -> None:
        """Delete the record of ``key`` and the binding of the tenant's ``thread_id`` (an
        erasure: the input is gone, and the thread id can be bound again)."""
        ...


def check_thread_binding(key: LeaseKey, thread_id: str, bound: str) -> None:
    """Refuse a run of ``thread_id`` under ``key`` when the thread is bound to ``bound``.

    Raises:
        ExecutionThreadBoundError: ``bound`` is not ``key.execution_id``. The message names
            the bound execution: the caller is of the same tenant (the binding is per
            tenant), so it is that tenant's own thread.
    """
    if bound == key.execution_id:
        return
    bound_key = LeaseKey(key.tenant_id, bound)
    raise ExecutionThreadBoundError(
        f"thread {thread_id!r} of tenant {key.tenant_id!r} belongs to execution {bound!r} "
        f"(scope key {bound_key.scope_key!r}), and this run asked for execution "
        f"{key.execution_id!r}: refused before anything ran (no lease taken, nothing "
        f"written). A thread is run by one execution only, or two leases would fork it: pass "
        f"execution_id={bound!r}, or use another thread id for a new execution",
        bound_execution_id=bound,
    )


class MemoryExecutionRecords:
    """Execution records in this process's memory (for tests and one process)."""

    def __init__(self) -> None:
        self._rows: dict[LeaseKey, ExecutionRecord] = {}
        self._bindings: dict[tuple[str, str], str] = {}

    async def record(self, record: ExecutionRecord, *, unless_held: bool = False) -> bool:
        """Keep ``record``; in memory nothing knows the lease, so ``unless_held`` is moot."""
        self._rows[record.key] = record
        return True

    async def get(
        self, key: LeaseKey, *, allow: Collection[tuple[str, ...]] = (), with_input: bool = True
    ) -> ExecutionRecord | None:
        """The record of ``key``, or ``None`` (kept as objects: nothing to decode)."""
        return self._rows.get(key)

    async def bind(self, key: LeaseKey, thread_id: str) -> str:
        """Bind ``thread_id`` of ``key``'s tenant to ``key`` unless bound; the bound id."""
        return self._bindings.setdefault((key.tenant_id, thread_id), key.execution_id)

    async def forget(self, key: LeaseKey, thread_id: str) -> None:
        """Delete the record of ``key`` and the binding of ``thread_id`` of its tenant."""
        self._rows.pop(key, None)
        self._bindings.pop((key.tenant_id, thread_id), None)

    async def heads_of(self, keys: Sequence[LeaseKey]) -> Mapping[LeaseKey, ExecutionHead]:
        """Graph and thread of each of ``keys`` that has a record."""
        rows = self._rows
        return {k: ExecutionHead(rows[k].graph, rows[k].thread_id) for k in keys if k in rows}


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

_CREATE_BINDINGS = """
CREATE TABLE IF NOT EXISTS fence_thread_bindings (
    tenant_id TEXT NOT NULL,
    thread_id TEXT NOT NULL,
    execution_id TEXT NOT NULL,
    bound_at {double} NOT NULL,
    PRIMARY KEY (tenant_id, thread_id)
)
"""
# Each serving instance says which graphs it serves, now and then (seen_at, wall clock):
# what tells a pending run of a graph nobody serves from one waiting for a free worker.
_CREATE_WORKERS = """
CREATE TABLE IF NOT EXISTS fence_workers (
    instance_id TEXT NOT NULL PRIMARY KEY,
    graphs TEXT NOT NULL,
    seen_at {double} NOT NULL
)
"""
# Threads recorded before version 2 are bound to the execution that recorded them last (the
# one a takeover would resume); two recorded at the same moment: the greater id, so the
# choice does not depend on the order rows come back in.
_BIND_RECORDED = """
INSERT INTO fence_thread_bindings (tenant_id, thread_id, execution_id, bound_at)
SELECT e.tenant_id, e.thread_id, e.execution_id, e.recorded_at FROM fence_executions e
WHERE NOT EXISTS (SELECT 1 FROM fence_executions n WHERE n.tenant_id = e.tenant_id
    AND n.thread_id = e.thread_id AND (n.recorded_at > e.recorded_at
        OR (n.recorded_at = e.recorded_at AND n.execution_id > e.execution_id)))
"""

# Each submitted run of an execution, in submit order: its own identity (run_id, what a
# handle names) and its own outcome. ``status`` is ``queued`` (behind the thread's run, its
# input kept here until a worker promotes it), ``current`` (the execution's run: its state is
# the lease's, its output the record's), or the end it was retired with (the lease's status
# and reason, the record's output, copied when the next run of the thread begins).
_CREATE_RUNS = """
CREATE TABLE IF NOT EXISTS fence_runs (
    run_id TEXT NOT NULL PRIMARY KEY,
    tenant_id TEXT NOT NULL,
    execution_id TEXT NOT NULL,
    seq BIGINT NOT NULL,
    status TEXT NOT NULL,
    graph TEXT NOT NULL,
    thread_id TEXT NOT NULL,
    input_type TEXT NOT NULL,
    input {binary} NOT NULL,
    run_type TEXT NOT NULL,
    run {binary} NOT NULL,
    submitted_at {double} NOT NULL,
    epoch BIGINT,
    reason TEXT,
    output_type TEXT,
    output {binary},
    UNIQUE (tenant_id, execution_id, seq)
)
"""
# Each schedule (langgraph_fence.queue.Schedules): what it submits (graph, thread, input and
# the recorded run config), when (cron in its time zone, on the store's clock; next_tick NULL:
# it has ended), and what it did. A tick fires in the transaction that moves next_tick on
# from it, so it fires once, whichever worker fires it.
_CREATE_SCHEDULES = """
CREATE TABLE IF NOT EXISTS fence_schedules (
    tenant_id TEXT NOT NULL,
    schedule_id TEXT NOT NULL,
    graph TEXT NOT NULL,
    thread_id TEXT NOT NULL,
    execution_id TEXT NOT NULL,
    input_type TEXT NOT NULL,
    input {binary} NOT NULL,
    run_type TEXT NOT NULL,
    run {binary} NOT NULL,
    cron TEXT NOT NULL,
    timezone TEXT NOT NULL,
    overlap TEXT NOT NULL,
    missed TEXT NOT NULL,
    grace {double} NOT NULL,
    paused INTEGER NOT NULL,
    end_at {double},
    next_tick {double},
    last_tick {double},
    fired BIGINT NOT NULL,
    skipped BIGINT NOT NULL,
    created_at {double} NOT NULL,
    PRIMARY KEY (tenant_id, schedule_id)
)
"""
# Each durable sleep of a step (ExecutionContext.sleep): when it ends, on the store's clock,
# keyed by the step's task and the sleep's place in it, so the step's re-run after the sleep
# finds it over and goes on.
_CREATE_SLEEPS = """
CREATE TABLE IF NOT EXISTS fence_sleeps (
    tenant_id TEXT NOT NULL,
    execution_id TEXT NOT NULL,
    sleep_key TEXT NOT NULL,
    wake_at {double} NOT NULL,
    PRIMARY KEY (tenant_id, execution_id, sleep_key)
)
"""
# Each flow key's limits (submit(flow=Flow(...))): at most max_running of its runs running
# (or admitted to run) at once, at most max_starts started in any window of ``per`` seconds;
# NULL: no such limit. A run of a key waits (its lease pending, held back) until a worker's
# look admits it under them.
_CREATE_FLOWS = """
CREATE TABLE IF NOT EXISTS fence_flows (
    tenant_id TEXT NOT NULL,
    flow_key TEXT NOT NULL,
    max_running INTEGER,
    max_starts INTEGER,
    per {double},
    PRIMARY KEY (tenant_id, flow_key)
)
"""
# Each event of a submitted run's recorded stream (submit(stream_mode=...)), in the order its
# holder at ``epoch`` produced them (``seq``): its mode, namespace and payload, the root
# checkpoint its step began from (``after``, "" for none), and the root task that produced
# it (``task``; "^": the state a take began from; NULL: none), an update's node (``node``).
# Written under the holder's
# lease, before the writes of its task and the checkpoint that ends its step; a takeover
# that resumes from checkpoint C withdraws the events older holders recorded after C but
# those of the tasks whose writes C keeps (it runs the others again).
_CREATE_STREAM = """
CREATE TABLE IF NOT EXISTS fence_stream (
    run_id TEXT NOT NULL,
    epoch BIGINT NOT NULL,
    seq BIGINT NOT NULL,
    tenant_id TEXT NOT NULL,
    execution_id TEXT NOT NULL,
    after TEXT NOT NULL,
    task TEXT,
    node TEXT,
    mode TEXT NOT NULL,
    ns TEXT NOT NULL,
    payload_type TEXT NOT NULL,
    payload {binary} NOT NULL,
    withdrawn INTEGER NOT NULL,
    PRIMARY KEY (run_id, epoch, seq)
)
"""
_STREAM_KEY_INDEX = (
    "CREATE INDEX IF NOT EXISTS fence_stream_key ON fence_stream (tenant_id, execution_id)"
)
# Each completion callback of a submitted run (submit(webhook=..., callback=...)): its
# target ("webhook:<url>", or "callback:<name>" for a Python callback a serving worker
# registered), and its delivery: pending (due at ``due``, on the store's clock; a claim
# moves ``due`` on), delivered, or failed after its attempts (``last_error``).
_CREATE_CALLBACKS = """
CREATE TABLE IF NOT EXISTS fence_callbacks (
    run_id TEXT NOT NULL,
    target TEXT NOT NULL,
    tenant_id TEXT NOT NULL,
    execution_id TEXT NOT NULL,
    status TEXT NOT NULL,
    attempts INTEGER NOT NULL,
    due {double} NOT NULL,
    last_error TEXT,
    PRIMARY KEY (run_id, target)
)
"""
_CALLBACKS_INDEXES = (
    "CREATE INDEX IF NOT EXISTS fence_callbacks_due ON fence_callbacks (status, due)",
    "CREATE INDEX IF NOT EXISTS fence_callbacks_key ON fence_callbacks (tenant_id, execution_id)",
)
_RUNS_FLOW_INDEX = (
    "CREATE INDEX IF NOT EXISTS fence_runs_flow ON fence_runs (flow_key, status, tenant_id)"
)
# A key's starts in a window, read at each admission, whatever the key's history.
_RUNS_STARTS_INDEX = (
    "CREATE INDEX IF NOT EXISTS fence_runs_flow_starts ON fence_runs "
    "(tenant_id, flow_key, started_at)"
)
_SCHEDULES_DUE_INDEX = (
    "CREATE INDEX IF NOT EXISTS fence_schedules_due ON fence_schedules (next_tick)"
)
_RUNS_QUEUED_INDEX = "CREATE INDEX IF NOT EXISTS fence_runs_status ON fence_runs (status)"
# The console's listings of every status, newest run first: of all, of a tenant, of a graph
# (langgraph_fence.console). A record is written once per run, never by a renewal.
_CONSOLE_INDEXES = (
    "CREATE INDEX IF NOT EXISTS fence_executions_recorded "
    "ON fence_executions (recorded_at, tenant_id, execution_id)",
    "CREATE INDEX IF NOT EXISTS fence_executions_tenant_recorded "
    "ON fence_executions (tenant_id, recorded_at, execution_id)",
    "CREATE INDEX IF NOT EXISTS fence_executions_graph_recorded "
    "ON fence_executions (graph, recorded_at, tenant_id, execution_id)",
)

EXECUTION_MIGRATIONS = [
    Migration.typed(1, "execution records: graph, thread and input of each execution", _CREATE),
    Migration.typed(
        2, "each tenant's thread bound to one execution key", _CREATE_BINDINGS, _BIND_RECORDED
    ),
    Migration(
        version=3,
        description="execution records: the run config a takeover runs with again",
        # Records written before it have none (NULL): their takeover runs with the thread only.
        sqlite=[
            "ALTER TABLE fence_executions ADD COLUMN run_type TEXT",
            "ALTER TABLE fence_executions ADD COLUMN run BLOB",
        ],
        postgresql=[
            "ALTER TABLE fence_executions ADD COLUMN IF NOT EXISTS run_type TEXT",
            "ALTER TABLE fence_executions ADD COLUMN IF NOT EXISTS run BYTEA",
        ],
    ),
    Migration(
        version=4,
        description="submitted runs: when submitted, the checkpoint the input follows, the output",
        # NULL on every record written before it, and on every run started by ainvoke: a
        # submitted run is one with submitted_at set (langgraph_fence.queue).
        sqlite=[
            "ALTER TABLE fence_executions ADD COLUMN submitted_at REAL",
            "ALTER TABLE fence_executions ADD COLUMN input_after TEXT",
            "ALTER TABLE fence_executions ADD COLUMN output_type TEXT",
            "ALTER TABLE fence_executions ADD COLUMN output BLOB",
        ],
        postgresql=[
            "ALTER TABLE fence_executions ADD COLUMN IF NOT EXISTS submitted_at DOUBLE PRECISION",
            "ALTER TABLE fence_executions ADD COLUMN IF NOT EXISTS input_after TEXT",
            "ALTER TABLE fence_executions ADD COLUMN IF NOT EXISTS output_type TEXT",
            "ALTER TABLE fence_executions ADD COLUMN IF NOT EXISTS output BYTEA",
        ],
    ),
    Migration.typed(
        5, "the serving workers and their graphs (langgraph-fence runs)", _CREATE_WORKERS
    ),
    Migration.typed(
        6,
        "submitted runs, each with its identity and outcome (on_busy='enqueue')",
        _CREATE_RUNS,
        _RUNS_QUEUED_INDEX,
    ),
    Migration(
        version=7,
        description="each serving worker's hold (leases held, max_held, renewal lateness), "
        "and the console's indexes",
        sqlite=[
            "ALTER TABLE fence_workers ADD COLUMN held INTEGER",
            "ALTER TABLE fence_workers ADD COLUMN max_held INTEGER",
            "ALTER TABLE fence_workers ADD COLUMN lease_ttl REAL",
            "ALTER TABLE fence_workers ADD COLUMN renewal_late REAL",
            *_CONSOLE_INDEXES,
        ],
        postgresql=[
            "ALTER TABLE fence_workers ADD COLUMN IF NOT EXISTS held INTEGER",
            "ALTER TABLE fence_workers ADD COLUMN IF NOT EXISTS max_held INTEGER",
            "ALTER TABLE fence_workers ADD COLUMN IF NOT EXISTS lease_ttl DOUBLE PRECISION",
            "ALTER TABLE fence_workers ADD COLUMN IF NOT EXISTS renewal_late DOUBLE PRECISION",
            *_CONSOLE_INDEXES,
        ],
    ),
    Migration(
        version=8,
        description="submitted runs: the time a run may start from (not_before)",
        # NULL on every run submitted before it: it may start at once.
        sqlite=["ALTER TABLE fence_runs ADD COLUMN not_before REAL"],
        postgresql=["ALTER TABLE fence_runs ADD COLUMN IF NOT EXISTS not_before DOUBLE PRECISION"],
    ),
    Migration.typed(
        9,
        "schedules: cron ticks that each submit one run",
        _CREATE_SCHEDULES,
        _SCHEDULES_DUE_INDEX,
    ),
    Migration.typed(10, "durable sleeps: when each step's sleep ends", _CREATE_SLEEPS),
    Migration(
        version=11,
        description="flow keys: limits on the runs of a key, and when each run started",
        # NULL on every run and record before it: no key, start unknown.
        sqlite=[
            "ALTER TABLE fence_runs ADD COLUMN flow_key TEXT",
            "ALTER TABLE fence_runs ADD COLUMN started_at REAL",
            "ALTER TABLE fence_executions ADD COLUMN started_at REAL",
            _CREATE_FLOWS.format(double="REAL"),
            _RUNS_FLOW_INDEX,
            _RUNS_STARTS_INDEX,
        ],
        postgresql=[
            "ALTER TABLE fence_runs ADD COLUMN IF NOT EXISTS flow_key TEXT",
            "ALTER TABLE fence_runs ADD COLUMN IF NOT EXISTS started_at DOUBLE PRECISION",
            "ALTER TABLE fence_executions ADD COLUMN IF NOT EXISTS started_at DOUBLE PRECISION",
            _CREATE_FLOWS.format(double="DOUBLE PRECISION"),
            _RUNS_FLOW_INDEX,
            _RUNS_STARTS_INDEX,
        ],
    ),
    Migration(
        version=12,
        description="run retries: how many attempts each submitted run made",
        # NULL on every run before it: one attempt.
        sqlite=["ALTER TABLE fence_runs ADD COLUMN attempts INTEGER"],
        postgresql=["ALTER TABLE fence_runs ADD COLUMN IF NOT EXISTS attempts INTEGER"],
    ),
    Migration(
        version=13,
        description="streams: each submitted run's recorded events, and the modes it records",
        # NULL on every run before it: its stream is not recorded.
        sqlite=[
            "ALTER TABLE fence_runs ADD COLUMN stream_modes TEXT",
            _CREATE_STREAM.format(binary="BLOB"),
            _STREAM_KEY_INDEX,
        ],
        postgresql=[
            "ALTER TABLE fence_runs ADD COLUMN IF NOT EXISTS stream_modes TEXT",
            _CREATE_STREAM.format(binary="BYTEA"),
            _STREAM_KEY_INDEX,
        ],
    ),
    Migration.typed(
        14,
        "completion callbacks: each submitted run's webhooks and callbacks, and their delivery",
        _CREATE_CALLBACKS,
        *_CALLBACKS_INDEXES,
    ),
]

#: The columns a run's record writes (and a later record of the key replaces), beside its
#: key; and those a new record clears (what a submitted run before it left).
RECORDED = ("graph", "thread_id", "input_type", "input", "run_type", "run", "recorded_at")
CLEARED = ("submitted_at", "input_after", "output_type", "output", "started_at")
#: ``fence_executions`` and ``fence_thread_bindings`` for statements built with SQLAlchemy
#: Core (the take of a run, ``stores/sql.py``); their tables are created by the DDL above.
EXECUTIONS = table(
    "fence_executions",
    column("tenant_id", Text),
    column("execution_id", Text),
    *(column(name, Text) for name in ("graph", "thread_id", "input_type", "run_type")),
    column("input", LargeBinary),
    column("run", LargeBinary),
    column("recorded_at", Double),
    *(column(name, Text) for name in CLEARED),
)
BINDINGS = table(
    "fence_thread_bindings",
    column("tenant_id", Text),
    column("thread_id", Text),
    column("execution_id", Text),
    column("bound_at", Double),
)

_COLUMNS = f"(tenant_id, execution_id, {', '.join(RECORDED)}) "
_VALUES = ":tenant_id, :execution_id, :graph, :thread_id, :input_type, :input, :run_type, :run, :at"
_ON_CONFLICT = "ON CONFLICT (tenant_id, execution_id) DO UPDATE SET " + ", ".join(
    [f"{name} = excluded.{name}" for name in RECORDED] + [f"{name} = NULL" for name in CLEARED]
)
#: Write a run's record (binds: :meth:`SqlExecutionRecords.columns`).
UPSERT_RECORD = text(f"INSERT INTO fence_executions {_COLUMNS}VALUES ({_VALUES}) {_ON_CONFLICT}")
#: Submitted runs of the execution wait: one for a worker (pending, its record submitted),
#: or runs queued on the thread (``on_busy="enqueue"``: they run next). New input is refused
#: while they do (``run.py``). On ``l``, a lease row of the same key.
SUBMIT_WAITING = (
    "((l.status = 'pending' AND EXISTS (SELECT 1 FROM fence_executions s "
    "WHERE s.tenant_id = l.tenant_id AND s.execution_id = l.execution_id "
    "AND s.submitted_at IS NOT NULL)) OR EXISTS (SELECT 1 FROM fence_runs q "
    "WHERE q.tenant_id = l.tenant_id AND q.execution_id = l.execution_id "
    "AND q.status = 'queued'))"
)
# The same upsert, skipped while the lease is held by anyone (expired or not, yielded, or a
# woken tree: a start that takes such a lease writes its record again once it holds it),
# dead-lettered, or pending with a submitted run (waiting for a worker: run.py refuses the
# start), or with submitted runs queued on the thread (on_busy="enqueue": they run next).
_NOT_HELD = (
    "NOT EXISTS (SELECT 1 FROM fence_leases l WHERE l.tenant_id = :tenant_id "
    "AND l.execution_id = :execution_id AND "
    "((l.status = 'running' AND l.holder IS NOT NULL) OR " + yielded_sql("l") + " "
    "OR (l.status = 'pending' AND l.holder IS NULL AND l.expires_at IS NOT NULL) "
    f"OR l.status = 'dead_lettered' OR {SUBMIT_WAITING}))"
)
_UPSERT_UNLESS_HELD = text(
    f"INSERT INTO fence_executions {_COLUMNS}SELECT {_VALUES} WHERE {_NOT_HELD} "
    f"{_ON_CONFLICT} WHERE {_NOT_HELD}"
)
_SELECT = text(
    "SELECT graph, thread_id, input_type, input, run_type, run FROM fence_executions "
    "WHERE tenant_id = :tenant_id AND execution_id = :execution_id"
)
# By execution id only (one expanding parameter on both dialects); the tenant is matched
# on the rows that come back.
_SELECT_HEADS = text(
    "SELECT tenant_id, execution_id, graph, thread_id, submitted_at FROM fence_executions "
    "WHERE execution_id IN :ids"
).bindparams(bindparam("ids", expanding=True))
_HEADS_CHUNK = 500
# A parent's children: each child's lease row records its parent (lease schema version 5;
# children of earlier versions were linked by that migration).
_CHILDREN_OF = text(
    "SELECT e.execution_id, e.thread_id FROM fence_executions e JOIN fence_leases l "
    "ON l.tenant_id = e.tenant_id AND l.execution_id = e.execution_id "
    "WHERE e.tenant_id = :tenant_id AND l.parent_execution_id = :parent_execution_id "
    "ORDER BY e.execution_id"
)
_FORGET_RECORD = text(
    "DELETE FROM fence_executions WHERE tenant_id = :tenant_id AND execution_id = :execution_id"
)
_FORGET_RUNS = text(
    "DELETE FROM fence_runs WHERE tenant_id = :tenant_id AND execution_id = :execution_id"
)
# A schedule of the thread holds its input and would start it again: erased with it.
_FORGET_SCHEDULES = text(
    "DELETE FROM fence_schedules WHERE tenant_id = :tenant_id AND execution_id = :execution_id"
)
_FORGET_SLEEPS = text(
    "DELETE FROM fence_sleeps WHERE tenant_id = :tenant_id AND execution_id = :execution_id"
)
_FORGET_STREAM = text(
    "DELETE FROM fence_stream WHERE tenant_id = :tenant_id AND execution_id = :execution_id"
)
_FORGET_CALLBACKS = text(
    "DELETE FROM fence_callbacks WHERE tenant_id = :tenant_id AND execution_id = :execution_id"
)
_FORGET_ATTEMPTS = text(
    "DELETE FROM fence_server_attempts "
    "WHERE tenant_id = :tenant_id AND execution_id = :execution_id"
)
_FORGET_JOURNAL = text(
    "DELETE FROM fence_journal WHERE tenant_id = :tenant_id AND execution_id = :execution_id"
)
_FORGET_BINDING = text(
    "DELETE FROM fence_thread_bindings WHERE tenant_id = :tenant_id AND thread_id = :thread_id"
)


#: The execution id the tenant's thread is bound to, and the binding of a first run.
BOUND_TO = text(
    "SELECT execution_id FROM fence_thread_bindings "
    "WHERE tenant_id = :tenant_id AND thread_id = :thread_id"
)
BIND_THREAD = text(
    "INSERT INTO fence_thread_bindings (tenant_id, thread_id, execution_id, bound_at) "
    "VALUES (:tenant_id, :thread_id, :execution_id, :at) "
    "ON CONFLICT (tenant_id, thread_id) DO NOTHING"
)


class SqlExecutionRecords:
    """Execution records in ``fence_executions`` (SQLite or PostgreSQL), one statement each.

    Args:
        engine: the engine of the lease table's database.
        serde: the serializer of the recorded inputs (default: LangGraph's in strict msgpack
            mode, :func:`langgraph_fence.serde.safe_serializer`). A stored input that names a
            type outside its allow-list is never constructed: :meth:`get` refuses it.
    """

    def __init__(self, engine: AsyncEngine, *, serde: SerializerProtocol | None = None) -> None:
        check_engine(engine)
        if serde is not None and not callable(getattr(serde, "loads_typed", None)):
            raise ValueError(
                "serde must be a LangGraph serializer (dumps_typed/loads_typed), got "
                f"{type(serde).__name__}: pass e.g. JsonPlusSerializer(allowed_msgpack_modules=...)"
            )
        self._engine = engine
        self._writer = single_statement(engine)
        self.serde: SerializerProtocol = serde if serde is not None else safe_serializer()
        # The read every takeover makes runs on the driver on PostgreSQL (as the lease
        # store's take does): SQLAlchemy's work and pool checkout cost as much as the read.
        self._driver = (
            Connections(engine, share=4, spill=True) if dialect_of(engine) == "postgresql" else None
        )

    async def aclose(self) -> None:
        """Give the connections the records' reads are kept on back to the engine's pool
        (disposing of the engine closes them too)."""
        if self._driver is not None:
            await self._driver.aclose()

    @property
    def engine(self) -> AsyncEngine:
        """The engine the records are kept through."""
        return self._engine

    async def setup(self) -> None:
        """Create or upgrade the table; safe from several processes at once."""
        await migrate(self._engine, "executions", EXECUTION_MIGRATIONS)

    async def record(self, record: ExecutionRecord, *, unless_held: bool = False) -> bool:
        """Keep ``record`` (one upsert); with ``unless_held``, not while the lease is held.

        The lease table must be on the same database (as :meth:`Instance.open` puts it).
        """
        async with self._writer.begin() as conn:
            result = await conn.execute(
                _UPSERT_UNLESS_HELD if unless_held else UPSERT_RECORD, self.columns(record)
            )
            return bool(result.rowcount)

    def columns(self, record: ExecutionRecord) -> dict[str, Any]:
        """The row of ``record`` (input and run config serialised), keyed by the bind names
        of the record's upsert: ``tenant_id``, ``execution_id``, each of :data:`RECORDED`
        (``recorded_at`` as ``at``)."""
        input_type, blob = self.serde.dumps_typed(record.input)
        run_type, run = self.serde.dumps_typed(record.run.as_payload())
        return {
            "tenant_id": record.key.tenant_id,
            "execution_id": record.key.execution_id,
            "graph": record.graph,
            "thread_id": record.thread_id,
            "input_type": input_type,
            "input": blob,
            "run_type": run_type,
            "run": run,
            "at": time.time(),
        }

    async def get(
        self, key: LeaseKey, *, allow: Collection[tuple[str, ...]] = (), with_input: bool = True
    ) -> ExecutionRecord | None:
        """The record of ``key``, or ``None``, in one read: decoded as
        :meth:`ExecutionRecords.get` says, ``allow`` beside what :attr:`serde` allows."""

        params = {"tenant_id": key.tenant_id, "execution_id": key.execution_id}
        driver = self._driver

        async def read() -> Any:
            if driver is not None:
                rows = await driver.rows(_SELECT, params)
                return rows[0] if rows else None
            async with self._engine.connect() as conn:
                found = (await conn.execute(_SELECT, params)).first()
            return None if found is None else found._mapping

        row = await retry_connection_errors(read, what="execution record read")
        if row is None:
            return None
        return self.decode(key, row, allow=allow, with_input=with_input)

    def decode(
        self,
        key: LeaseKey,
        row: Mapping[str, Any],
        *,
        allow: Collection[tuple[str, ...]] = (),
        with_input: bool = True,
    ) -> ExecutionRecord:
        """The record of ``key`` from ``row``: its ``fence_executions`` columns (``graph``,
        ``thread_id``, ``input_type``, ``input``, ``run_type``, ``run``) as a statement that
        did other work read them, decoded as :meth:`get` decodes them.

        Raises:
            ValueError: the serializer cannot load the recorded input or run config.
        """
        serde = with_allowlist(self.serde, allow)
        run = RecordedRun()
        if row["run"] is not None:
            what = f"the recorded run config of execution {key.scope_key!r}"
            payload = loads_checked(serde, (row["run_type"], bytes(row["run"])), what=what)
            run = RecordedRun.from_payload(payload)
        return ExecutionRecord(
            key=key,
            graph=row["graph"],
            thread_id=row["thread_id"],
            input=loads_checked(
                serde,
                (row["input_type"], bytes(row["input"])),
                what=f"the recorded input of execution {key.scope_key!r}",
            )
            if with_input
            else None,
            run=run,
        )

    async def bind(self, key: LeaseKey, thread_id: str) -> str:
        """Bind the tenant's ``thread_id`` to ``key`` unless bound; the execution id it is
        bound to. One read when bound already; else one insert and one read, in one
        transaction (a racing first run's insert conflicts and reads the winner's id).
        Repeated on a connection error: the insert does nothing where a binding exists."""
        params = {"tenant_id": key.tenant_id, "thread_id": thread_id}

        async def once() -> str:
            async with self._engine.connect() as conn:
                bound = (await conn.execute(BOUND_TO, params)).scalar_one_or_none()
            if bound is not None:
                return str(bound)
            async with transaction(self._engine) as conn:
                await conn.execute(
                    BIND_THREAD, {**params, "execution_id": key.execution_id, "at": time.time()}
                )
                return str((await conn.execute(BOUND_TO, params)).scalar_one())

        return await retry_connection_errors(once, what="thread binding")

    async def forget(self, key: LeaseKey, thread_id: str) -> None:
        """Delete the record of ``key``, its submitted runs (their inputs and outputs), its
        schedules (their input), durable sleeps, recorded streams and callbacks, what the
        lease store keeps of its Agent Server attempts, its journal, and the binding of
        ``thread_id`` of its tenant, in one transaction."""
        async with transaction(self._engine) as conn:
            params = {"tenant_id": key.tenant_id}
            await conn.execute(_FORGET_RECORD, {**params, "execution_id": key.execution_id})
            await conn.execute(_FORGET_RUNS, {**params, "execution_id": key.execution_id})
            await conn.execute(_FORGET_SLEEPS, {**params, "execution_id": key.execution_id})
            await conn.execute(_FORGET_STREAM, {**params, "execution_id": key.execution_id})
            await conn.execute(_FORGET_CALLBACKS, {**params, "execution_id": key.execution_id})
            await conn.execute(_FORGET_SCHEDULES, {**params, "execution_id": key.execution_id})
            await conn.execute(_FORGET_ATTEMPTS, {**params, "execution_id": key.execution_id})
            await conn.execute(_FORGET_JOURNAL, {**params, "execution_id": key.execution_id})
            await conn.execute(_FORGET_BINDING, {**params, "thread_id": thread_id})

    async def children_of(self, key: LeaseKey) -> list[tuple[LeaseKey, str]]:
        """``(key, thread id)`` of each ``ANY_INSTANCE`` child ``key`` spawned that has a
        record, in order of id: the children whose lease row names ``key`` as their exact
        parent, never an id prefix. One indexed read."""
        params = {"tenant_id": key.tenant_id, "parent_execution_id": key.execution_id}
        async with self._engine.connect() as conn:
            rows = await conn.execute(_CHILDREN_OF, params)
            return [(LeaseKey(key.tenant_id, row.execution_id), row.thread_id) for row in rows]

    async def heads_of(self, keys: Sequence[LeaseKey]) -> Mapping[LeaseKey, ExecutionHead]:
        """Graph and thread of each of ``keys`` that has a record: one read per 500 keys, no
        input decoded (a worker learns which graph an execution runs before it loads it)."""
        wanted = set(keys)
        ids = sorted({key.execution_id for key in wanted})

        async def read() -> dict[LeaseKey, ExecutionHead]:
            found: dict[LeaseKey, ExecutionHead] = {}
            async with self._engine.connect() as conn:
                for start in range(0, len(ids), _HEADS_CHUNK):
                    chunk = ids[start : start + _HEADS_CHUNK]
                    for row in await conn.execute(_SELECT_HEADS, {"ids": chunk}):
                        key = LeaseKey(row.tenant_id, row.execution_id)
                        if key in wanted:
                            submitted = row.submitted_at is not None
                            found[key] = ExecutionHead(row.graph, row.thread_id, submitted)
            return found

        return await retry_connection_errors(read, what="execution heads read")

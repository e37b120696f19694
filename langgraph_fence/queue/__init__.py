"""Runs any worker can take: submit, claim, output, cancel, and what a busy thread does.

``await instance.submit(graph_name, input, config, tenant_id=...)`` records the execution
(graph name, thread, input, and the run config as :mod:`langgraph_fence.lease.run_config`
records it) and sets its lease ``pending`` with no holder, in one transaction, and returns
a :class:`SubmittedRun` at once. A pending lease with no holder is a takeover candidate: any
instance's :meth:`~langgraph_fence.Instance.serve` that serves the graph takes it in its one
guarded take statement (the next token), runs the recorded input under that lease, and
stores the output with the execution under the same guard before it releases the lease
``done``. Nothing here adds a second way to run: a claimed run is a taken-over run, so a
claimed-then-killed run is an expired lease like any other, and its takeover decides its
standing stamps as every takeover does (a non-idempotent write is never repeated).

Which checkpoint the input follows is pinned by the first claimer, under its lease, before
the input runs (:meth:`SubmittedRuns.pin`): a later taker that finds the thread still at that
checkpoint runs the input again (the first one died before its first checkpoint); one that
finds a newer checkpoint resumes from it. The input is never applied twice and never lost.

A thread's execution that is pending or running is busy: a submit of the same graph, input
and run config is the same submit again (idempotent: it returns that run, nothing written);
any other input is handled by ``on_busy``: ``"reject"`` (default) raises
:class:`~langgraph_fence.errors.ExecutionBusyError`; ``"interrupt"`` fences the run in flight
(its epoch moves on in the same transaction, so its next write, renewal or release is
refused as any stale writer's, and it drains) and leaves the new input pending for the next
claimer; ``"enqueue"`` keeps the new input in the run's own row of ``fence_runs``, queued
behind the thread's run: once that run has ended, a worker's look begins the next queued run
of the thread (in submit order) in one transaction (the ended run keeps its outcome in its
row, the queued one becomes the execution's record and its lease is set pending), and it is
claimed like any submitted run. A worker gone between two runs leaves the queue as it was:
the next look of any worker begins the next run, once. Every submit has its own run id, so
each handle reads its own run's end, never a later run's output. Cancelling a run is the
same fence, ending the execution ``failed`` (a queued run: it never begins).

Only over a SQL lease store (SQLite or PostgreSQL, :meth:`Instance.open`): the queue is the
lease table every worker reads.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import time
import uuid
from collections.abc import AsyncIterator, Collection, Mapping, Sequence
from contextlib import asynccontextmanager, nullcontext
from dataclasses import dataclass, replace
from functools import partial
from typing import TYPE_CHECKING, Any, Final, Literal

from sqlalchemy import text
from sqlalchemy.ext.asyncio import AsyncConnection, AsyncEngine

from langgraph_fence.database import dialect_of, discard, single_statement, transaction
from langgraph_fence.database.driver import DriverStatement, fetch
from langgraph_fence.database.retry import is_connection_error, retry_connection_errors
from langgraph_fence.errors import ExecutionBusyError, ExecutionEndedError, RunFailedError
from langgraph_fence.lease import Lease, LeaseKey, LeaseStatus
from langgraph_fence.lease.guard import guard_sql
from langgraph_fence.lease.schema import in_flight_sql, yielded_sql
from langgraph_fence.lease.transitions import is_yielded
from langgraph_fence.queue.notifications import (
    ENDS_CHANNEL,
    NOTIFY_CHANNEL,
    NOTIFY_SQL,
    OF_SCHEMA,
    Notifications,
)
from langgraph_fence.validate import MAX_ID_BYTES, positive_seconds, text_id

if TYPE_CHECKING:
    from langgraph.checkpoint.serde.base import SerializerProtocol

    from langgraph_fence.fence import RunHandle
    from langgraph_fence.lease.run_config import RecordedRun
    from langgraph_fence.lease.sql import SqlLeaseRepository

logger = logging.getLogger(__name__)

# LangGraph is imported by what submits and runs (run_config, serde), not by what lists:
# `langgraph-fence runs` reads this module without it (benchmarks/README.md, start-up).

__all__ = [
    "ANNOUNCED_FOR",
    "ANNOUNCE_EVERY",
    "ON_BUSY",
    "OnBusy",
    "RunState",
    "SubmittedRun",
    "SubmittedRuns",
    "list_runs",
    "served_graphs",
]

OnBusy = Literal["reject", "enqueue", "interrupt"]
#: What a submit may do when the thread's execution is pending or running.
ON_BUSY: Final = ("reject", "enqueue", "interrupt")
_BUSY = (LeaseStatus.PENDING.value, LeaseStatus.RUNNING.value)
#: Statuses a submitted run ends in (``waiting``: it reached an interrupt).
_ENDED = frozenset({"done", "waiting", "failed", "dead_lettered", "cancelled"})
#: Lease statuses after which a thread's next queued run may begin.
_BETWEEN_RUNS = ("done", "waiting", "failed", "cancelled")

_KEY = "tenant_id = :tenant_id AND execution_id = :execution_id"
_HELD = guard_sql(
    tenant_id="l.tenant_id", execution_id="l.execution_id", holder=":holder", epoch=":epoch"
)
_HELD_HERE = (
    "EXISTS (SELECT 1 FROM fence_leases l WHERE l.tenant_id = fence_executions.tenant_id "
    f"AND l.execution_id = fence_executions.execution_id AND {_HELD})"
)
_LEASE = "SELECT status, holder, epoch, reason FROM fence_leases WHERE " + _KEY


# A child of the parent (by the parent its row records, never by the shape of its id)
# still pending, running, or yielded itself.
_LIVE = in_flight_sql("c")
_LIVE_CHILD = (
    "SELECT 1 FROM fence_leases c WHERE c.tenant_id = :tenant_id "
    "AND c.parent_execution_id = :execution_id AND " + _LIVE
)


class _LeaseWrites:
    """The queue's writes of lease rows, stamped with the lease store's clock (its
    ``now_sql``: ``now()`` on PostgreSQL, or the store's injected clock), as every other
    lease write is; never the submitting process's clock."""

    def __init__(self, now: str) -> None:
        # A new key: pending at epoch 0 with no holder (the first claim takes epoch 1); a
        # child's row records its parent (:parent_execution_id, of the same tenant).
        self.insert_pending = text(
            "INSERT INTO fence_leases (tenant_id, execution_id, scope_key, epoch, holder, "
            "expires_at, status, pending_effects, reason, updated_at, takeovers, "
            "progress_mark, parent_execution_id) VALUES (:tenant_id, :execution_id, "
            f":scope_key, 0, NULL, NULL, 'pending', '{{}}', NULL, {now}, 0, NULL, "
            ":parent_execution_id) ON CONFLICT (tenant_id, execution_id) "
            "DO NOTHING RETURNING epoch"
        )
        # A new turn of an execution that is not busy: pending again at the same epoch (the
        # claim takes the next one). The stamp set stays: the take decides it, as for every
        # take.
        self.repend = text(
            "UPDATE fence_leases SET status = 'pending', holder = NULL, expires_at = NULL, "
            f"reason = NULL, updated_at = {now} WHERE " + _KEY + " AND epoch = :epoch"
        )
        # The run in flight is fenced: its epoch moves on, so none of its writes lands again.
        fence = (
            "UPDATE fence_leases SET epoch = epoch + 1, holder = NULL, expires_at = NULL, "
            f"status = :status, reason = :reason, updated_at = {now} WHERE " + _KEY
        )
        self.interrupt = text(fence + " AND epoch = :epoch")
        # Pending, running, or yielded (waiting with its holder kept: its run goes on).
        self.cancel = text(fence + " AND " + in_flight_sql() + " RETURNING epoch")
        # A parent's children that no worker claimed yet (pending, no holder) never start.
        self.cancel_children = text(
            "UPDATE fence_leases SET epoch = epoch + 1, status = 'cancelled', reason = :reason, "
            f"updated_at = {now} WHERE tenant_id = :tenant_id AND status = 'pending' "
            "AND holder IS NULL AND parent_execution_id = :parent_execution_id"
        )
        # Every yielded tree whose children have all ended, woken as ``wake`` wakes one: the
        # sweep of a serve() look, for the ends that did not wake their parent (a child
        # dead-lettered or abandoned by a take or an operator, a wake lost to an outage).
        woken = (
            f"UPDATE fence_leases SET status = 'pending', holder = NULL, expires_at = {now} "
            f"+ :ttl, updated_at = {now} WHERE "
        )
        self.wake_all = text(
            woken + yielded_sql() + " AND NOT EXISTS (SELECT 1 FROM fence_leases c WHERE "
            "c.tenant_id = fence_leases.tenant_id AND "
            "c.parent_execution_id = fence_leases.execution_id AND " + _LIVE + ") RETURNING epoch"
        )
        # A yielded tree whose children have all ended becomes pending for any instance,
        # one lease TTL (:ttl) from now on (until then its waiter, usually alive, takes it
        # again first); run after each child's end and after each yield, so whichever
        # comes last sees every end.
        self.wake = text(
            woken + _KEY + " AND " + yielded_sql() + " AND NOT EXISTS (" + _LIVE_CHILD + ") "
            "RETURNING epoch"
        )
        # Children spawned together, each new key a pending lease at epoch 0 (a key found
        # is left as it is), only while the parent's row passes the guard.
        pending = f"0, NULL, NULL, 'pending', '{{}}', NULL, {now}, 0, NULL"
        # PostgreSQL: the parent's row locked, the leases, the records and the NOTIFY (on
        # commit), in ONE statement; the spawned keys come back.
        self.spawn_children = text(
            "WITH parent AS (" + _PARENT_HELD + " FOR UPDATE), "
            "spawned AS (SELECT s.value ->> 0 AS execution_id, s.value ->> 1 AS scope_key, "
            "s.value ->> 2 AS input_type, decode(s.value ->> 3, 'hex') AS input FROM "
            "jsonb_array_elements(CAST(:children AS jsonb)) AS s(value)), "
            "created AS (" + _CHILD_LEASE + "SELECT :tenant_id, s.execution_id, s.scope_key, "
            f"{pending}, :pexecution FROM parent, spawned s "
            "ON CONFLICT (tenant_id, execution_id) DO NOTHING "
            "RETURNING execution_id), "
            "recorded AS (" + _RECORD_INTO + "SELECT :tenant_id, s.execution_id, :graph, "
            "s.execution_id, s.input_type, s.input, :run_type, :run, :at, :at, NULL, NULL, NULL "
            "FROM created JOIN spawned s USING (execution_id)" + _RECORD_UPSERT + ") "
            "SELECT EXISTS (SELECT 1 FROM parent) AS held, (SELECT CAST(json_agg(execution_id) "
            "AS text) FROM created) AS created, "
            f"(SELECT count(pg_notify({OF_SCHEMA}, :graph)) FROM (SELECT 1 FROM created "
            "LIMIT 1) AS any_created) AS told"
        )  # told: serve() is notified (on commit) once if any child is new
        # SQLite (inside BEGIN IMMEDIATE, after the guard's read): the leases; the records
        # follow (SubmittedRuns.submit_children).
        self.spawn_leases = text(
            _CHILD_LEASE + "SELECT :tenant_id, json_extract(value, '$[0]'), "
            f"json_extract(value, '$[1]'), {pending}, :pexecution FROM json_each(:rows) "
            "WHERE true "
            "ON CONFLICT (tenant_id, execution_id) DO NOTHING RETURNING execution_id"
        )


_RECORDED = text(
    "SELECT graph, input_type, input, run_type, run FROM fence_executions WHERE " + _KEY
)
_RECORD_INTO = (
    "INSERT INTO fence_executions (tenant_id, execution_id, graph, thread_id, input_type, "
    "input, run_type, run, recorded_at, submitted_at, input_after, output_type, output) "
)
_RECORD_UPSERT = (
    " ON CONFLICT (tenant_id, execution_id) DO UPDATE SET "
    "graph = excluded.graph, thread_id = excluded.thread_id, input_type = excluded.input_type, "
    "input = excluded.input, run_type = excluded.run_type, run = excluded.run, "
    "recorded_at = excluded.recorded_at, submitted_at = excluded.submitted_at, "
    "input_after = NULL, output_type = NULL, output = NULL"
)
_SUBMIT_RECORD = text(
    _RECORD_INTO
    + "VALUES (:tenant_id, :execution_id, :graph, :thread_id, :input_type, :input, :run_type, "
    ":run, :at, :at, NULL, NULL, NULL)" + _RECORD_UPSERT
)
# The record columns two submits must share to be the same submit again.
_SAME = ("graph", "input_type", "input", "run_type", "run")
# A child is recorded only under its parent's hold (the lease guard on the parent's row).
_PARENT_HELD = "SELECT 1 FROM fence_leases WHERE " + guard_sql(
    tenant_id=":ptenant", execution_id=":pexecution", holder=":holder", epoch=":epoch"
)
# Children spawned together, recorded in one statement (PostgreSQL) or one transaction of a
# fixed number of statements (SQLite), whatever their number: each a pending lease at epoch
# 0 and a submitted record, for the keys that are new (a key found is left as it is).
# A child's lease row records its parent (:pexecution, of the same tenant).
_CHILD_LEASE = (
    "INSERT INTO fence_leases (tenant_id, execution_id, scope_key, epoch, holder, expires_at, "
    "status, pending_effects, reason, updated_at, takeovers, progress_mark, "
    "parent_execution_id) "
)
# SQLite: the children's records as positional rows (an input is a blob, which its JSON
# cannot carry), at most this many in one statement (three parameters each, under SQLite's
# default limit of 32 766 parameters).
_SQLITE_CHILDREN_PER_STATEMENT = 10_000
# What a waiting parent reads per look: of the children it waits for, those that ended (with
# their outputs) or are gone, in one read whatever their number.
_ENDED_SQL = (
    "(l.status IN ("
    + ", ".join(
        f"'{status.value}'"
        for status in (
            LeaseStatus.DONE,
            LeaseStatus.WAITING,
            LeaseStatus.FAILED,
            LeaseStatus.DEAD_LETTERED,
            LeaseStatus.CANCELLED,
        )
    )
    + ") AND NOT "
    + yielded_sql("l")
    + ")"
)
_CHILD_ENDS_COLUMNS = (
    "SELECT c.tenant_id, c.execution_id, l.status, l.holder, l.epoch, l.reason, "
    "e.output_type, e.output FROM "
)
_CHILD_ENDS_JOINS = (
    " LEFT JOIN fence_leases l ON l.tenant_id = c.tenant_id AND l.execution_id = "
    "c.execution_id LEFT JOIN fence_executions e ON e.tenant_id = c.tenant_id AND "
    "e.execution_id = c.execution_id WHERE l.execution_id IS NULL OR " + _ENDED_SQL
)
_CHILD_ENDS = {
    "postgresql": text(
        _CHILD_ENDS_COLUMNS
        + "(SELECT k.value ->> 0 AS tenant_id, k.value ->> 1 AS execution_id FROM "
        "jsonb_array_elements(CAST(:keys AS jsonb)) AS k(value)) AS c" + _CHILD_ENDS_JOINS
    ),
    "sqlite": text(
        _CHILD_ENDS_COLUMNS
        + "(SELECT json_extract(value, '$[0]') AS tenant_id, json_extract(value, '$[1]') AS "
        "execution_id FROM json_each(:keys)) AS c" + _CHILD_ENDS_JOINS
    ),
}


# The first claimer pins the checkpoint the input follows; every later taker reads it back.
_PIN = text(
    "UPDATE fence_executions SET input_after = COALESCE(input_after, :checkpoint) WHERE "
    + _KEY
    + " AND submitted_at IS NOT NULL AND "
    + _HELD_HERE
    + " RETURNING input_after"
)
_OUTPUT = text(
    "UPDATE fence_executions SET output_type = :output_type, output = :output WHERE "
    + _KEY
    + " AND submitted_at IS NOT NULL AND "
    + _HELD_HERE
)
# What a run's state is read from (the lease, and its record when there is one).
_STATE_COLUMNS = (
    "SELECT l.tenant_id, l.execution_id, l.status, l.holder, l.epoch, l.reason, l.expires_at, "
    "e.graph, e.thread_id, e.submitted_at"
)
_STATE = text(
    _STATE_COLUMNS + ", e.output_type, e.output FROM fence_leases l LEFT JOIN fence_executions e "
    "ON e.tenant_id = l.tenant_id AND e.execution_id = l.execution_id "
    "WHERE l.tenant_id = :tenant_id AND l.execution_id = :execution_id"
)
# The in-flight runs, and the queued ones: of every tenant ("") or of ``:tenant_id``.
_OF_TENANT = ("", "l.tenant_id = :tenant_id AND ")
_RUNS = {
    of: text(
        _STATE_COLUMNS + " FROM fence_leases l JOIN fence_executions e "
        "ON e.tenant_id = l.tenant_id AND e.execution_id = l.execution_id "
        "WHERE " + of + in_flight_sql("l") + " ORDER BY l.updated_at, l.scope_key LIMIT :limit"
    )
    for of in _OF_TENANT
}


# Each submitted run's own row (records migration 6): its identity and outcome.
_RUN_KEY = "fence_runs.tenant_id = :tenant_id AND fence_runs.execution_id = :execution_id"
_OPEN_RUNS = text(
    "SELECT run_id, status, graph, input_type, input, run_type, run FROM fence_runs WHERE "
    + _RUN_KEY
    + " AND status IN ('current', 'queued') ORDER BY seq"
)
_ADD_RUN = text(
    "INSERT INTO fence_runs (run_id, tenant_id, execution_id, seq, status, graph, thread_id, "
    "input_type, input, run_type, run, submitted_at) SELECT :run_id, :tenant_id, "
    ":execution_id, COALESCE(MAX(seq), 0) + 1, :status, :graph, :thread_id, :input_type, "
    ":input, :run_type, :run, :at FROM fence_runs WHERE " + _RUN_KEY
)


def _of_lease(column: str) -> str:
    return (
        f"(SELECT l.{column} FROM fence_leases l WHERE l.tenant_id = fence_runs.tenant_id "
        "AND l.execution_id = fence_runs.execution_id)"
    )


def _of_record(column: str) -> str:
    return (
        f"(SELECT e.{column} FROM fence_executions e WHERE e.tenant_id = fence_runs.tenant_id "
        "AND e.execution_id = fence_runs.execution_id)"
    )


# The thread's current run ends as its execution did (lease status and reason, the output
# kept with the record), or as ``:status``/``:reason`` say (an interrupt): written before
# the next run of the thread replaces the record, in the same transaction.
_RUN_ENDS = text(
    f"UPDATE fence_runs SET status = COALESCE(:status, {_of_lease('status')}), "
    f"reason = COALESCE(:reason, {_of_lease('reason')}), epoch = {_of_lease('epoch')}, "
    f"output_type = {_of_record('output_type')}, output = {_of_record('output')} "
    f"WHERE {_RUN_KEY} AND status = 'current'"
)
_NEXT_QUEUED = text(
    "SELECT run_id, graph, thread_id, input_type, input, run_type, run FROM fence_runs WHERE "
    + _RUN_KEY
    + " AND status = 'queued' ORDER BY seq LIMIT 1"
)
_MAKE_CURRENT = text("UPDATE fence_runs SET status = 'current' WHERE run_id = :run_id")
# Threads with a queued run whose current run has ended (released: no holder; a yielded
# run keeps its holder and goes on): the next one may begin.
_PROMOTABLE = text(
    "SELECT DISTINCT r.tenant_id, r.execution_id FROM fence_runs r JOIN fence_leases l "
    "ON l.tenant_id = r.tenant_id AND l.execution_id = r.execution_id "
    "WHERE r.status = 'queued' AND l.status IN ("
    + ", ".join(f"'{status}'" for status in _BETWEEN_RUNS)
    + ") "
    "AND l.holder IS NULL LIMIT :limit"
)
# The runs queued behind their thread's run, oldest submit first.
_QUEUED_RUNS = {
    of: text(
        "SELECT r.tenant_id, r.execution_id, r.run_id, r.graph, r.thread_id, l.epoch "
        "FROM fence_runs r JOIN fence_leases l ON l.tenant_id = r.tenant_id "
        "AND l.execution_id = r.execution_id WHERE " + of + "r.status = 'queued' "
        "ORDER BY r.submitted_at, r.seq LIMIT :limit"
    )
    for of in _OF_TENANT
}
_RUN_STATUS = text("SELECT status FROM fence_runs WHERE run_id = :run_id")
_CANCEL_QUEUED = text(
    "UPDATE fence_runs SET status = 'cancelled', reason = :reason "
    "WHERE run_id = :run_id AND status = 'queued'"
)
_RUN_STATE = text(
    _STATE_COLUMNS
    + ", e.output_type, e.output, r.run_id, r.status AS run_status, r.reason AS run_reason, "
    "r.epoch AS run_epoch, r.graph AS run_graph, r.thread_id AS run_thread, "
    "r.output_type AS run_output_type, r.output AS run_output FROM fence_runs r "
    "JOIN fence_leases l ON l.tenant_id = r.tenant_id AND l.execution_id = r.execution_id "
    "LEFT JOIN fence_executions e ON e.tenant_id = r.tenant_id "
    "AND e.execution_id = r.execution_id "
    "WHERE r.run_id = :run_id AND r.tenant_id = :tenant_id AND r.execution_id = :execution_id"
)

# Whether submitted runs wait on the thread: a pending submitted run, or queued ones.
_WAITING = text(
    "SELECT l.status, e.submitted_at, EXISTS (SELECT 1 FROM fence_runs r WHERE "
    "r.tenant_id = l.tenant_id AND r.execution_id = l.execution_id AND r.status = 'queued') "
    "AS queued FROM fence_leases l LEFT JOIN fence_executions e ON e.tenant_id = l.tenant_id "
    "AND e.execution_id = l.execution_id "
    "WHERE l.tenant_id = :tenant_id AND l.execution_id = :execution_id"
)

_ANNOUNCE = text(
    "INSERT INTO fence_workers (instance_id, graphs, seen_at) VALUES (:instance_id, :graphs, "
    ":at) ON CONFLICT (instance_id) DO UPDATE SET graphs = excluded.graphs, "
    "seen_at = excluded.seen_at"
)
_RETIRE = text("DELETE FROM fence_workers WHERE instance_id = :instance_id")
_WORKERS = text("SELECT instance_id, graphs FROM fence_workers WHERE seen_at >= :since")
#: How often a serving instance says it is serving, and how long that holds (seconds).
ANNOUNCE_EVERY = 5.0
ANNOUNCED_FOR = 30.0


@dataclass(frozen=True, slots=True)
class RunState:
    """One execution as the queue sees it (``langgraph-fence runs``, :meth:`SubmittedRun.state`).

    Attributes:
        key: the execution.
        status: where its lease stands.
        holder: the worker running it, or ``None``.
        epoch: its lease's token.
        graph: the graph name it is recorded under (``None``: no record).
        thread_id: its thread (``None``: no record).
        submitted: whether it was submitted (not started by ``ainvoke``).
        reason: why it ended, when it did.
        expires_at: when the worker's hold ends (store clock), or ``None``.
        run_id: the submitted run's own id (``None``: the execution's run, whichever).
        queued: the run waits behind the thread's run (``on_busy="enqueue"``); its status
            is then ``pending``.
    """

    key: LeaseKey
    status: LeaseStatus
    holder: str | None
    epoch: int
    graph: str | None
    thread_id: str | None
    submitted: bool
    reason: str | None = None
    expires_at: float | None = None
    run_id: str | None = None
    queued: bool = False


class SubmittedRuns:
    """The run queue on the lease table's database: submit, pin, output, state, cancel.

    Args:
        engine: the engine of the lease table (and the execution records).
        serde: the serializer of the recorded inputs and the outputs (the records' one).
    """

    def __init__(self, store: SqlLeaseRepository, serde: SerializerProtocol) -> None:
        engine = store.engine
        self._store = store
        self._leases = _LeaseWrites(store.now_sql)
        self._engine = engine
        self._writer = single_statement(engine)
        self._pg = dialect_of(engine) == "postgresql"
        self.serde = serde
        #: The LISTEN side: one connection for every waiter of this queue (PostgreSQL).
        self.notifications = Notifications(engine) if self._pg else None
        # PostgreSQL: a batch of children and the wait's look run on the driver, in one
        # round trip each (compiled once).
        if self._pg:
            self._spawn_children = DriverStatement(self._leases.spawn_children, engine.dialect)
            self._child_ends = DriverStatement(_CHILD_ENDS["postgresql"], engine.dialect)

    # -- submit

    def check(
        self,
        graph_name: object,
        input: Any,
        config: Mapping[str, Any] | None,
        tenant_id: object,
        execution_id: object,
        on_busy: object,
        options: Mapping[str, Any],
    ) -> tuple[LeaseKey, str, RecordedRun]:
        """Every argument of a submit, checked before anything is written.

        Returns:
            the execution key, its thread id, and the recorded run config.

        Raises:
            ValueError: a bad argument, named with the fix (a non-serialisable input too).
            TypeError: ``config`` is not a mapping.
        """
        from langgraph_fence.lease.run_config import RECORDED_OPTIONS, record_run

        text_id("graph_name", graph_name, what="the name a worker serves the graph under")
        text_id(
            "tenant_id",
            tenant_id,
            what="the tenant the execution and its thread belong to",
            max_bytes=MAX_ID_BYTES,
        )
        if on_busy not in ON_BUSY:
            raise ValueError(
                f"on_busy must be one of {', '.join(map(repr, ON_BUSY))} (what a submit does "
                f"when the thread's run is pending or running), got {on_busy!r}"
            )
        if config is not None and not isinstance(config, Mapping):
            raise TypeError(f"config must be a dict (a RunnableConfig), got {config!r}")
        unknown = sorted(set(options) - set(RECORDED_OPTIONS))
        if unknown:
            raise ValueError(
                f"submit got unknown options {unknown}: it takes the options a run records "
                f"({', '.join(RECORDED_OPTIONS)})"
            )
        configurable = dict((config or {}).get("configurable") or {})
        thread_id = text_id(
            "config['configurable']['thread_id']",
            configurable.get("thread_id"),
            what="a submitted run is one thread, e.g. {'configurable': {'thread_id': 'order-42'}}",
            max_bytes=MAX_ID_BYTES,
        )
        given = configurable.get("tenant_id")
        if given is not None and given != tenant_id:
            raise ValueError(
                f"config['configurable']['tenant_id'] is {given!r} and tenant_id is "
                f"{tenant_id!r}: a run is of one tenant; pass the same tenant in both"
            )
        if execution_id is None:
            execution_id = thread_id
        text_id(
            "execution_id", execution_id, what="the lease's execution id", max_bytes=MAX_ID_BYTES
        )
        if input is None:
            raise ValueError(
                "input must be the graph's input: a submitted run starts from it (to resume "
                "a thread, use instance.ainvoke(graph, None, config, ...))"
            )
        self._check_storable(input)
        run = record_run(config or {}, options, serde=self.serde)
        return LeaseKey(str(tenant_id), str(execution_id)), thread_id, run

    def _check_storable(self, input: Any) -> None:
        from langgraph_fence.serde import loads_checked

        try:
            loads_checked(self.serde, self.serde.dumps_typed(input), what="the input")
        except Exception as exc:
            raise ValueError(
                f"input cannot be recorded with the execution ({type(exc).__name__}: {exc}): "
                "a worker in another process runs it from the record, so it must be storable "
                "data (str, numbers, lists, dicts, or types LANGGRAPH_STRICT_MSGPACK allows). "
                "Refused before anything was written"
            ) from exc

    async def submit(
        self,
        key: LeaseKey,
        graph_name: str,
        thread_id: str,
        input: Any,
        run: RecordedRun,
        on_busy: OnBusy,
    ) -> str | None:
        """Record the run (its own row, and the execution's record and pending lease when it
        runs next), in one transaction; the run's id.

        The same run submitted again while it is pending, running or queued returns that
        run's id and writes nothing (``None``: the execution's run in flight has no run
        row, e.g. it was submitted before runs had their own).

        Raises:
            ExecutionBusyError: the execution is busy with other input and ``on_busy`` is
                ``"reject"``; nothing written.
            ExecutionEndedError: the execution was dead-lettered; nothing written.
        """
        record = self._record(graph_name, thread_id, input, run)
        params = {"tenant_id": key.tenant_id, "execution_id": key.execution_id}
        at = time.time()
        run_id = uuid.uuid4().hex  # made once: a retried transaction adds the same run
        row = {**params, **record, "run_id": run_id, "at": at}

        async def once() -> str | None:
            async with transaction(self._engine) as conn:
                root = {"scope_key": key.scope_key, "parent_execution_id": None}
                created = await conn.execute(
                    self._leases.insert_pending, {**params, **root, **self._store.now_params()}
                )
                if created.first() is None:
                    lease = (await conn.execute(text(_LEASE + self._lock), params)).one()
                    if lease.status == LeaseStatus.DEAD_LETTERED.value:
                        raise _dead_lettered(key, lease.reason)
                    runs = list(await conn.execute(_OPEN_RUNS, params))
                    queued = [r for r in runs if r.status == "queued"]
                    current = next((r.run_id for r in runs if r.status == "current"), None)
                    in_flight = lease.status in _BUSY or is_yielded(lease.status, lease.holder)
                    if in_flight or queued:
                        same = tuple(record[k] for k in _SAME)
                        if in_flight and await self._recorded(conn, params) == same:
                            return current  # the same submit again: that run
                        for waiting in queued:
                            if _same_as(waiting) == same:
                                return str(waiting.run_id)
                        if on_busy == "reject":
                            raise _busy(key, lease.status, lease.holder, len(queued))
                        if on_busy == "enqueue":
                            await conn.execute(_ADD_RUN, {**row, "status": "queued"})
                            return run_id
                    if in_flight:  # interrupt
                        reason = f"interrupted by a submit of new input at {at:.3f}"
                        await conn.execute(
                            _RUN_ENDS, {**params, "status": "failed", "reason": reason}
                        )
                        interrupt = {**params, "epoch": lease.epoch, **self._store.now_params()}
                        await conn.execute(
                            self._leases.interrupt,
                            {**interrupt, "status": "pending", "reason": reason},
                        )
                    else:
                        # The thread's last run ended: it keeps its end, this one begins
                        # (before any queued one, for an interrupt).
                        await conn.execute(_RUN_ENDS, {**params, "status": None, "reason": None})
                        await self._repend(conn, params, lease.epoch)
                await conn.execute(_ADD_RUN, {**row, "status": "current"})
                if self._pg:
                    # Delivered on commit: a waiting serve() looks at once.
                    await conn.execute(
                        NOTIFY_SQL, {"channel": NOTIFY_CHANNEL, "payload": graph_name}
                    )
                await conn.execute(_SUBMIT_RECORD, {**params, **record, "at": at})
                return run_id

        return await retry_connection_errors(once, what="submit")

    async def promote(self, limit: int = 100) -> int:
        """Begin the next queued run of each thread whose current run has ended: the ended
        run keeps its outcome, the queued one becomes the execution's run (record and
        pending lease), in one transaction per thread; how many began. Any worker may do
        it, and two racing do it once (the lease row is locked, or SQLite serialises)."""

        async def threads() -> list[Any]:
            async with self._engine.connect() as conn:
                return list(await conn.execute(_PROMOTABLE, {"limit": limit}))

        began = 0
        for found in await retry_connection_errors(threads, what="queued runs"):
            key = LeaseKey(found.tenant_id, found.execution_id)
            if await retry_connection_errors(partial(self._promote, key), what="queued run"):
                began += 1
        return began

    async def _repend(self, conn: AsyncConnection, params: Mapping[str, str], epoch: int) -> None:
        """The execution's next run is pending at ``epoch`` (the claim takes the next)."""
        now = self._store.now_params()
        await conn.execute(self._leases.repend, {**params, "epoch": epoch, **now})

    async def _promote(self, key: LeaseKey) -> bool:
        params = {"tenant_id": key.tenant_id, "execution_id": key.execution_id}
        at = time.time()
        async with transaction(self._engine) as conn:
            lease = (await conn.execute(text(_LEASE + self._lock), params)).first()
            if lease is None or lease.status not in _BETWEEN_RUNS:
                return False
            if is_yielded(lease.status, lease.holder):
                return False  # its run goes on: it waits for its children
            queued = (await conn.execute(_NEXT_QUEUED, params)).first()
            if queued is None:
                return False
            await conn.execute(_RUN_ENDS, {**params, "status": None, "reason": None})
            await conn.execute(_MAKE_CURRENT, {"run_id": queued.run_id})
            record = {
                "graph": queued.graph,
                "thread_id": queued.thread_id,
                "input_type": queued.input_type,
                "input": queued.input,
                "run_type": queued.run_type,
                "run": queued.run,
            }
            await conn.execute(_SUBMIT_RECORD, {**params, **record, "at": at})
            await self._repend(conn, params, lease.epoch)
            return True

    def serialize_inputs(self, inputs: Mapping[str, Any]) -> list[tuple[str, bytes]]:
        """Each input of ``inputs`` (child key -> input) as it is recorded, checked storable
        (encoded once and read back, as :meth:`check` does), in the order given.

        Raises:
            ValueError: an input cannot be recorded (its key named); nothing was written.
        """
        from langgraph_fence.serde import loads_checked

        stored = []
        for key, input in inputs.items():
            try:
                typed = self.serde.dumps_typed(input)
                loads_checked(self.serde, typed, what="the input")
            except Exception as exc:
                raise ValueError(
                    f"the input of child {key!r} cannot be recorded with the execution "
                    f"({type(exc).__name__}: {exc}): a worker in another process runs it from "
                    "the record, so it must be storable data (str, numbers, lists, dicts, or "
                    "types LANGGRAPH_STRICT_MSGPACK allows). Refused before anything was written"
                ) from exc
            stored.append((typed[0], bytes(typed[1])))
        return stored

    async def submit_children(
        self,
        parent: Lease,
        graph_name: str,
        children: Sequence[tuple[LeaseKey, tuple[str, bytes]]],
    ) -> list[bool] | None:
        """Record children of ``parent`` (their keys, and their inputs as
        :meth:`serialize_inputs` gives them) as submitted runs of ``graph_name``, each
        pending, all at once and only while ``parent`` is held; whether each was written.

        One statement on PostgreSQL (it locks the parent's row, so a takeover of the parent
        waits for it), one ``BEGIN IMMEDIATE`` transaction of four statements on SQLite (up
        to 10 000 children; one more per 10 000), whatever the number of children. Each
        child's thread is its execution id; its recorded run config is empty (as
        ``{"configurable": {"thread_id": ...}}`` records).

        Returns:
            per child, in the order given: ``True`` recorded now, ``False`` its key existed
            already (an earlier run of the parent step spawned it: nothing written for it);
            or ``None``: ``parent`` is no longer held (taken over, or ended), nothing written.

        Raises:
            ValueError: two children of the same key.
        """
        from langgraph_fence.lease.run_config import record_run

        ids = [key.execution_id for key, _ in children]
        if len(set(ids)) != len(ids):
            raise ValueError("children spawned together must have distinct keys")
        if not children:
            return []
        tenant = children[0][0].tenant_id
        if any(key.tenant_id != tenant for key, _ in children):
            raise ValueError("children spawned together must be of one tenant (their parent's)")
        run_type, run_blob = self.serde.dumps_typed(
            record_run({}, {}, serde=self.serde).as_payload()
        )
        held = {
            "ptenant": parent.key.tenant_id,
            "pexecution": parent.key.execution_id,
            "holder": parent.holder,
            "epoch": parent.epoch,
        }
        common = {
            "tenant_id": tenant,
            "graph": graph_name,
            "run_type": run_type,
            "run": run_blob,
            "at": time.time(),
        }

        async def once_pg() -> set[str] | None:
            (row,) = await _on_driver(
                self._engine,
                self._spawn_children,
                {
                    **held,
                    **common,
                    **self._store.now_params(),
                    # As JSON (the inputs in hex): the same one parameter for any number,
                    # and no array type for the driver to look up on a new connection.
                    "children": json.dumps(
                        [
                            [key.execution_id, key.scope_key, input_type, blob.hex()]
                            for key, (input_type, blob) in children
                        ]
                    ),
                    "channel": NOTIFY_CHANNEL,
                },
            )
            if not row["held"]:
                return None
            return set(json.loads(row["created"] or "[]"))

        async def once_sqlite() -> set[str] | None:
            async with transaction(self._engine) as conn:
                # BEGIN IMMEDIATE serialises every writer: a takeover of the parent waits
                # for this transaction, so children are recorded only under its token.
                if (await conn.execute(text(_PARENT_HELD), held)).first() is None:
                    return None
                rows = json.dumps([[key.execution_id, key.scope_key] for key, _ in children])
                created = {
                    row.execution_id
                    for row in await conn.execute(
                        self._leases.spawn_leases,
                        {
                            "tenant_id": tenant,
                            "rows": rows,
                            "pexecution": parent.key.execution_id,
                            **self._store.now_params(),
                        },
                    )
                }
                new = [(key, typed) for key, typed in children if key.execution_id in created]
                step = _SQLITE_CHILDREN_PER_STATEMENT
                for start in range(0, len(new), step):
                    await _record_children_sqlite(conn, common, new[start : start + step])
                return created

        once = once_pg if self._pg else once_sqlite
        created = await retry_connection_errors(once, what="spawn children")
        if created is None:
            return None
        return [execution_id in created for execution_id in ids]

    async def child_ends(
        self, children: Collection[LeaseKey]
    ) -> dict[LeaseKey, tuple[RunState, tuple[Any, Any]] | None]:
        """Of ``children``, those that ended (done, an interrupt, failed, dead-lettered;
        not yielded) with their stored outputs, and those that are gone (``None``): ONE
        read, whatever their number. A child still pending, running or yielded is not in
        the answer."""
        params = {"keys": json.dumps([[key.tenant_id, key.execution_id] for key in children])}

        async def once() -> Sequence[Any]:
            if self._pg:
                return await _on_driver(self._engine, self._child_ends, params)
            # One statement, in autocommit: a read takes no write lock.
            async with self._writer.connect() as conn:
                rows = await conn.execute(_CHILD_ENDS["sqlite"], params)
                return [row._mapping for row in rows]

        ends: dict[LeaseKey, tuple[RunState, tuple[Any, Any]] | None] = {}
        for row in await retry_connection_errors(once, what="children's ends"):
            key = LeaseKey(row["tenant_id"], row["execution_id"])
            if row["status"] is None:
                ends[key] = None
                continue
            state = RunState(
                key,
                LeaseStatus(row["status"]),
                row["holder"],
                int(row["epoch"]),
                None,
                None,
                True,
                row["reason"],
            )
            ends[key] = (state, (row["output_type"], row["output"]))
        return ends

    def _record(
        self, graph_name: str, thread_id: str, input: Any, run: RecordedRun
    ) -> dict[str, Any]:
        """The record columns of a submitted run (its input and run config serialised)."""
        input_type, blob = self.serde.dumps_typed(input)
        run_type, run_blob = self.serde.dumps_typed(run.as_payload())
        return {
            "graph": graph_name,
            "thread_id": thread_id,
            "input_type": input_type,
            "input": blob,
            "run_type": run_type,
            "run": run_blob,
        }

    @property
    def _lock(self) -> str:
        # PostgreSQL: two submits of one key wait for each other; SQLite's BEGIN IMMEDIATE
        # serialises every writer already.
        return " FOR UPDATE" if self._pg else ""

    async def _recorded(self, conn: AsyncConnection, params: Mapping[str, str]) -> Any:
        row = (await conn.execute(_RECORDED, dict(params))).first()
        if row is None:
            return None
        return (row.graph, row.input_type, bytes(row.input), row.run_type, bytes(row.run or b""))

    async def refuse_beside_waiting(self, key: LeaseKey) -> None:
        """Refuse a start of the thread (``ainvoke`` with new input, ``None`` or a
        ``Command``) while submitted runs wait on it (one read).

        A submitted run that is pending (not claimed yet, or handed back) is the thread's
        run in flight, though no one holds its lease, and a queued one runs after it: a
        start would take that lease (or run between them), and the submitted input would
        never run (its ``result()`` would read another run's end).

        Raises:
            ExecutionBusyError: such runs wait; nothing was written.
        """

        async def once() -> Any:
            async with self._engine.connect() as conn:
                params = {"tenant_id": key.tenant_id, "execution_id": key.execution_id}
                return (await conn.execute(_WAITING, params)).first()

        row = await retry_connection_errors(once, what="submitted runs of the thread")
        if row is None:
            return
        pending = row.status == LeaseStatus.PENDING.value and row.submitted_at is not None
        if not pending and not row.queued:
            return
        what = "a submitted run waiting for a worker" if pending else "submitted runs queued"
        raise ExecutionBusyError(
            f"execution {key.scope_key!r} has {what}: the start is refused, nothing written. "
            "Wait for it (await instance.get_run(...).result()), or submit the new input "
            "with on_busy='enqueue' or on_busy='interrupt'",
            scope_key=key.scope_key,
            status=row.status,
        )

    # -- the claimer's side

    async def pin(self, lease: Lease, checkpoint_id: str | None) -> str | None:
        """For a submitted run just taken under ``lease``: the checkpoint its input follows
        (``""``: none), pinned to ``checkpoint_id`` by the first claimer; ``None`` for a
        run that was not submitted (or a lease no longer held). One guarded statement."""

        async def once() -> str | None:
            async with self._writer.begin() as conn:
                row = (
                    await conn.execute(
                        _PIN,
                        {
                            "tenant_id": lease.key.tenant_id,
                            "execution_id": lease.key.execution_id,
                            "holder": lease.holder,
                            "epoch": lease.epoch,
                            "checkpoint": checkpoint_id or "",
                        },
                    )
                ).first()
                return None if row is None else str(row.input_after)

        return await retry_connection_errors(once, what="submitted run pin")

    async def store_output(self, handle: RunHandle, output: Any) -> None:
        """Keep ``output`` with the execution, guarded by the run's hold (one statement).

        Raises:
            ExecutionFencedError: the run was taken over, cancelled or interrupted: its
                output is refused as any stale write.
            ValueError: the output cannot be stored (the run then ends ``failed``).
        """
        try:
            output_type, blob = self.serde.dumps_typed(output)
        except Exception as exc:
            raise ValueError(
                f"the output of execution {handle.scope_key!r} cannot be stored "
                f"({type(exc).__name__}: {exc})"
            ) from exc
        lease = handle.lease

        async def once() -> int:
            async with self._writer.begin() as conn:
                result = await conn.execute(
                    _OUTPUT,
                    {
                        "tenant_id": lease.key.tenant_id,
                        "execution_id": lease.key.execution_id,
                        "holder": lease.holder,
                        "epoch": lease.epoch,
                        "output_type": output_type,
                        "output": blob,
                    },
                )
                return int(result.rowcount)

        if not await retry_connection_errors(once, what="submitted run output"):
            await handle.renew()  # raises the fencing error the refusal means
            raise RuntimeError(f"the output of {handle.scope_key!r} was refused")

    # -- any process's side

    async def state(self, key: LeaseKey, run_id: str | None = None) -> tuple[RunState, Any] | None:
        """The state and stored output (``None`` for none) of the execution's run, or of
        its submitted run ``run_id``; ``None`` when there is no such execution or run.
        One read: a run that ended is read with its own outcome, never the next run's."""

        async def once() -> Any:
            async with self._engine.connect() as conn:
                params = {"tenant_id": key.tenant_id, "execution_id": key.execution_id}
                if run_id is None:
                    return (await conn.execute(_STATE, params)).first()
                return (await conn.execute(_RUN_STATE, {**params, "run_id": run_id})).first()

        row = await retry_connection_errors(once, what="submitted run state")
        if row is None:
            return None
        state = _run_state(row)
        if run_id is None or row.run_status == "current":
            return replace(state, run_id=run_id), (row.output_type, row.output)
        if row.run_status == "queued":
            if state.status is LeaseStatus.DEAD_LETTERED:
                # It cannot begin until the thread is resolved (`langgraph-fence resolve`).
                reason = (
                    "it is queued behind the thread's run, which was dead-lettered "
                    f"({state.reason or 'no reason recorded'}); it has not run"
                )
                return replace(state, run_id=run_id, queued=True, reason=reason), (None, None)
            waiting = replace(
                state,
                status=LeaseStatus.PENDING,
                holder=None,
                reason=None,
                expires_at=None,
                graph=row.run_graph,
                thread_id=row.run_thread,
                run_id=run_id,
                queued=True,
            )
            return waiting, (None, None)
        ended = replace(
            state,
            status=LeaseStatus(row.run_status),
            holder=None,
            epoch=int(row.run_epoch or 0),
            graph=row.run_graph,
            thread_id=row.run_thread,
            reason=row.run_reason,
            expires_at=None,
            run_id=run_id,
        )
        return ended, (row.run_output_type, row.run_output)

    def decode_output(
        self, key: LeaseKey, stored: tuple[Any, Any], allow: Collection[tuple[str, ...]]
    ) -> Any:
        """The output :meth:`store_output` kept, decoded with the serializer (and ``allow``)."""
        from langgraph_fence.serde import loads_checked, with_allowlist

        output_type, blob = stored
        if output_type is None:
            return None
        serde = with_allowlist(self.serde, allow)
        return loads_checked(
            serde, (output_type, bytes(blob)), what=f"the output of execution {key.scope_key!r}"
        )

    async def cancel(self, key: LeaseKey, reason: str, run_id: str | None = None) -> bool:
        """End the execution ``cancelled`` with ``reason`` if it is pending or running;
        whether it was. With ``run_id``: that submitted run only (a queued one never begins,
        and ends ``cancelled``; the current one as the execution; one that ended:
        ``False``). A running one is fenced (its epoch moves on): its next write, renewal or
        release is refused and it drains. Its ``ANY_INSTANCE`` children that no worker has
        claimed yet end ``cancelled`` with it, in the same transaction (they never start);
        children already running run to their end (:mod:`langgraph_fence.execution.children`). A
        cancelled execution is resumed from its last checkpoint by a new run of its thread
        or by ``langgraph-fence resolve --retry``."""
        params = {
            "tenant_id": key.tenant_id,
            "execution_id": key.execution_id,
            "status": LeaseStatus.CANCELLED.value,
            "reason": reason,
        }
        # Exactly its own children: the rows that record it as their parent.
        children = {
            "tenant_id": key.tenant_id,
            "parent_execution_id": key.execution_id,
            "reason": f"its parent {key.scope_key!r} was cancelled before it started",
        }

        async def once() -> bool:
            async with transaction(self._engine) as conn:
                if run_id is not None:
                    # The lease row first (as a promotion locks it): no deadlock with one.
                    lock = {"tenant_id": key.tenant_id, "execution_id": key.execution_id}
                    await conn.execute(text(_LEASE + self._lock), lock)
                    status = (await conn.execute(_RUN_STATUS, {"run_id": run_id})).scalar()
                    if status == "queued":
                        queued = {"run_id": run_id, "reason": reason}
                        return bool((await conn.execute(_CANCEL_QUEUED, queued)).rowcount)
                    if status != "current":
                        return False  # it ended already
                now = self._store.now_params()
                cancel = self._leases.cancel
                cancelled = (await conn.execute(cancel, {**params, **now})).first() is not None
                if cancelled:
                    await conn.execute(self._leases.cancel_children, {**children, **now})
                    if self._pg:  # delivered on commit: its result() returns at once
                        ended = {"channel": ENDS_CHANNEL, "payload": key.scope_key}
                        await conn.execute(NOTIFY_SQL, ended)
                return cancelled

        return await retry_connection_errors(once, what="cancel")

    async def wake_yielded(self, parent: LeaseKey, ttl: float) -> bool:
        """Make ``parent`` pending (runnable by any instance's ``serve()`` ``ttl`` seconds
        from now on, store clock) if it is yielded and none of its children is still
        pending, running or yielded itself; whether it was. Serving instances are woken
        (PostgreSQL NOTIFY), so a waiter that died never strands its tree."""
        params = {"tenant_id": parent.tenant_id, "execution_id": parent.execution_id, "ttl": ttl}

        async def once() -> bool:
            async with transaction(self._engine) as conn:
                now = self._store.now_params()
                woken = (await conn.execute(self._leases.wake, {**params, **now})).first()
                if woken is not None and self._pg:
                    runnable = {"channel": NOTIFY_CHANNEL, "payload": ""}
                    await conn.execute(NOTIFY_SQL, runnable)
                return woken is not None

        return await retry_connection_errors(once, what="wake a yielded tree")

    async def wake_all_yielded(self, ttl: float) -> int:
        """Wake every yielded tree none of whose children is still pending, running or
        yielded (runnable by any ``serve()`` ``ttl`` seconds from now, store clock); how
        many. One statement, made by each look of ``serve()``: a tree whose last child
        ended without waking it (dead-lettered by a take, ended by an operator, a wake
        lost to an outage) is not stranded, whether its waiter lives or died."""

        async def once() -> int:
            async with transaction(self._engine) as conn:
                now = self._store.now_params()
                woken = len(list(await conn.execute(self._leases.wake_all, {"ttl": ttl, **now})))
                if woken and self._pg:
                    await conn.execute(NOTIFY_SQL, {"channel": NOTIFY_CHANNEL, "payload": ""})
                return woken

        return await retry_connection_errors(once, what="wake yielded trees")

    async def runs(self, limit: int = 1000) -> list[RunState]:
        """Every pending, running and yielded execution (with its worker), oldest first."""
        return await list_runs(self._engine, limit)

    @asynccontextmanager
    async def wakeups(self, wake: asyncio.Event) -> AsyncIterator[bool]:
        """Set ``wake`` whenever an execution becomes runnable (a submit, a child recorded,
        a run handed back), while the block runs; yields whether it will (PostgreSQL:
        LISTEN on :data:`~langgraph_fence.queue.notifications.NOTIFY_CHANNEL`, re-opened if the
        database drops it; SQLite, or a database that cannot be listened to: never, and the
        caller polls)."""
        if self.notifications is None:
            yield False
            return
        async with self.notifications.subscribe(NOTIFY_CHANNEL, wake) as listening:
            yield listening

    async def notify(self, channel: str, payload: str) -> None:
        """Say on ``channel`` (PostgreSQL; nothing elsewhere) what changed: one statement,
        off the hot paths (a hand-back, a submitted run's end). Never raises: a waiter that
        misses it finds the change by polling."""
        if not self._pg:
            return
        try:
            async with self._writer.begin() as conn:
                await conn.execute(NOTIFY_SQL, {"channel": channel, "payload": payload})
        except Exception as exc:
            logger.info("NOTIFY %s failed (%s): waiters poll", channel, exc)

    # -- who serves what

    async def announce(self, instance_id: str, graphs: Collection[str]) -> None:
        """Say that ``instance_id`` serves ``graphs`` now (one upsert)."""
        async with self._writer.begin() as conn:
            params = {"instance_id": instance_id, "graphs": json.dumps(sorted(graphs))}
            await conn.execute(_ANNOUNCE, {**params, "at": time.time()})

    async def retire(self, instance_id: str) -> None:
        """Say that ``instance_id`` serves nothing any more (it stopped)."""
        async with self._writer.begin() as conn:
            await conn.execute(_RETIRE, {"instance_id": instance_id})

    async def served(self) -> dict[str, list[str]]:
        """Graph name -> the workers that said they serve it within :data:`ANNOUNCED_FOR`."""
        return await served_graphs(self._engine)


async def _on_driver(
    engine: AsyncEngine, statement: DriverStatement, params: Mapping[str, Any]
) -> Sequence[Any]:
    """Run ``statement`` on an asyncpg connection of ``engine`` (autocommit: one statement
    is its own transaction) in one round trip; its rows. A connection the call was
    interrupted on is discarded (its state is unknown: :mod:`langgraph_fence.database.driver`)."""
    async with engine.connect() as conn:
        driver = (await conn.get_raw_connection()).driver_connection
        try:
            return await fetch(driver, statement, params)
        except BaseException as exc:
            if isinstance(exc, asyncio.CancelledError):
                await discard(conn)
            elif is_connection_error(exc):
                await discard(conn, server_lost=True)
            raise


async def _record_children_sqlite(
    conn: AsyncConnection,
    common: Mapping[str, Any],
    children: Sequence[tuple[LeaseKey, tuple[str, bytes]]],
) -> None:
    """The records of ``children`` on SQLite, in one statement: a row of three positional
    parameters each (id, input type, input), since SQLite's JSON cannot carry a blob."""
    if not children:
        return
    values = ", ".join(["(?, ?, ?)"] * len(children))
    statement = (
        _RECORD_INTO + "SELECT ?, v.column1, ?, v.column1, v.column2, v.column3, ?, ?, ?, ?, "
        f"NULL, NULL, NULL FROM (VALUES {values}) AS v WHERE true" + _RECORD_UPSERT
    )
    params: list[Any] = [
        common["tenant_id"],
        common["graph"],
        common["run_type"],
        common["run"],
        common["at"],
        common["at"],
    ]
    for key, (input_type, blob) in children:
        params.extend((key.execution_id, input_type, blob))
    await conn.exec_driver_sql(statement, tuple(params))


async def list_runs(
    engine: AsyncEngine, limit: int = 1000, *, tenant_id: str | None = None
) -> list[RunState]:
    """Every pending, running and yielded execution on ``engine``'s database that has a
    record (with its worker), oldest first; then the submitted runs queued behind them
    (``queued``, status ``pending``), oldest submit first (up to ``limit`` of each). With
    ``tenant_id``, that tenant's only: no other tenant's id, graph or thread is read."""
    of = _OF_TENANT[tenant_id is not None]
    params: dict[str, Any] = {"limit": limit}
    if tenant_id is not None:
        params["tenant_id"] = tenant_id

    async def once() -> tuple[list[Any], list[Any]]:
        async with engine.connect() as conn:
            in_flight = list(await conn.execute(_RUNS[of], params))
            return in_flight, list(await conn.execute(_QUEUED_RUNS[of], params))

    rows, queued = await retry_connection_errors(once, what="runs")
    waiting = [
        RunState(
            LeaseKey(row.tenant_id, row.execution_id),
            LeaseStatus.PENDING,
            None,
            int(row.epoch),
            row.graph,
            row.thread_id,
            True,
            run_id=row.run_id,
            queued=True,
        )
        for row in queued
    ]
    return [_run_state(row) for row in rows] + waiting


async def served_graphs(engine: AsyncEngine) -> dict[str, list[str]]:
    """Graph name -> the workers that said they serve it within :data:`ANNOUNCED_FOR`."""
    async with engine.connect() as conn:
        rows = list(await conn.execute(_WORKERS, {"since": time.time() - ANNOUNCED_FOR}))
    served: dict[str, list[str]] = {}
    for row in rows:
        for graph in json.loads(row.graphs):
            served.setdefault(graph, []).append(row.instance_id)
    return served


class SubmittedRun:
    """A handle on a submitted run, from the process that submitted it or any other
    (:meth:`Instance.get_run <langgraph_fence.Instance.get_run>`).

    A handle with a ``run_id`` follows that one submit: its state and output are its own,
    even after later runs of the thread (``on_busy="enqueue"``) began. Without one, it
    follows the execution's run, whichever is the latest.

    Attributes:
        key: the execution.
        run_id: the submitted run's id, or ``None``.
    """

    def __init__(self, queue: SubmittedRuns, key: LeaseKey, run_id: str | None = None) -> None:
        self._queue = queue
        self.key = key
        self.run_id = run_id

    def __repr__(self) -> str:
        return f"SubmittedRun({self.key.scope_key!r}, run_id={self.run_id!r})"

    @property
    def scope_key(self) -> str:
        """The execution's scope key."""
        return self.key.scope_key

    async def state(self) -> RunState:
        """Where the run stands now (one read).

        Raises:
            KeyError: no execution of that key exists.
        """
        found = await self._queue.state(self.key, self.run_id)
        if found is None:
            raise KeyError(f"no execution {self.key.scope_key!r}: nothing was submitted under it")
        return found[0]

    async def result(
        self,
        timeout: float | None = None,  # noqa: ASYNC109 - the API is result(timeout=...)
        *,
        poll_interval: float = 0.05,
        allow: Collection[tuple[str, ...]] = (),
    ) -> Any:
        """Wait for the run's end and return its output (what ``graph.ainvoke`` returned).

        A run that reached an interrupt ends ``waiting``: its output is the state with
        ``__interrupt__``, as ``ainvoke`` returns it.

        Args:
            timeout: seconds to wait (``None``: as long as it takes).
            poll_interval: the longest pause between looks (they start faster). On
                PostgreSQL the run's end wakes the wait at once (LISTEN on
                :data:`~langgraph_fence.queue.notifications.ENDS_CHANNEL`), and it looks every
                ``poll_interval`` (at least a second) only in case that notification was
                lost.
            allow: ``(module, name)`` pairs the output may construct besides what the
                serializer allows (your state types).

        Raises:
            RunFailedError: the run ended ``failed`` (its error, or cancelled) or
                ``dead_lettered``; the message names the execution, its end and why.
            TimeoutError: it had not ended within ``timeout``.
            KeyError: no execution of that key exists.
        """
        if timeout is not None:
            timeout = positive_seconds("timeout", timeout, what="how long result() waits")
        pause = positive_seconds("poll_interval", poll_interval, what="between looks")
        loop = asyncio.get_running_loop()
        deadline = None if timeout is None else loop.time() + timeout
        wait = min(0.005, pause)
        ended = asyncio.Event()
        notifications = self._queue.notifications
        # Subscribed before the first look: an end after it is not missed.
        async with (
            notifications.subscribe(ENDS_CHANNEL, ended, self.key.scope_key)
            if notifications is not None
            else nullcontext(False)
        ) as listening:
            while True:
                ended.clear()
                found = await self._queue.state(self.key, self.run_id)
                if found is None:
                    raise KeyError(f"no execution {self.key.scope_key!r}: nothing was submitted")
                state, stored = found
                # A yielded run (waiting for its children, holder kept) has not ended.
                if state.status.value in _ENDED and not is_yielded(state.status, state.holder):
                    return self._end(state, stored, allow)
                if deadline is not None and loop.time() >= deadline:
                    raise TimeoutError(
                        f"execution {self.key.scope_key!r} had not ended after {timeout:g} s "
                        f"(it is {state.status.value}, held by {state.holder or 'no worker'} "
                        f"at token {state.epoch}): is a worker serving graph {state.graph!r}? "
                        "See `langgraph-fence runs`"
                    )
                left = pause if deadline is None else max(0.0, deadline - loop.time())
                if listening:
                    # Woken by the run's end; a look every poll_interval (at least a
                    # second) in case that notification was lost.
                    with contextlib.suppress(TimeoutError):
                        await asyncio.wait_for(ended.wait(), min(max(pause, 1.0), left))
                else:
                    await asyncio.sleep(min(wait, left))
                    wait = min(wait * 2, pause)

    def _end(self, state: RunState, stored: tuple[Any, Any], allow: Collection[Any]) -> Any:
        if state.status in (LeaseStatus.DONE, LeaseStatus.WAITING):
            return self._queue.decode_output(self.key, stored, allow)
        raise RunFailedError(
            f"execution {self.key.scope_key!r} (graph {state.graph!r}, thread "
            f"{state.thread_id!r}) ended {state.status.value} at token {state.epoch}: "
            f"{state.reason or 'no reason recorded'}",
            scope_key=self.key.scope_key,
            status=state.status.value,
            reason=state.reason,
        )

    async def cancel(self) -> bool:
        """Cancel the run on purpose: a pending or queued one never starts, a running one is
        fenced (its next write is refused and it drains); it ends ``cancelled``, a state of
        its own that no worker takes over. Whether it was still pending, running or queued.

        A cancelled run resumes from its last checkpoint when its thread is run again, or
        with ``langgraph-fence resolve --retry`` (refused, like every resume, while a
        non-idempotent write it stamped may have happened: guarantee 3 stands).

        A run stopped by its process (Ctrl-C, SIGTERM, a cancelled task) is not cancelled:
        it is handed back for any worker to take over."""
        return await self._queue.cancel(self.key, "cancelled by SubmittedRun.cancel()", self.run_id)


def _run_state(row: Any) -> RunState:
    """A row of :data:`_STATE_COLUMNS` as a :class:`RunState`."""
    return RunState(
        LeaseKey(row.tenant_id, row.execution_id),
        LeaseStatus(row.status),
        row.holder,
        int(row.epoch),
        row.graph,
        row.thread_id,
        row.submitted_at is not None,
        row.reason,
        row.expires_at,
    )


def _busy(key: LeaseKey, status: str, holder: str | None, queued: int) -> ExecutionBusyError:
    who = f"running on {holder}" if status == "running" and holder else status
    if queued:
        who += f" with {queued} run(s) queued behind"
    return ExecutionBusyError(
        f"execution {key.scope_key!r} is {who}, with other input: refused (on_busy='reject'), "
        "nothing written. Wait for it (await instance.get_run(...).result()), submit with "
        "on_busy='enqueue' to run the new input after it, or with on_busy='interrupt' to "
        "fence it and run the new input next",
        scope_key=key.scope_key,
        status=status,
    )


def _same_as(row: Any) -> tuple[Any, ...]:
    """A run row's columns as :data:`_SAME` compares them."""
    return (row.graph, row.input_type, bytes(row.input), row.run_type, bytes(row.run))


def _dead_lettered(key: LeaseKey, reason: str | None) -> ExecutionEndedError:
    extra = f" ({reason})" if reason else ""
    return ExecutionEndedError(
        f"execution {key.scope_key!r} was dead-lettered{extra}: nothing was submitted. Inspect "
        "it with `langgraph-fence dead-letters`; `langgraph-fence resolve` decides it",
        status=LeaseStatus.DEAD_LETTERED.value,
        reason=reason,
    )

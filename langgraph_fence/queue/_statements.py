"""The run queue's SQL: the lease rows it writes, the execution records, each submitted
run's own row (``fence_runs``), and the serving workers (``fence_workers``).

Plain SQL text, the same for SQLite and PostgreSQL except where a statement names its
dialect. The lease writes are stamped with the lease store's clock (:class:`LeaseWrites`),
as every other lease write is; a run's rows are keyed by ``:tenant_id`` and
``:execution_id``, or by ``:run_id``.
"""

from __future__ import annotations

from sqlalchemy import text

from langgraph_fence.database import Dialect
from langgraph_fence.lease import LeaseStatus
from langgraph_fence.lease.guard import guard_sql
from langgraph_fence.lease.schema import STAMP_SQL, in_flight_sql, yielded_sql
from langgraph_fence.lease.timeline import ledger_ok_sql, next_token_sql
from langgraph_fence.queue.notifications import OF_SCHEMA

#: Lease statuses after which a thread's next queued run may begin.
BETWEEN_RUNS = ("done", "waiting", "failed", "cancelled")
KEY = "tenant_id = :tenant_id AND execution_id = :execution_id"
_HELD = guard_sql(
    tenant_id="l.tenant_id", execution_id="l.execution_id", holder=":holder", epoch=":epoch"
)
_HELD_HERE = (
    "EXISTS (SELECT 1 FROM fence_leases l WHERE l.tenant_id = fence_executions.tenant_id "
    f"AND l.execution_id = fence_executions.execution_id AND {_HELD})"
)
LEASE = "SELECT status, holder, epoch, reason FROM fence_leases WHERE " + KEY


# A child of the parent (by the parent its row records, never by the shape of its id)
# still pending, running, or yielded itself.
_LIVE = in_flight_sql("c")
_LIVE_CHILD = (
    "SELECT 1 FROM fence_leases c WHERE c.tenant_id = :tenant_id "
    "AND c.parent_execution_id = :execution_id AND " + _LIVE
)


class LeaseWrites:
    """The queue's writes of lease rows, stamped with the lease store's clock (its
    ``now_sql``: ``now()`` on PostgreSQL, or the store's injected clock), as every other
    lease write is; never the submitting process's clock."""

    def __init__(self, now: str, dialect: Dialect, *, quarantine: bool = False) -> None:
        next_epoch = next_token_sql(dialect, "epoch")
        # Under quarantine a parent spawns nothing while a failover is unclassified: it is
        # the old primary's work, to be classified, and children inserted while the
        # classification runs would not be seen by it (lease.timeline).
        classified = f" AND {ledger_ok_sql(dialect)}" if quarantine else ""
        # A new key: pending at epoch 0 with no holder (the first claim takes the next
        # token); a child's row records its parent (:parent_execution_id, of the same
        # tenant).
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
            f"reason = NULL, updated_at = {now} WHERE " + KEY + " AND epoch = :epoch"
        )
        # The run in flight is fenced: its epoch moves on, so none of its writes lands again.
        fence = (
            f"UPDATE fence_leases SET epoch = {next_epoch}, holder = NULL, expires_at = NULL, "
            f"status = :status, reason = :reason, updated_at = {now} WHERE " + KEY
        )
        self.interrupt = text(fence + " AND epoch = :epoch")
        # The first claimer pins the checkpoint the input follows, and when the run started
        # (store clock: what a flow key's rate limit counts); every later taker reads it back.
        self.pin = text(
            "UPDATE fence_executions SET input_after = COALESCE(input_after, :checkpoint), "
            f"started_at = COALESCE(started_at, {now}) WHERE "
            + KEY
            + " AND submitted_at IS NOT NULL AND "
            + _HELD_HERE
            + " RETURNING input_after"
        )
        # ...and the start on the run's own row (what a flow key's rate limit counts),
        # after a pin that landed, in its transaction.
        # With whether the run has callbacks to tell (none: its end arms nothing).
        started = (
            f"UPDATE fence_runs SET started_at = COALESCE(started_at, {now}) WHERE "
            + _RUN_KEY
            + " AND status = 'current'{also} RETURNING run_id, stream_modes, EXISTS (SELECT 1 "
            "FROM fence_callbacks c WHERE c.run_id = fence_runs.run_id) AS told"
        )
        self.run_started = text(started.format(also=""))
        # On PostgreSQL both in ONE statement (one round trip, not a transaction of four):
        # the run's start written only after a pin that landed; a pin with no run row
        # (submitted before runs had rows) still answers.
        # The pin reads back the execution's record too (its input only where the run
        # begins from it: the checkpoint pinned is the one the taker found), so its taker
        # needs no read of its own.
        self.pin_started = (
            text(
                f"WITH pinned AS ({self.pin.text}, graph, thread_id, input_type, "
                "CASE WHEN input_after = :checkpoint THEN input END AS input, run_type, run"
                "), started AS ("
                + started.format(also=" AND EXISTS (SELECT 1 FROM pinned)")
                + ") SELECT pinned.input_after, pinned.graph, pinned.thread_id, "
                "pinned.input_type, pinned.input, pinned.run_type, pinned.run, "
                "started.run_id, started.stream_modes, started.told "
                "FROM pinned LEFT JOIN started ON TRUE"
            )
            if dialect == "postgresql"
            else None
        )
        # A step's durable sleep, recorded under the run's hold: it ends at :at, or :delay
        # seconds from now; a sleep found recorded keeps its end. Then read back, with now.
        self.record_sleep = text(
            "INSERT INTO fence_sleeps (tenant_id, execution_id, sleep_key, wake_at) SELECT "
            ":tenant_id, :execution_id, :sleep_key, COALESCE(CAST(:at AS DOUBLE PRECISION), "
            f"{now} + CAST(:delay AS DOUBLE PRECISION)) WHERE EXISTS (SELECT 1 FROM "
            "fence_leases l WHERE l.tenant_id = :tenant_id AND l.execution_id = :execution_id "
            f"AND {_HELD}) "
            "ON CONFLICT (tenant_id, execution_id, sleep_key) DO NOTHING"
        )
        self.read_sleep = text(
            f"SELECT wake_at, {now} AS now FROM fence_sleeps WHERE {KEY} AND sleep_key = :sleep_key"
        )
        # The run that sleeps, or fails and is retried, gives its lease back: pending, no
        # holder, for any worker to take from :wake_at (store clock), or :delay seconds from
        # now, on, at the next token; guarded by its hold.
        self.release_sleeping = text(
            "UPDATE fence_leases SET status = 'pending', holder = NULL, expires_at = "
            f"COALESCE(CAST(:wake_at AS DOUBLE PRECISION), {now} + CAST(:delay AS DOUBLE "
            f"PRECISION)), reason = :reason, updated_at = {now} WHERE "
            + guard_sql(
                tenant_id=":tenant_id",
                execution_id=":execution_id",
                holder=":holder",
                epoch=":epoch",
            )
        )
        # A failed run handed back for another attempt: as a sleep's release, and refused
        # while a non-idempotent stamp stands. The stamp may land after the run's settle read
        # the row (its step's write was in flight when LangGraph cancelled the step); a
        # retry would then be dead-lettered at its take, so the run ends failed instead.
        self.release_for_retry = text(
            str(self.release_sleeping.text) + f" AND NOT {STAMP_SQL[dialect]['non_idempotent']}"
        )
        # A pending run with no holder starts no earlier than :not_before (store clock): a
        # take passes over a pending row whose expires_at is ahead (submit(not_before=...)).
        self.hold_until = text(
            "UPDATE fence_leases SET expires_at = :not_before WHERE " + KEY + " AND "
            "status = 'pending' AND holder IS NULL"
        )
        # Pending, running, or yielded (waiting with its holder kept: its run goes on).
        self.cancel = text(fence + " AND " + in_flight_sql() + " RETURNING epoch")
        # A parent's children that no worker claimed yet (pending, no holder) never start.
        self.cancel_children = text(
            f"UPDATE fence_leases SET epoch = {next_epoch}, status = 'cancelled', "
            "reason = :reason, "
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
            woken + KEY + " AND " + yielded_sql() + " AND NOT EXISTS (" + _LIVE_CHILD + ") "
            "RETURNING epoch"
        )
        # Children spawned together, each new key a pending lease at epoch 0 (a key found
        # is left as it is), only while the parent's row passes the guard.
        pending = f"0, NULL, NULL, 'pending', '{{}}', NULL, {now}, 0, NULL"
        # PostgreSQL: the parent's row locked, the leases, the records and the NOTIFY (on
        # commit), in ONE statement; the spawned keys come back.
        self.spawn_children = text(
            "WITH parent AS (" + PARENT_HELD + classified + " FOR UPDATE), "
            "spawned AS (SELECT s.value ->> 0 AS execution_id, s.value ->> 1 AS scope_key, "
            "s.value ->> 2 AS input_type, decode(s.value ->> 3, 'hex') AS input FROM "
            "jsonb_array_elements(CAST(:children AS jsonb)) AS s(value)), "
            "created AS (" + _CHILD_LEASE + "SELECT :tenant_id, s.execution_id, s.scope_key, "
            f"{pending}, :pexecution FROM parent, spawned s "
            "ON CONFLICT (tenant_id, execution_id) DO NOTHING "
            "RETURNING execution_id), "
            "recorded AS (" + RECORD_INTO + "SELECT :tenant_id, s.execution_id, :graph, "
            "s.execution_id, s.input_type, s.input, :run_type, :run, :at, :at, NULL, NULL, NULL "
            "FROM created JOIN spawned s USING (execution_id)" + RECORD_UPSERT + ") "
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


RECORDED = text("SELECT graph, input_type, input, run_type, run FROM fence_executions WHERE " + KEY)
RECORD_INTO = (
    "INSERT INTO fence_executions (tenant_id, execution_id, graph, thread_id, input_type, "
    "input, run_type, run, recorded_at, submitted_at, input_after, output_type, output) "
)
RECORD_UPSERT = (
    " ON CONFLICT (tenant_id, execution_id) DO UPDATE SET "
    "graph = excluded.graph, thread_id = excluded.thread_id, input_type = excluded.input_type, "
    "input = excluded.input, run_type = excluded.run_type, run = excluded.run, "
    "recorded_at = excluded.recorded_at, submitted_at = excluded.submitted_at, "
    "input_after = NULL, output_type = NULL, output = NULL, started_at = NULL"
)
SUBMIT_RECORD = text(
    RECORD_INTO
    + "VALUES (:tenant_id, :execution_id, :graph, :thread_id, :input_type, :input, :run_type, "
    ":run, :at, :at, NULL, NULL, NULL)" + RECORD_UPSERT
)
# A child is recorded only under its parent's hold (the lease guard on the parent's row).
PARENT_HELD = "SELECT 1 FROM fence_leases WHERE " + guard_sql(
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
SQLITE_CHILDREN_PER_STATEMENT = 10_000
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
CHILD_ENDS = {
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
OUTPUT = text(
    "UPDATE fence_executions SET output_type = :output_type, output = :output WHERE "
    + KEY
    + " AND submitted_at IS NOT NULL AND "
    + _HELD_HERE
)
#: The same, a row per row written (the driver tells no row count).
OUTPUT_RETURNING = text(OUTPUT.text + " RETURNING 1")
# What a run's state is read from (the lease, and its record when there is one).
_STATE_COLUMNS = (
    "SELECT l.tenant_id, l.execution_id, l.status, l.holder, l.epoch, l.reason, l.expires_at, "
    "e.graph, e.thread_id, e.submitted_at"
)
STATE = text(
    _STATE_COLUMNS + ", e.output_type, e.output, r.attempts AS run_attempts FROM fence_leases l "
    "LEFT JOIN fence_executions e ON e.tenant_id = l.tenant_id AND e.execution_id = "
    "l.execution_id LEFT JOIN fence_runs r ON r.tenant_id = l.tenant_id AND r.execution_id = "
    "l.execution_id AND r.status = 'current' "
    "WHERE l.tenant_id = :tenant_id AND l.execution_id = :execution_id"
)
# The in-flight runs, and the queued ones: of every tenant ("") or of ``:tenant_id``.
OF_TENANT = ("", "l.tenant_id = :tenant_id AND ")
RUNS = {
    of: text(
        _STATE_COLUMNS + " FROM fence_leases l JOIN fence_executions e "
        "ON e.tenant_id = l.tenant_id AND e.execution_id = l.execution_id "
        "WHERE " + of + in_flight_sql("l") + " ORDER BY l.updated_at, l.scope_key LIMIT :limit"
    )
    for of in OF_TENANT
}


# Each submitted run's own row (records migration 6): its identity and outcome.
_RUN_KEY = "fence_runs.tenant_id = :tenant_id AND fence_runs.execution_id = :execution_id"
OPEN_RUNS = text(
    "SELECT run_id, status, graph, input_type, input, run_type, run FROM fence_runs WHERE "
    + _RUN_KEY
    + " AND status IN ('current', 'queued') ORDER BY seq"
)
ADD_RUN = text(
    "INSERT INTO fence_runs (run_id, tenant_id, execution_id, seq, status, graph, thread_id, "
    "input_type, input, run_type, run, submitted_at, not_before, flow_key, stream_modes) "
    "SELECT :run_id, :tenant_id, :execution_id, COALESCE(MAX(seq), 0) + 1, :status, :graph, "
    ":thread_id, :input_type, :input, :run_type, :run, :at, :not_before, :flow_key, "
    ":stream_modes FROM fence_runs WHERE " + _RUN_KEY
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
RUN_ENDS = text(
    f"UPDATE fence_runs SET status = COALESCE(:status, {_of_lease('status')}), "
    f"reason = COALESCE(:reason, {_of_lease('reason')}), epoch = {_of_lease('epoch')}, "
    f"output_type = {_of_record('output_type')}, output = {_of_record('output')}, "
    f"started_at = COALESCE(started_at, {_of_record('started_at')}) "
    f"WHERE {_RUN_KEY} AND status = 'current'"
)
NEXT_QUEUED = text(
    "SELECT run_id, graph, thread_id, input_type, input, run_type, run, not_before, flow_key "
    "FROM fence_runs WHERE " + _RUN_KEY + " AND status = 'queued' ORDER BY seq LIMIT 1"
)
MAKE_CURRENT = text("UPDATE fence_runs SET status = 'current' WHERE run_id = :run_id")
# Threads with a queued run whose current run has ended (released: no holder; a yielded
# run keeps its holder and goes on): the next one may begin.
PROMOTABLE = text(
    "SELECT DISTINCT r.tenant_id, r.execution_id FROM fence_runs r JOIN fence_leases l "
    "ON l.tenant_id = r.tenant_id AND l.execution_id = r.execution_id "
    "WHERE r.status = 'queued' AND l.status IN ("
    + ", ".join(f"'{status}'" for status in BETWEEN_RUNS)
    + ") "
    "AND l.holder IS NULL LIMIT :limit"
)
# The runs queued behind their thread's run, oldest submit first.
QUEUED_RUNS = {
    of: text(
        "SELECT r.tenant_id, r.execution_id, r.run_id, r.graph, r.thread_id, l.epoch, "
        "r.not_before "
        "FROM fence_runs r JOIN fence_leases l ON l.tenant_id = r.tenant_id "
        "AND l.execution_id = r.execution_id WHERE " + of + "r.status = 'queued' "
        "ORDER BY r.submitted_at, r.seq LIMIT :limit"
    )
    for of in OF_TENANT
}
RUN_STATUS = text("SELECT status FROM fence_runs WHERE run_id = :run_id")
# The attempts of the execution's current run (NULL: one), and one more of them.
ATTEMPTS = text(
    "SELECT COALESCE(attempts, 1) AS attempts FROM fence_runs WHERE "
    + _RUN_KEY
    + " AND status = 'current'"
)
ONE_MORE_ATTEMPT = text(
    "UPDATE fence_runs SET attempts = COALESCE(attempts, 1) + 1 WHERE "
    + _RUN_KEY
    + " AND status = 'current'"
)
CANCEL_QUEUED = text(
    "UPDATE fence_runs SET status = 'cancelled', reason = :reason "
    "WHERE run_id = :run_id AND status = 'queued'"
)
RUN_STATE = text(
    _STATE_COLUMNS
    + ", e.output_type, e.output, r.run_id, r.status AS run_status, r.reason AS run_reason, "
    "r.epoch AS run_epoch, r.graph AS run_graph, r.thread_id AS run_thread, "
    "r.output_type AS run_output_type, r.output AS run_output, "
    "r.not_before AS run_not_before, r.attempts AS run_attempts FROM fence_runs r "
    "JOIN fence_leases l ON l.tenant_id = r.tenant_id AND l.execution_id = r.execution_id "
    "LEFT JOIN fence_executions e ON e.tenant_id = r.tenant_id "
    "AND e.execution_id = r.execution_id "
    "WHERE r.run_id = :run_id AND r.tenant_id = :tenant_id AND r.execution_id = :execution_id"
)

# Whether submitted runs wait on the thread: a pending submitted run, or queued ones.
WAITING = text(
    "SELECT l.status, e.submitted_at, EXISTS (SELECT 1 FROM fence_runs r WHERE "
    "r.tenant_id = l.tenant_id AND r.execution_id = l.execution_id AND r.status = 'queued') "
    "AS queued FROM fence_leases l LEFT JOIN fence_executions e ON e.tenant_id = l.tenant_id "
    "AND e.execution_id = l.execution_id "
    "WHERE l.tenant_id = :tenant_id AND l.execution_id = :execution_id"
)

ANNOUNCE = text(
    "INSERT INTO fence_workers (instance_id, graphs, seen_at, held, max_held, lease_ttl, "
    "renewal_late) VALUES (:instance_id, :graphs, :at, :held, :max_held, :lease_ttl, "
    ":renewal_late) ON CONFLICT (instance_id) DO UPDATE SET graphs = excluded.graphs, "
    "seen_at = excluded.seen_at, held = excluded.held, max_held = excluded.max_held, "
    "lease_ttl = excluded.lease_ttl, renewal_late = excluded.renewal_late"
)
RETIRE = text("DELETE FROM fence_workers WHERE instance_id = :instance_id")
WORKERS = text("SELECT instance_id, graphs FROM fence_workers WHERE seen_at >= :since")

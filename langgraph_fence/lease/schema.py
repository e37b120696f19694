"""The lease table and its migrations (shared with the fence-aware SQL checkpointer).

``fence_leases`` holds one row per execution key. ``epoch`` is the fencing token;
``expires_at`` is in the store's clock (seconds since the epoch, PostgreSQL's ``now()`` or the
injected clock).

The stamp set lives in ``pending_effects``, a JSON object on the lease row (``JSONB`` on
PostgreSQL, ``TEXT`` on SQLite) keyed by :attr:`PendingEffect.key`: one entry per task, or per
tool call. On the row, not in a table of its own, so that stamping (with the renewal),
clearing (with a step's writes) and the take-over decision each stay ONE statement. Every
change to the set is a JSON merge patch (an entry to add, ``null`` for one to remove) applied
by :data:`STAMP_SQL`'s ``patch``, the one definition the lease store and both checkpoint
drivers use.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Iterable, Mapping
from typing import Any

from sqlalchemy import (
    JSON,
    BigInteger,
    CheckConstraint,
    Column,
    ColumnElement,
    Double,
    Integer,
    MetaData,
    PrimaryKeyConstraint,
    Table,
    Text,
    and_,
    text,
)
from sqlalchemy.dialects.postgresql import JSONB
from sqlalchemy.ext.asyncio import AsyncConnection

from langgraph_fence.database import Dialect
from langgraph_fence.database.migrations import Migration
from langgraph_fence.effects import Effect
from langgraph_fence.lease import LeaseStatus, PendingEffect
from langgraph_fence.lease.timeline import timeline_sql

logger = logging.getLogger("langgraph_fence.schema")

__all__ = [
    "HELD_BACK",
    "LEASES",
    "LEASE_MIGRATIONS",
    "SERVER_ATTEMPTS",
    "STAMP_SQL",
    "effects_from_json",
    "in_flight_sql",
    "metadata",
    "not_yielded",
    "stamp_patch",
    "yielded_sql",
]

logger = logging.getLogger("langgraph_fence.schema")

metadata = MetaData()

#: ``fence_leases`` as :data:`LEASE_MIGRATIONS` leave it: the queries are built from this,
#: and ``tests/contract/test_lease_migrations.py`` checks that a migrated database has
#: exactly these columns, nullability, key and checks. The migrations are its history
#: (each step frozen once released); this is its present.
LEASES = Table(
    "fence_leases",
    metadata,
    Column("tenant_id", Text, nullable=False),
    Column("execution_id", Text, nullable=False),
    Column("scope_key", Text, nullable=False),
    Column("epoch", BigInteger, CheckConstraint("epoch >= 0"), nullable=False),
    Column("holder", Text),
    Column("expires_at", Double),
    Column(
        "status",
        Text,
        CheckConstraint(
            "status IN ('pending', 'running', 'waiting', 'done', 'failed', 'dead_lettered', "
            "'cancelled')"
        ),
        nullable=False,
    ),
    Column("pending_effects", JSON().with_variant(JSONB(), "postgresql"), nullable=False),
    Column("reason", Text),
    Column("updated_at", Double, nullable=False),
    Column("takeovers", Integer, nullable=False, server_default="0"),
    Column("progress_mark", Text),
    Column("parent_execution_id", Text),
    PrimaryKeyConstraint("tenant_id", "execution_id"),
)


#: The ``expires_at`` of a pending row that no take passes until something sets it back: a
#: run held back by its flow key until a worker's look admits it (``queue/_flows.py``).
HELD_BACK = 1e15


def yielded_sql(alias: str = "") -> str:
    """SQL true for a yielded ``fence_leases`` row, as
    :func:`~langgraph_fence.lease.transitions.is_yielded` tells one: waiting with its holder kept,
    its run still going on. ``alias`` qualifies the columns. Every statement that tells a
    yielded tree from an ended one says it this way."""
    at = f"{alias}." if alias else ""
    return f"({at}status = '{LeaseStatus.WAITING.value}' AND {at}holder IS NOT NULL)"


def in_flight_sql(alias: str = "") -> str:
    """SQL true for a row whose run has not ended: pending, running, or yielded."""
    at = f"{alias}." if alias else ""
    going = f"'{LeaseStatus.PENDING.value}', '{LeaseStatus.RUNNING.value}'"
    return f"({at}status IN ({going}) OR {yielded_sql(alias)})"


def not_yielded() -> ColumnElement[bool]:
    """:func:`yielded_sql` negated, as an expression on :data:`LEASES`."""
    columns = LEASES.c
    return ~and_(columns.status == LeaseStatus.WAITING.value, columns.holder.is_not(None))


_CREATE_LEASES = """
CREATE TABLE IF NOT EXISTS fence_leases (
    tenant_id TEXT NOT NULL,
    execution_id TEXT NOT NULL,
    scope_key TEXT NOT NULL UNIQUE,
    epoch BIGINT NOT NULL CHECK (epoch >= 0),
    holder TEXT,
    expires_at {double},
    status TEXT NOT NULL CHECK (status IN
        ('pending', 'running', 'waiting', 'done', 'failed', 'dead_lettered')),
    pending_effect TEXT,
    pending_node TEXT,
    pending_task TEXT,
    pending_token BIGINT,
    reason TEXT,
    updated_at {double} NOT NULL,
    PRIMARY KEY (tenant_id, execution_id)
)
"""
_CANDIDATES_INDEX = (
    "CREATE INDEX IF NOT EXISTS fence_leases_candidates ON fence_leases (status, expires_at)"
)

# Version 2: on PostgreSQL a unique index other than the upsert's conflict target turns a
# lost race of two first takes into a unique violation instead of "not taken" (ON CONFLICT
# arbitrates only its target). scope_key is a function of the primary key, so a plain index
# keeps it unique all the same. SQLite serialises writers: its upsert always meets the
# primary key first, and dropping a column constraint there would mean rebuilding the table.
_SCOPE_KEY_NOT_UNIQUE = [
    "ALTER TABLE fence_leases DROP CONSTRAINT IF EXISTS fence_leases_scope_key_key",
    "CREATE INDEX IF NOT EXISTS fence_leases_scope_key ON fence_leases (scope_key)",
]

LEASE_MIGRATIONS = [
    Migration.typed(1, "the lease table", _CREATE_LEASES, _CANDIDATES_INDEX),
    Migration(
        version=2,
        description="scope_key indexed but not a second unique constraint (upsert races)",
        sqlite=[],
        postgresql=_SCOPE_KEY_NOT_UNIQUE,
    ),
]

# Version 3: the stamp set. One stamp per lease let a parallel task's clear remove the stamp
# of a task still mid-write (a non-idempotent write then ran twice after a takeover).
_STAMP_ENTRY = {
    "postgresql": (
        "jsonb_build_object(pending_task, jsonb_build_object('effect', pending_effect, "
        "'node', pending_node, 'task_id', pending_task, 'token', pending_token, "
        "'checkpoint_id', '', 'call', ''))"
    ),
    "sqlite": (
        "json_object(pending_task, json_object('effect', pending_effect, "
        "'node', pending_node, 'task_id', pending_task, 'token', pending_token, "
        "'checkpoint_id', '', 'call', ''))"
    ),
}
_OLD_STAMP_COLUMNS = ("pending_effect", "pending_node", "pending_task", "pending_token")


def _stamp_set_steps(dialect: str, column_type: str, empty: str) -> list[str]:
    return [
        f"ALTER TABLE fence_leases ADD COLUMN pending_effects {column_type} NOT NULL"
        f" DEFAULT {empty}",
        f"UPDATE fence_leases SET pending_effects = {_STAMP_ENTRY[dialect]}"
        " WHERE pending_effect IS NOT NULL AND pending_task IS NOT NULL",
        *(f"ALTER TABLE fence_leases DROP COLUMN {c}" for c in _OLD_STAMP_COLUMNS),
    ]


LEASE_MIGRATIONS.append(
    Migration(
        version=3,
        description="the stamp set: pending_effects, one entry per task or tool call",
        sqlite=_stamp_set_steps("sqlite", "TEXT", "'{}'"),
        postgresql=_stamp_set_steps("postgresql", "JSONB", "'{}'::jsonb"),
    )
)

# Version 4: the takeover budget (docs/takeover-budget.md). Two columns on the lease row,
# written only by the take-over statement (and reset by release / retry): the hot paths
# (renew, stamp, a checkpoint's guard) neither read nor write them.
LEASE_MIGRATIONS.append(
    Migration(
        version=4,
        description="the takeover budget: takeovers without progress, and the progress mark",
        sqlite=[
            "ALTER TABLE fence_leases ADD COLUMN takeovers INTEGER NOT NULL DEFAULT 0",
            "ALTER TABLE fence_leases ADD COLUMN progress_mark TEXT",
        ],
        postgresql=[
            "ALTER TABLE fence_leases ADD COLUMN IF NOT EXISTS takeovers INTEGER NOT NULL"
            " DEFAULT 0",
            "ALTER TABLE fence_leases ADD COLUMN IF NOT EXISTS progress_mark TEXT",
        ],
    )
)

# Version 5: a child's row records its parent (issue 31). Child ids used to be
# scope_key(tenant, parent, key), the namespace of every id, and a cancel or a wake found a
# parent's children by that prefix: a thread of your own named like a child was adopted,
# cancelled or waited for. New child ids are reserved (langgraph_fence.execution.children) and every
# statement about a parent's children reads this column.
_PARENT_INDEX = (
    "CREATE INDEX IF NOT EXISTS fence_leases_parent ON fence_leases "
    "(tenant_id, parent_execution_id) WHERE parent_execution_id IS NOT NULL"
)


async def _link_earlier_children(conn: AsyncConnection, dialect: Dialect) -> None:
    """Record the parent of each child spawned before version 5, as the statements of that
    version found them: an id ``scope_key(tenant, parent, key)`` of the row's own tenant
    whose parent's row exists. A cancel or a wake of their parent reaches them as before.

    Their ids stay as they are (they key checkpoints, records and sink marks too). A parent
    still in flight whose waiting step runs again after the upgrade looks its children up
    by their new ids and spawns them again: such parents are named in a warning."""
    from langgraph_fence.lease.scope import parse_scope_key

    rows = await conn.execute(
        text("SELECT tenant_id, execution_id FROM fence_leases WHERE execution_id LIKE '%:%:%'")
    )
    links = []
    for tenant_id, execution_id in rows:
        try:
            parts = parse_scope_key(execution_id)
        except ValueError:
            continue
        if len(parts) == 3 and parts[0] == tenant_id:
            links.append({"t": tenant_id, "e": execution_id, "p": parts[1]})
    if links:
        await conn.execute(
            text(
                "UPDATE fence_leases SET parent_execution_id = :p WHERE tenant_id = :t "
                "AND execution_id = :e AND EXISTS (SELECT 1 FROM fence_leases p "
                "WHERE p.tenant_id = :t AND p.execution_id = :p)"
            ),
            links,
        )
        in_flight = await conn.execute(
            text(
                "SELECT DISTINCT p.scope_key FROM fence_leases p JOIN fence_leases c ON "
                "c.tenant_id = p.tenant_id AND c.parent_execution_id = p.execution_id "
                f"WHERE {in_flight_sql('p')} ORDER BY p.scope_key"
            )
        )
        parents = [row.scope_key for row in in_flight]
        if parents:
            logger.warning(
                "%d execution(s) in flight have children spawned by an earlier "
                "langgraph-fence (%s): if their waiting step runs again under this version it "
                "spawns those children again under new ids. Let them end (or cancel them) "
                "with the version that started them",
                len(parents),
                ", ".join(parents[:10]) + (", ..." if len(parents) > 10 else ""),
            )


LEASE_MIGRATIONS.append(
    Migration(
        version=5,
        description="each child's row records its parent: cancels and wakes by exact parent",
        sqlite=[
            "ALTER TABLE fence_leases ADD COLUMN parent_execution_id TEXT",
            _PARENT_INDEX,
            _link_earlier_children,
        ],
        postgresql=[
            "ALTER TABLE fence_leases ADD COLUMN IF NOT EXISTS parent_execution_id TEXT",
            _PARENT_INDEX,
            _link_earlier_children,
        ],
    )
)

# Version 6: ``cancelled``, a status of its own (issue 33). A run cancelled on purpose
# (SubmittedRun.cancel) used to end ``failed``, which nothing resumes; ``cancelled`` is
# resumed by a new run of the thread and by ``resolve --retry``. PostgreSQL swaps the
# status check; SQLite cannot alter a check, so the table is rebuilt as it stands after
# version 5 (same columns, keys and indexes), in the migration's own transaction.
_STATUS_CHECK = (
    "status IN ('pending', 'running', 'waiting', 'done', 'failed', 'dead_lettered', 'cancelled')"
)
_LEASE_COLUMNS_V5 = (
    "tenant_id, execution_id, scope_key, epoch, holder, expires_at, status, reason, "
    "updated_at, pending_effects, takeovers, progress_mark, parent_execution_id"
)
_SQLITE_LEASES_V6 = f"""
CREATE TABLE fence_leases_v6 (
    tenant_id TEXT NOT NULL,
    execution_id TEXT NOT NULL,
    scope_key TEXT NOT NULL UNIQUE,
    epoch BIGINT NOT NULL CHECK (epoch >= 0),
    holder TEXT,
    expires_at REAL,
    status TEXT NOT NULL CHECK ({_STATUS_CHECK}),
    reason TEXT,
    updated_at REAL NOT NULL,
    pending_effects TEXT NOT NULL DEFAULT '{{}}',
    takeovers INTEGER NOT NULL DEFAULT 0,
    progress_mark TEXT,
    parent_execution_id TEXT,
    PRIMARY KEY (tenant_id, execution_id)
)
"""

LEASE_MIGRATIONS.append(
    Migration(
        version=6,
        description="the cancelled status: a run cancelled on purpose, resumable",
        sqlite=[
            _SQLITE_LEASES_V6,
            f"INSERT INTO fence_leases_v6 ({_LEASE_COLUMNS_V5}) "
            f"SELECT {_LEASE_COLUMNS_V5} FROM fence_leases",
            "DROP TABLE fence_leases",
            "ALTER TABLE fence_leases_v6 RENAME TO fence_leases",
            _CANDIDATES_INDEX,
            _PARENT_INDEX,
        ],
        postgresql=[
            "ALTER TABLE fence_leases DROP CONSTRAINT IF EXISTS fence_leases_status_check",
            f"ALTER TABLE fence_leases ADD CONSTRAINT fence_leases_status_check "
            f"CHECK ({_STATUS_CHECK})",
        ],
    )
)

#: ``fence_server_attempts``: per execution and Agent Server run, the newest attempt that
#: started and the epoch it took (:mod:`langgraph_fence.lease.attempts`).
SERVER_ATTEMPTS = Table(
    "fence_server_attempts",
    metadata,
    Column("tenant_id", Text, nullable=False),
    Column("execution_id", Text, nullable=False),
    Column("run_id", Text, nullable=False),
    Column("attempt", Integer, nullable=False),
    Column("epoch", BigInteger),
    Column("at", Double, nullable=False),
    PrimaryKeyConstraint("tenant_id", "execution_id", "run_id"),
)

LEASE_MIGRATIONS.append(
    Migration.typed(
        7,
        "Agent Server attempts: the newest attempt of each run, and the epoch it took",
        """CREATE TABLE IF NOT EXISTS fence_server_attempts (
    tenant_id TEXT NOT NULL,
    execution_id TEXT NOT NULL,
    run_id TEXT NOT NULL,
    attempt INTEGER NOT NULL,
    epoch BIGINT,
    at {double} NOT NULL,
    PRIMARY KEY (tenant_id, execution_id, run_id)
)""",
    )
)

LEASE_MIGRATIONS.append(
    Migration.typed(
        8,
        "the journal (each execution's token timeline), and the operator console's indexes",
        """CREATE TABLE IF NOT EXISTS fence_journal (
    tenant_id TEXT NOT NULL,
    execution_id TEXT NOT NULL,
    at {double} NOT NULL,
    kind TEXT NOT NULL,
    epoch BIGINT,
    holder TEXT,
    detail TEXT,
    actor TEXT
)""",
        "CREATE INDEX IF NOT EXISTS fence_journal_execution "
        "ON fence_journal (tenant_id, execution_id, at)",
        "CREATE INDEX IF NOT EXISTS fence_journal_kind ON fence_journal (kind)",
        # The console's listings of one status, newest change first (dead letters, running,
        # ...). One index only: a renewal rewrites a lease row, and each index of the table
        # is written again with it. The listings of every status read the records' indexes
        # (records migration 7), which a renewal never touches.
        "CREATE INDEX IF NOT EXISTS fence_leases_status_updated "
        "ON fence_leases (status, updated_at, tenant_id, execution_id)",
    )
)

# Version 9: the failover ledger (langgraph_fence.lease.timeline): the timeline whose
# executions were last classified, one row. Created at the server's timeline: a database
# made on a promoted server starts with nothing to classify.
_TIMELINE_TABLE = """CREATE TABLE IF NOT EXISTS fence_timeline (
    id INTEGER PRIMARY KEY CHECK (id = 1),
    timeline BIGINT NOT NULL,
    previous BIGINT,
    changed_at {double},
    base BIGINT NOT NULL DEFAULT 0,
    tl_base BIGINT NOT NULL DEFAULT 1
)"""
_TL = timeline_sql("postgresql")
LEASE_MIGRATIONS.append(
    Migration(
        version=9,
        description="the failover ledger: the timeline whose executions were last classified",
        sqlite=[
            _TIMELINE_TABLE.format(double="REAL"),
            "INSERT INTO fence_timeline (id, timeline) VALUES (1, 1) ON CONFLICT (id) DO NOTHING",
        ],
        postgresql=[
            _TIMELINE_TABLE.format(double="DOUBLE PRECISION"),
            # Tokens go on from where they are: no jump for a server promoted before.
            f"INSERT INTO fence_timeline (id, timeline, base, tl_base) SELECT 1, {_TL}, 0, {_TL} "
            "ON CONFLICT (id) DO NOTHING",
        ],
    )
)

# Version 10: the takeover window's index (LeaseStatements._candidates). Each tenant's
# in-flight rows in the order a worker takes them, so a look reads its window, not the whole
# backlog. Only pending and running rows: an ended row leaves it. It replaces
# ``fence_leases_candidates``, which no statement reads any more: a renewal rewrites
# ``expires_at`` and every index holding it, so a lease row keeps as many indexes as before.
LEASE_MIGRATIONS.append(
    Migration.typed(
        10,
        "the takeover window's index: each tenant's candidates in the order they are taken",
        "CREATE INDEX IF NOT EXISTS fence_leases_takeable ON fence_leases "
        "(tenant_id, (coalesce(expires_at, 0.0)), updated_at, scope_key) "
        "WHERE status IN ('pending', 'running')",
        "DROP INDEX IF EXISTS fence_leases_candidates",
    )
)

#: The stamp-set SQL per dialect, on ``fence_leases.pending_effects``: ``patch`` applies a
#: merge patch given as JSON text in ``{param}``; ``non_idempotent`` is true when any entry
#: is a ``NON_IDEMPOTENT_WRITE``; ``standing_writes`` names those entries in order of key,
#: as :func:`langgraph_fence.lease.transitions.standing_writes` does.
STAMP_SQL: Mapping[str, Mapping[str, str]] = {
    "postgresql": {
        "patch": (
            "jsonb_strip_nulls(fence_leases.pending_effects"
            " || CAST(CAST({param} AS text) AS jsonb))"
        ),
        "non_idempotent": (
            "jsonb_path_exists(fence_leases.pending_effects,"
            " '$.* ? (@.effect == \"non_idempotent_write\")')"
        ),
        "standing_writes": (
            "(SELECT string_agg(format('node ''%s'' at token %s', e.value->>'node',"
            " e.value->>'token'), ', ' ORDER BY e.key COLLATE \"C\")"
            " FROM jsonb_each(fence_leases.pending_effects) AS e"
            " WHERE e.value->>'effect' = 'non_idempotent_write')"
        ),
    },
    "sqlite": {
        "patch": "json_patch(fence_leases.pending_effects, {param})",
        # An entry that is not a JSON object (another version's, a broken writer's) is no
        # non-idempotent write, and json_extract must never see it (a bare string is
        # malformed JSON to it): CASE orders the test before the extraction.
        "non_idempotent": (
            "EXISTS (SELECT 1 FROM json_each(fence_leases.pending_effects) AS e"
            " WHERE CASE WHEN e.type = 'object' THEN json_extract(e.value, '$.effect') END"
            " = 'non_idempotent_write')"
        ),
        "standing_writes": (
            "(SELECT group_concat(w, ', ') FROM (SELECT 'node ''' ||"
            " coalesce(json_extract(e.value, '$.node'), '?') || ''' at token ' ||"
            " coalesce(json_extract(e.value, '$.token'), '?') AS w"
            " FROM json_each(fence_leases.pending_effects) AS e"
            " WHERE CASE WHEN e.type = 'object' THEN json_extract(e.value, '$.effect') END"
            " = 'non_idempotent_write'"
            " ORDER BY e.key))"
        ),
    },
}


def _entry(effect: PendingEffect) -> dict[str, Any]:
    return {
        "effect": Effect(effect.effect).value,
        "node": effect.node,
        "task_id": effect.task_id,
        "token": effect.token,
        "checkpoint_id": effect.checkpoint_id,
        "call": effect.call,
    }


def stamp_patch(add: Iterable[PendingEffect] = (), remove: Iterable[str] = ()) -> str:
    """The merge patch (JSON text) that adds ``add`` and removes the entries ``remove``."""
    patch: dict[str, Any] = dict.fromkeys(remove)
    patch.update((effect.key, _entry(effect)) for effect in add)
    return json.dumps(patch, ensure_ascii=False, separators=(",", ":"))


def effects_from_json(value: Any) -> tuple[PendingEffect, ...]:
    """The stamp set as stored (a dict, or its JSON text), ordered by key.

    Read tolerantly, since another version of the package may have written it: an entry
    never stops a read, it costs at most its own execution. An unset or unrecognised effect
    reads as retryable (``IDEMPOTENT_WRITE``, as ADR-112 says and as the SQL verdicts, which
    match ``non_idempotent_write`` only, decide); an entry whose effect is
    ``non_idempotent_write`` stays one, whatever else is missing (fail closed). The entry's
    task and call come from its key when its own fields do not name them, so a clear by key
    still finds it.
    """
    if isinstance(value, str | bytes):
        try:
            value = json.loads(value)
        except ValueError:
            logger.warning("a stamp set that is not JSON was read as empty: %.200r", value)
            return ()
    if not isinstance(value, Mapping):
        if value:
            logger.warning("a stamp set that is not a JSON object was read as empty: %.200r", value)
        return ()
    return tuple(_entry_from(str(key), entry) for key, entry in sorted(value.items()))


_KNOWN_EFFECTS = frozenset(e.value for e in Effect)


def _entry_from(key: str, entry: Any) -> PendingEffect:
    """One stamp-set entry stored under ``key``, however partial (see effects_from_json)."""
    fields: Mapping[str, Any] = entry if isinstance(entry, Mapping) else {}
    raw = fields.get("effect")
    effect = Effect(raw) if raw in _KNOWN_EFFECTS else Effect.IDEMPOTENT_WRITE
    task_id, call = fields.get("task_id"), fields.get("call") or ""
    if (
        not (isinstance(task_id, str) and isinstance(call, str))
        or (f"{task_id}/{call}" if call else task_id) != key
    ):
        task_id, _, call = key.partition("/")
    node = fields.get("node")
    token = fields.get("token")
    checkpoint_id = fields.get("checkpoint_id")
    return PendingEffect(
        effect=effect,
        node=node if isinstance(node, str) and node else f"<unreadable entry {key[:80]}>",
        task_id=task_id,
        token=token if isinstance(token, int) and not isinstance(token, bool) else 0,
        checkpoint_id=checkpoint_id if isinstance(checkpoint_id, str) else "",
        call=call,
    )

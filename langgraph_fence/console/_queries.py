"""What the console reads: every query of its pages and of ``/metrics``, read-only.

Each listing is bounded (a page, newest first, with a cursor to the next) and each query
runs on an index of lease migration 8 or execution migration 7, so a page costs the same
with a hundred executions or a hundred thousand (``benchmarks/bench_console.py``).
A value another version wrote that cannot be read is shown as such, never raised.
"""

from __future__ import annotations

import base64
import json
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from sqlalchemy import (
    BigInteger,
    Double,
    Text,
    and_,
    cast,
    column,
    func,
    select,
    table,
    text,
    tuple_,
)
from sqlalchemy.ext.asyncio import AsyncConnection

from langgraph_fence.lease import LeaseKey, LeaseStatus, PendingEffect
from langgraph_fence.lease.journal import JOURNAL, JournalEntry, read_journal
from langgraph_fence.lease.schema import LEASES, STAMP_SQL, effects_from_json
from langgraph_fence.queue import ANNOUNCED_FOR, HELD_BACK

__all__ = [
    "PAGE",
    "CheckpointMark",
    "CursorError",
    "Detail",
    "ExecutionRow",
    "Figures",
    "Filters",
    "InstanceRow",
    "QueueRow",
    "execution_detail",
    "figures",
    "instances",
    "list_executions",
    "queue",
]

#: Rows per page of a listing.
PAGE = 50
#: The newest checkpoints an execution's timeline reads.
CHECKPOINTS_READ = 500

_EXECUTIONS = table(
    "fence_executions",
    column("tenant_id", Text),
    column("execution_id", Text),
    column("graph", Text),
    column("thread_id", Text),
    column("submitted_at", Double),
    column("recorded_at", Double),
)
_CHECKPOINTS = table(
    "fence_checkpoints",
    column("tenant_id", Text),
    column("thread_id", Text),
    column("checkpoint_ns", Text),
    column("checkpoint_id", Text),
    column("fence_token", BigInteger),
    column("metadata", Text),
)


@dataclass(frozen=True, slots=True)
class Filters:
    """A listing's filters (``None``: any)."""

    tenant: str | None = None
    status: str | None = None
    graph: str | None = None
    holder: str | None = None


@dataclass(frozen=True, slots=True)
class ExecutionRow:
    """One execution as a listing shows it."""

    key: LeaseKey
    scope_key: str
    status: str
    holder: str | None
    epoch: int
    expires_in: float | None  # seconds left on the store's clock (negative: expired)
    stamps: tuple[PendingEffect, ...]
    reason: str | None
    updated_at: float
    takeovers: int
    parent_execution_id: str | None
    graph: str | None
    thread_id: str | None
    recorded_at: float | None = None
    # A pending run's wait before it may start (seconds, store clock), or None.
    starts_in: float | None = None

    @property
    def held_back(self) -> bool:
        """Pending, held back by its flow key until a look admits it."""
        return self.starts_in is not None and self.starts_in > HELD_BACK / 2


def _row(row: Any, now: float) -> ExecutionRow:
    # A pending row with no holder keeps in expires_at when it may start (a delayed run, a
    # sleep, a retry's backoff), or a time far ahead while its flow key holds it back.
    waits = row.status == "pending" and row.holder is None and row.expires_at is not None
    return ExecutionRow(
        key=LeaseKey(row.tenant_id, row.execution_id),
        scope_key=row.scope_key,
        status=row.status,
        holder=row.holder,
        epoch=int(row.epoch),
        expires_in=None if row.expires_at is None or waits else float(row.expires_at) - now,
        starts_in=float(row.expires_at) - now if waits else None,
        # Read as text and decoded tolerantly: an entry another version wrote, or a value
        # that is not JSON at all, costs this row its stamps, never the page.
        stamps=effects_from_json(row.pending_effects),
        reason=row.reason,
        updated_at=float(row.updated_at),
        takeovers=int(row.takeovers or 0),
        parent_execution_id=row.parent_execution_id,
        graph=row.graph,
        thread_id=row.thread_id,
        recorded_at=None if row.recorded_at is None else float(row.recorded_at),
    )


def _listing(*, by_record: bool = False) -> Any:
    """The columns of a listed execution: from the lease table (its record joined, where it
    has one), or (``by_record``) from the records, each joined to its lease."""
    lease, record = LEASES.c, _EXECUTIONS.c
    columns = select(
        lease.tenant_id,
        lease.execution_id,
        lease.scope_key,
        lease.status,
        lease.holder,
        lease.epoch,
        lease.expires_at,
        cast(lease.pending_effects, Text).label("pending_effects"),
        lease.reason,
        lease.updated_at,
        lease.takeovers,
        lease.parent_execution_id,
        record.graph,
        record.thread_id,
        record.recorded_at,
    )
    joined = and_(record.tenant_id == lease.tenant_id, record.execution_id == lease.execution_id)
    if by_record:
        return columns.select_from(_EXECUTIONS.join(LEASES, joined))
    return columns.select_from(LEASES.outerjoin(_EXECUTIONS, joined))


#: The orders a listing pages in: ``status`` (one status, newest change of its lease first:
#: the status index of lease migration 8), ``key`` (the running: by tenant and execution,
#: since every renewal changes a running lease's row, and a row that moved between two
#: pages would be skipped) and ``recorded`` (every status, newest run first: the records'
#: indexes of records migration 7; a lease row with no record is listed by status only).
_RENEWED = frozenset({LeaseStatus.RUNNING.value})


def encode_cursor(order: str, row: ExecutionRow) -> str:
    """The cursor of the page after ``row`` (opaque to the user, checked when read)."""
    at = {"status": row.updated_at, "recorded": row.recorded_at}.get(order, 0.0)
    raw = json.dumps([order, at, row.key.tenant_id, row.key.execution_id])
    return base64.urlsafe_b64encode(raw.encode()).decode().rstrip("=")


class CursorError(ValueError):
    """A page cursor this console did not make (for these filters)."""


def decode_cursor(cursor: str, order: str) -> tuple[float, str, str]:
    """What :func:`encode_cursor` encoded for ``order``; :class:`CursorError` for anything
    else."""
    try:
        raw = base64.urlsafe_b64decode(cursor + "=" * (-len(cursor) % 4))
        made_for, at, tenant, execution = json.loads(raw)
    except Exception:
        raise CursorError("the page cursor is not one this console made") from None
    if not (
        made_for == order
        and isinstance(at, int | float)
        and isinstance(tenant, str)
        and isinstance(execution, str)
    ):
        raise CursorError("the page cursor is not one this console made for these filters")
    return float(at), tenant, execution


async def list_executions(
    conn: AsyncConnection, filters: Filters, now: float, *, after: str | None = None
) -> tuple[list[ExecutionRow], str | None]:
    """One page of executions and the cursor of the next (or ``None``): of one status, newest
    change first; of every status, newest run first. ``ValueError``: ``after`` is no cursor
    of this listing."""
    lease, record = LEASES.c, _EXECUTIONS.c
    if filters.status is None:
        order = "recorded"
    elif filters.status in _RENEWED:
        order = "key"
    else:
        order = "status"
    query = _listing(by_record=order == "recorded")
    if filters.tenant is not None:
        query = query.where(lease.tenant_id == filters.tenant)
    if filters.status is not None:
        query = query.where(lease.status == filters.status)
    if filters.graph is not None:
        query = query.where(record.graph == filters.graph)
    if filters.holder is not None:
        query = query.where(lease.holder == filters.holder)
    keys: tuple[Any, ...]
    if order == "status":
        keys = (lease.updated_at, lease.tenant_id, lease.execution_id)
    elif order == "key":
        keys = (lease.tenant_id, lease.execution_id)
    else:
        keys = (record.recorded_at, record.tenant_id, record.execution_id)
    if after is not None:
        at, tenant, execution = decode_cursor(after, order)
        bound = (tenant, execution) if order == "key" else (at, tenant, execution)
        query = query.where(tuple_(*keys) < tuple_(*bound))
    query = query.order_by(*(key.desc() for key in keys)).limit(PAGE + 1)
    rows = [_row(row, now) for row in (await conn.execute(query)).all()]
    following = encode_cursor(order, rows[PAGE - 1]) if len(rows) > PAGE else None
    return rows[:PAGE], following


@dataclass(frozen=True, slots=True)
class CheckpointMark:
    """Checkpoints one token wrote, in one namespace."""

    token: int | None
    checkpoint_ns: str
    count: int
    first_id: str
    last_id: str
    steps: tuple[int, int] | None  # the least and the greatest step they name


@dataclass(frozen=True, slots=True)
class Detail:
    """One execution, whole, as its page shows it."""

    row: ExecutionRow
    journal: Sequence[JournalEntry]
    checkpoints: Sequence[CheckpointMark]
    children: Sequence[ExecutionRow]
    parent: LeaseKey | None
    submitted_at: float | None = None
    tokens: Sequence[int] = field(default_factory=tuple)


async def execution_detail(conn: AsyncConnection, key: LeaseKey, now: float) -> Detail | None:
    """``key``'s lease, journal, checkpoints by token and children; ``None``: no such row."""
    lease = LEASES.c
    query = _listing().where(
        lease.tenant_id == key.tenant_id, lease.execution_id == key.execution_id
    )
    found = (await conn.execute(query)).first()
    if found is None:
        return None
    row = _row(found, now)
    journal = await read_journal(conn, key.tenant_id, key.execution_id)
    marks = await _checkpoint_marks(conn, key.tenant_id, row.thread_id)
    children_query = (
        _listing()
        .where(lease.tenant_id == key.tenant_id, lease.parent_execution_id == key.execution_id)
        .order_by(lease.execution_id)
        .limit(200)
    )
    children = [_row(r, now) for r in (await conn.execute(children_query)).all()]
    parent = _parent_of(key, row.parent_execution_id)
    tokens = sorted(
        {e.epoch for e in journal if e.epoch is not None}
        | {m.token for m in marks if m.token is not None}
        | {row.epoch}
    )
    return Detail(row, journal, marks, children, parent, tokens=tokens)


def _parent_of(key: LeaseKey, recorded: str | None) -> LeaseKey | None:
    if recorded:
        return LeaseKey(key.tenant_id, recorded)
    from langgraph_fence.execution.children import parse_child_execution_id

    parsed = parse_child_execution_id(key.execution_id)
    return None if parsed is None else parsed[0]


async def _checkpoint_marks(
    conn: AsyncConnection, tenant_id: str, thread_id: str | None
) -> list[CheckpointMark]:
    """The newest :data:`CHECKPOINTS_READ` checkpoints of the thread, grouped by the token
    that wrote them and their namespace, in the order they were written."""
    if thread_id is None:
        return []
    c = _CHECKPOINTS.c
    query = (
        select(c.checkpoint_ns, c.checkpoint_id, c.fence_token, c.metadata)
        .where(c.tenant_id == tenant_id, c.thread_id == thread_id)
        .order_by(c.checkpoint_id.desc())
        .limit(CHECKPOINTS_READ)
    )
    try:
        rows = list(reversed((await conn.execute(query)).all()))
    except Exception:  # no checkpoint tables here (a lease store alone): no marks
        return []
    marks: list[CheckpointMark] = []
    for ns, checkpoint_id, token, metadata in rows:
        step = _step_of(metadata)
        token = None if token is None else int(token)
        last = marks[-1] if marks else None
        if last is not None and last.token == token and last.checkpoint_ns == ns:
            steps = last.steps
            if step is not None:
                steps = (
                    (step, step) if steps is None else (min(steps[0], step), max(steps[1], step))
                )
            marks[-1] = CheckpointMark(
                token, ns, last.count + 1, last.first_id, checkpoint_id, steps
            )
        else:
            steps = None if step is None else (step, step)
            marks.append(CheckpointMark(token, ns, 1, checkpoint_id, checkpoint_id, steps))
    return marks


def _step_of(metadata: Any) -> int | None:
    if isinstance(metadata, str | bytes):
        try:
            metadata = json.loads(metadata)
        except ValueError:
            return None
    step = metadata.get("step") if isinstance(metadata, Mapping) else None
    return step if isinstance(step, int) and not isinstance(step, bool) else None


@dataclass(frozen=True, slots=True)
class QueueRow:
    """The run queue of one graph and tenant."""

    graph: str
    tenant_id: str
    pending: int
    running: int
    waiting: int
    queued_runs: int
    oldest_age: float | None  # seconds since the oldest pending submitted run was submitted


# CROSS JOIN: the same join, but SQLite then reads the in-flight leases first (their status
# index) and looks each record up, rather than every record for its graph index's order.
_QUEUE = """
SELECT e.graph, l.tenant_id,
    SUM(CASE WHEN l.status = 'pending' THEN 1 ELSE 0 END) AS pending,
    SUM(CASE WHEN l.status = 'running' THEN 1 ELSE 0 END) AS running,
    SUM(CASE WHEN l.status = 'waiting' THEN 1 ELSE 0 END) AS waiting,
    MIN(CASE WHEN l.status = 'pending' THEN e.submitted_at END) AS oldest
FROM fence_leases l CROSS JOIN fence_executions e
WHERE e.tenant_id = l.tenant_id AND e.execution_id = l.execution_id
    AND l.status IN ('pending', 'running', 'waiting') {tenant}
GROUP BY e.graph, l.tenant_id
"""
_QUEUED_RUNS = """
SELECT graph, tenant_id, COUNT(*), MIN(submitted_at) FROM fence_runs
WHERE status = 'queued' {tenant} GROUP BY graph, tenant_id
"""


async def queue(conn: AsyncConnection, tenant: str | None) -> list[QueueRow]:
    """Pending, running and waiting executions and queued runs, per graph and tenant."""
    where = "" if tenant is None else "AND l.tenant_id = :tenant"
    params = {} if tenant is None else {"tenant": tenant}
    rows = (await conn.execute(text(_QUEUE.format(tenant=where)), params)).all()
    where_runs = "" if tenant is None else "AND tenant_id = :tenant"
    try:
        queued = {
            (graph, t): (int(n), oldest)
            for graph, t, n, oldest in (
                await conn.execute(text(_QUEUED_RUNS.format(tenant=where_runs)), params)
            ).all()
        }
    except Exception:  # an older database without fence_runs
        queued = {}
    wall = time.time()
    out: dict[tuple[str, str], QueueRow] = {}
    for graph, tenant_id, pending, running, waiting, oldest in rows:
        n, queued_oldest = queued.pop((graph, tenant_id), (0, None))
        first = min((t for t in (oldest, queued_oldest) if t is not None), default=None)
        out[(graph, tenant_id)] = QueueRow(
            graph,
            tenant_id,
            int(pending or 0),
            int(running or 0),
            int(waiting or 0),
            n,
            None if first is None else max(wall - float(first), 0.0),
        )
    for (graph, tenant_id), (n, queued_oldest) in queued.items():
        age = None if queued_oldest is None else max(wall - float(queued_oldest), 0.0)
        out[(graph, tenant_id)] = QueueRow(graph, tenant_id, 0, 0, 0, n, age)
    return sorted(out.values(), key=lambda r: (r.graph, r.tenant_id))


@dataclass(frozen=True, slots=True)
class InstanceRow:
    """A serving instance, as it last said, beside what the lease table says it holds."""

    instance_id: str
    graphs: tuple[str, ...]
    seen_ago: float | None  # seconds since it last said what it holds (None: never)
    held: int  # running leases the lease table names it holder of
    said_held: int | None
    max_held: int | None
    lease_ttl: float | None
    renewal_late: float | None

    @property
    def serving(self) -> bool:
        """Whether it said what it holds within :data:`~langgraph_fence.queue.ANNOUNCED_FOR`
        (one that stopped saying so stopped, or died)."""
        return self.seen_ago is not None and self.seen_ago <= ANNOUNCED_FOR


_WORKERS = (
    "SELECT instance_id, graphs, seen_at, held, max_held, lease_ttl, renewal_late "
    "FROM fence_workers"
)


async def held_by(conn: AsyncConnection, tenant: str | None) -> dict[str, int]:
    """Running leases per holder."""
    lease = LEASES.c
    query = (
        select(lease.holder, func.count())
        .where(lease.status == LeaseStatus.RUNNING.value, lease.holder.is_not(None))
        .group_by(lease.holder)
    )
    if tenant is not None:
        query = query.where(lease.tenant_id == tenant)
    return {str(holder): int(n) for holder, n in (await conn.execute(query)).all()}


async def instances(conn: AsyncConnection, tenant: str | None) -> list[InstanceRow]:
    """Every instance that serves (or said so) or holds a running lease."""
    held = await held_by(conn, tenant)
    wall = time.time()
    out: dict[str, InstanceRow] = {}
    try:
        workers = (await conn.execute(text(_WORKERS))).all()
    except Exception:  # an older database: its workers' columns are not there yet
        workers = []
    for instance_id, graphs, seen_at, said, max_held, ttl, late in workers:
        try:
            names = tuple(str(g) for g in json.loads(graphs))
        except (ValueError, TypeError):
            names = ()
        out[instance_id] = InstanceRow(
            instance_id,
            names,
            max(wall - float(seen_at), 0.0),
            held.pop(instance_id, 0),
            said,
            max_held,
            ttl,
            late,
        )
    for holder, n in held.items():
        out[holder] = InstanceRow(holder, (), None, n, None, None, None, None)
    return sorted(out.values(), key=lambda r: r.instance_id)


@dataclass(frozen=True, slots=True)
class Figures:
    """What ``/metrics`` reports of the database (see ``console/_metrics.py``)."""

    executions: Mapping[tuple[str, str], int]  # (status, graph) -> count
    queue: Sequence[QueueRow]
    instances: Sequence[InstanceRow]
    journal: Mapping[str, int]  # kind -> entries
    stamps_standing: int
    non_idempotent_standing: int


_STAMPS = {
    "postgresql": (
        "SELECT SUM(CASE WHEN pending_effects <> '{{}}'::jsonb THEN 1 ELSE 0 END), "
        "SUM(CASE WHEN {non_idempotent} THEN 1 ELSE 0 END) FROM fence_leases {where}"
    ),
    "sqlite": (
        # A value that is not JSON (another writer's) is counted as a stamp standing, and
        # json_each never sees it: CASE orders the test first.
        "SELECT SUM(CASE WHEN pending_effects NOT IN ('{{}}', '') THEN 1 ELSE 0 END), "
        "SUM(CASE WHEN json_valid(pending_effects) THEN "
        "(CASE WHEN {non_idempotent} THEN 1 ELSE 0 END) ELSE 0 END) FROM fence_leases {where}"
    ),
}


async def figures(conn: AsyncConnection, tenant: str | None) -> Figures:
    """Every figure ``/metrics`` reports, read in one connection."""
    lease, record = LEASES.c, _EXECUTIONS.c
    params = {} if tenant is None else {"tenant": tenant}
    by_status = (
        select(lease.status, func.coalesce(record.graph, ""), func.count())
        .select_from(
            LEASES.outerjoin(
                _EXECUTIONS,
                and_(
                    record.tenant_id == lease.tenant_id,
                    record.execution_id == lease.execution_id,
                ),
            )
        )
        .group_by(lease.status, record.graph)
    )
    if tenant is not None:
        by_status = by_status.where(lease.tenant_id == tenant)
    executions = {
        (str(status), str(graph)): int(n)
        for status, graph, n in (await conn.execute(by_status)).all()
    }
    journal_query = select(JOURNAL.c.kind, func.count()).group_by(JOURNAL.c.kind)
    if tenant is not None:
        journal_query = journal_query.where(JOURNAL.c.tenant_id == tenant)
    journal = {str(kind): int(n) for kind, n in (await conn.execute(journal_query)).all()}
    dialect = "postgresql" if conn.dialect.name == "postgresql" else "sqlite"
    stamps_sql = _STAMPS[dialect].format(
        non_idempotent=STAMP_SQL[dialect]["non_idempotent"],
        where="" if tenant is None else "WHERE tenant_id = :tenant",
    )
    standing, non_idempotent = (await conn.execute(text(stamps_sql), params)).one()
    return Figures(
        executions,
        await queue(conn, tenant),
        await instances(conn, tenant),
        journal,
        int(standing or 0),
        int(non_idempotent or 0),
    )

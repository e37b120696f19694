"""The SQL lease store's statements: each lease operation as ONE SQLAlchemy construct.

Each statement decides, on the row as it stands, what the pure transition it is named after
(:mod:`langgraph_fence.lease.transitions`) decides: the guard, the stamps a take finds, the
takeover budget. They are written once for both databases and built once per store, so
SQLAlchemy's compiled cache and asyncpg's prepared statement cache serve every call.
"""

from __future__ import annotations

from typing import Any

from sqlalchemy import (
    BigInteger,
    Boolean,
    ColumnElement,
    Double,
    Integer,
    Text,
    and_,
    bindparam,
    case,
    cast,
    func,
    literal,
    literal_column,
    null,
    or_,
    select,
    text,
    true,
    update,
)
from sqlalchemy.dialects import postgresql as pg_dialect
from sqlalchemy.dialects import sqlite as sqlite_dialect

from langgraph_fence.database import Dialect
from langgraph_fence.lease import (
    REOPENABLE_STATUSES,
    RESOLVABLE_STATUSES,
    TERMINAL_STATUSES,
    LeaseStatus,
)
from langgraph_fence.lease.guard import guard_sql
from langgraph_fence.lease.schema import LEASES, STAMP_SQL, not_yielded
from langgraph_fence.lease.timeline import (
    OnFailover,
    first_token_sql,
    ledger_ok_sql,
    next_token_sql,
)

__all__ = ["NO_BUDGET", "RETURNING", "LeaseStatements", "now_sql"]

_C = LEASES.c
# The statuses an operator resolves, in a stable order (one cached statement).
_RESOLVABLE = sorted(status.value for status in RESOLVABLE_STATUSES)
#: The columns every statement returns: what the store reads a lease from.
RETURNING = (
    _C.tenant_id,
    _C.execution_id,
    _C.epoch,
    _C.holder,
    _C.expires_at,
    _C.status,
    _C.pending_effects,
    _C.reason,
    _C.takeovers,
    _C.progress_mark,
)
_KEY = and_(
    _C.tenant_id == bindparam("p_tenant_id"), _C.execution_id == bindparam("p_execution_id")
)
_GUARD = text(
    guard_sql(
        tenant_id=":p_tenant_id",
        execution_id=":p_execution_id",
        holder=":p_holder",
        epoch=":p_epoch",
    )
)
#: ``p_max_takeovers`` when there is no budget: more takes than any execution gets.
NO_BUDGET = 2**31 - 1


def now_sql(*, clocked: bool) -> str:
    """The store's clock as SQL text: the bound ``p_now`` of a store with a clock of its own
    (``clocked``), else the database's ``now()``."""
    if clocked:
        return "CAST(:p_now AS DOUBLE PRECISION)"
    return "CAST(EXTRACT(epoch FROM now()) AS DOUBLE PRECISION)"


class LeaseStatements:
    """The statements of one SQL lease store, for ``dialect``, on the database's clock or
    (``clocked``) on the store's own, bound as ``p_now``.

    Every take issues the next token of :mod:`~langgraph_fence.lease.timeline` (rising
    across a failover) and, on PostgreSQL under ``on_failover="quarantine"``, lands only
    once the executions were classified on the server's timeline.

    Bound names carry a ``p_`` prefix: SQLAlchemy reserves the bare column names.
    """

    def __init__(
        self, dialect: Dialect, *, clocked: bool, on_failover: OnFailover = "quarantine"
    ) -> None:
        self.dialect = dialect
        self.clocked = clocked
        self.now_sql = now_sql(clocked=clocked)
        #: The token after the row's, in SQL (in ON CONFLICT DO UPDATE: the row as it stands).
        self.next_epoch: ColumnElement[int] = literal_column(
            next_token_sql(dialect, "fence_leases.epoch"), BigInteger
        )
        #: The condition every take meets, or ``None``: no take lands while a failover's
        #: executions are unclassified.
        self.classified: ColumnElement[bool] | None = (
            literal_column(ledger_ok_sql(dialect), Boolean)
            if dialect == "postgresql" and on_failover == "quarantine"
            else None
        )
        now = self.now()
        ttl = bindparam("p_ttl", type_=Double)
        stamps = STAMP_SQL[dialect]
        self.acquire = {reopen: self.acquire_upsert(reopen=reopen) for reopen in (False, True)}
        self.renew = (
            update(LEASES)
            .where(_GUARD)
            .values(expires_at=now + ttl, updated_at=now)
            .returning(*RETURNING)
        )
        self.renew_many = self._renew_many()
        self.yield_lease = (
            update(LEASES)
            .where(_GUARD)
            .values(status=LeaseStatus.WAITING.value, expires_at=None, updated_at=now)
            .returning(*RETURNING)
        )
        # Still the waiter's at its epoch: held or yielded by it, or woken for it (pending
        # with a not-before time); transitions.decide_retake.
        retakeable = and_(
            _KEY,
            _C.epoch == bindparam("p_epoch"),
            or_(
                and_(
                    _C.holder == bindparam("p_holder"),
                    _C.status.in_([LeaseStatus.RUNNING.value, LeaseStatus.WAITING.value]),
                ),
                and_(
                    _C.holder.is_(None),
                    _C.status == LeaseStatus.PENDING.value,
                    _C.expires_at.is_not(None),
                ),
            ),
        )
        self.retake = (
            update(LEASES)
            .where(self._when_classified(retakeable))
            .values(
                epoch=self.next_epoch,
                holder=bindparam("p_holder"),
                expires_at=now + ttl,
                status=LeaseStatus.RUNNING.value,
                reason=None,
                updated_at=now,
            )
            .returning(*RETURNING)
        )
        patched = text(stamps["patch"].format(param=":p_patch"))
        status = bindparam("p_status", type_=Text)
        self.release = (
            update(LEASES)
            .where(_GUARD)
            .values(
                holder=None,
                expires_at=None,
                status=status,
                reason=bindparam("p_reason"),
                # A run that ended done recorded every step it ran: nothing of it stands.
                pending_effects=case(
                    (status == LeaseStatus.DONE.value, literal_column("'{}'")),
                    else_=_C.pending_effects,
                ),
                # Ended done or interrupted: it progressed, the takeover budget starts again.
                takeovers=case(
                    (status.in_([LeaseStatus.DONE.value, LeaseStatus.WAITING.value]), 0),
                    else_=_C.takeovers,
                ),
                updated_at=now,
            )
            .returning(*RETURNING)
        )
        # Stamping and clearing both apply a merge patch to the stamp set.
        # A stamp is the gate before a write to the world: none lands while a failover's
        # executions are unclassified (its holder may be the one whose takeover was lost).
        self.patch = (
            update(LEASES)
            .where(self._when_classified(_GUARD))
            .values(pending_effects=patched, updated_at=now)
            .returning(*RETURNING)
        )
        self.patch_renew = (
            update(LEASES)
            .where(self._when_classified(_GUARD))
            .values(pending_effects=patched, expires_at=now + ttl, updated_at=now)
            .returning(*RETURNING)
        )
        self.clear_all = (
            update(LEASES)
            .where(_GUARD)
            .values(pending_effects=literal_column("'{}'"), updated_at=now)
            .returning(*RETURNING)
        )
        dead_letter_values = {
            "holder": None,
            "expires_at": None,
            "status": LeaseStatus.DEAD_LETTERED.value,
            "reason": bindparam("p_reason"),
            "updated_at": now,
        }
        self.dead_letter = (
            update(LEASES).where(_KEY).values(**dead_letter_values).returning(*RETURNING)
        )
        self.dead_letter_at_epoch = (
            update(LEASES)
            .where(and_(_KEY, _C.epoch == bindparam("p_epoch")))
            .values(**dead_letter_values)
            .returning(*RETURNING)
        )
        self.get = select(*RETURNING).where(_KEY)
        self.candidates = self._candidates(now)
        self.read_now = select(now)
        self.take_over = self._take_over(now, ttl)
        non_idempotent = literal_column(stamps["non_idempotent"], Boolean)
        self.retry = (
            update(LEASES)
            .where(self._when_classified(and_(_KEY, _C.status.in_(_RESOLVABLE), ~non_idempotent)))
            .values(
                holder=None,
                # NULL, or a time no take passes before (a run its flow key holds back).
                expires_at=bindparam("p_not_before", type_=Double),
                status=LeaseStatus.PENDING.value,
                reason=None,
                takeovers=0,
                updated_at=now,
            )
            .returning(*RETURNING)
        )
        self.abandon = (
            update(LEASES)
            .where(and_(_KEY, _C.status.in_(_RESOLVABLE)))
            .values(
                holder=None,
                expires_at=None,
                status=LeaseStatus.FAILED.value,
                reason=bindparam("p_reason", type_=Text),
                pending_effects=literal_column("'{}'"),
                updated_at=now,
            )
            .returning(*RETURNING)
        )

    def _candidates(self, now: ColumnElement[float]) -> Any:
        """The takeover window: the first ``p_limit`` takeable rows, fair across tenants
        (each tenant's oldest candidate first, then each one's second, ..., so one tenant's
        burst of submitted runs does not starve the others; within a tenant, the longest
        expired or waiting first).

        Its cost follows the window and the tenants waiting, not the backlog: a walk over
        the tenants that have a candidate (``fence_leases_takeable``, in order), then each
        tenant's first ``p_limit`` candidates (one, when as many tenants wait) read in order
        from the same index. The walk also passes over the index entries of rows not due yet
        (held, held back, delayed) of the tenants it passes, without reading their rows.
        Sorting every takeable row by tenant cost a look 3 ms with 3 000 runs pending and
        25 ms with 30 000. PostgreSQL reads each tenant's rows in a ``LATERAL``; SQLite,
        which has none, picks them by ``rowid`` in a correlated subquery.
        """
        walk, step = LEASES.alias("walk"), LEASES.alias("step")
        # Each step of the walk in the index's own order (tenant, then age): the primary key
        # also gives the tenants in order, and PostgreSQL picks it when a tenant holds many
        # rows not due (held back by a flow key), then reads every one of them.
        first = (
            select(walk.c.tenant_id)
            .where(_in_index(walk.c, now))
            .order_by(walk.c.tenant_id, _expiry(walk.c))
            .limit(_ONE)
        )
        tenants = select(first.scalar_subquery().label("tenant_id")).cte("tenants", recursive=True)
        following = (
            select(step.c.tenant_id)
            .where(_in_index(step.c, now), step.c.tenant_id > tenants.c.tenant_id)
            .order_by(step.c.tenant_id, _expiry(step.c))
            .limit(_ONE)
            .scalar_subquery()
        )
        tenants = tenants.union_all(
            select(following.label("tenant_id")).where(tenants.c.tenant_id.is_not(None))
        )
        row = LEASES.alias("candidate")
        of_tenant = and_(row.c.tenant_id == tenants.c.tenant_id, _in_index(row.c, now))
        # On PostgreSQL the window's size is written into the SQL (one statement per size;
        # the store reads in a few sizes). Bound, it left the planner a generic plan costlier
        # than each custom one, so every read was planned again (0.25 ms of the server's
        # CPU per look). With no parameter (the database's clock), the plan is made once
        # per connection and size.
        limit = bindparam("p_limit", type_=Integer, literal_execute=self.dialect == "postgresql")
        # With as many tenants as the window holds, it holds each one's oldest candidate and
        # nothing else: read one row of each.
        counted = select(func.count(tenants.c.tenant_id)).scalar_subquery()
        per_tenant = case((counted >= limit, _ONE), else_=limit)
        names = [column.name for column in RETURNING]
        if self.dialect == "postgresql":
            ranked: Any = (
                select(
                    *(row.c[name] for name in names),
                    *_age(row.c, labelled=True),
                    func.row_number().over(order_by=_age(row.c)).label("rank"),
                )
                .where(of_tenant)
                .order_by(*_age(row.c))
                .limit(per_tenant)
                .lateral("ranked")
            )
            source: Any = tenants.join(ranked, true())
        else:
            picked: Any = (
                select(literal_column("candidate.rowid"))
                .select_from(row)
                .where(of_tenant)
                .order_by(*_age(row.c))
                .limit(per_tenant)
            )
            lease = LEASES.alias("lease")
            ranked = (
                select(
                    *(lease.c[name] for name in names),
                    *_age(lease.c, labelled=True),
                    func.row_number()
                    .over(partition_by=lease.c.tenant_id, order_by=_age(lease.c))
                    .label("rank"),
                )
                .select_from(tenants.join(lease, literal_column("lease.rowid").in_(picked)))
                .subquery("ranked")
            )
            source = ranked
        window = (
            select(*(ranked.c[name] for name in names))
            .select_from(source)
            .order_by(ranked.c.rank, ranked.c.age, ranked.c.age_updated, ranked.c.age_key)
            .limit(limit)
        )
        if self.dialect == "postgresql":
            return window
        return _on_index(window, (walk, step, row))

    def now(self) -> ColumnElement[float]:
        """The store's clock as an expression: ``now()``, or the bound ``p_now``."""
        if not self.clocked:
            return cast(func.extract("epoch", func.now()), Double)
        return bindparam("p_now", type_=Double)

    def acquire_upsert(self, *, reopen: bool, when: Any = None) -> Any:
        """The acquire: one upsert that decides the next token and the stamps it finds.

        With ``when`` (a condition), the row is offered only where it holds (``INSERT ...
        SELECT ... WHERE``): nothing is inserted or updated where it does not (the take of
        a run, :meth:`~langgraph_fence.lease.sql.SqlLeaseRepository.take`).
        """
        now = self.now()
        ttl = bindparam("p_ttl", type_=Double)
        insert = pg_dialect.insert if self.dialect == "postgresql" else sqlite_dialect.insert
        # transitions._is_held: running and not expired, yielded (waiting, its holder kept), or
        # woken and before its not-before time (pending, no holder, expires_at ahead).
        not_held = and_(
            or_(
                _C.status != LeaseStatus.RUNNING.value,
                _C.holder.is_(None),
                _C.expires_at.is_(None),
                _C.expires_at <= now,
            ),
            not_yielded(),
            or_(
                _C.status != LeaseStatus.PENDING.value,
                _C.holder.is_not(None),
                _C.expires_at.is_(None),
                _C.expires_at <= now,
            ),
        )
        terminal = [s.value for s in TERMINAL_STATUSES]
        reopenable = [s.value for s in REOPENABLE_STATUSES]
        # The take and its verdict on the stamp set are one statement, as in take_over: a
        # non-idempotent entry standing dead-letters the execution (transitions.decide_acquire).
        # In ON CONFLICT DO UPDATE, fence_leases.* is the row as it stands.
        standing = literal_column(STAMP_SQL[self.dialect]["non_idempotent"], Boolean)
        takeable: ColumnElement[bool] = _C.status.not_in(terminal)
        if reopen:
            takeable = or_(takeable, _C.status.in_(reopenable))
        values: dict[str, Any] = {
            "tenant_id": bindparam("p_tenant_id", type_=Text),
            "execution_id": bindparam("p_execution_id", type_=Text),
            "scope_key": bindparam("p_scope_key", type_=Text),
            "epoch": literal_column(first_token_sql(self.dialect), BigInteger),
            "holder": bindparam("p_holder", type_=Text),
            "expires_at": now + ttl,
            "status": literal(LeaseStatus.RUNNING.value, Text),
            "updated_at": now,
        }
        if self.classified is not None:
            when = self._when_classified(when)
        if when is None:
            stmt = insert(LEASES).values(**values)
        else:
            offered = select(*(value.label(name) for name, value in values.items())).where(when)
            stmt = insert(LEASES).from_select(list(values), offered)
        return stmt.on_conflict_do_update(
            index_elements=[_C.tenant_id, _C.execution_id],
            set_={
                "epoch": self.next_epoch,
                "holder": case((standing, null()), else_=stmt.excluded.holder),
                "expires_at": case((standing, null()), else_=stmt.excluded.expires_at),
                "status": case(
                    (standing, LeaseStatus.DEAD_LETTERED.value),
                    else_=LeaseStatus.RUNNING.value,
                ),
                "reason": case(
                    (standing, self._standing_reason("resumed", stmt.excluded.holder)),
                    else_=null(),
                ),
                # Dead-lettered: the set stays for inspection; taken: it is cleared.
                "pending_effects": case(
                    (standing, _C.pending_effects), else_=literal_column("'{}'")
                ),
                "updated_at": stmt.excluded.updated_at,
            },
            where=and_(takeable, not_held),
        ).returning(*RETURNING)

    def _when_classified(self, condition: Any) -> Any:
        """``condition``, and (under quarantine) the failover's executions classified."""
        if self.classified is None:
            return condition
        return self.classified if condition is None else and_(condition, self.classified)

    def _standing_reason(self, how: str, holder: Any) -> ColumnElement[str]:
        """The dead letter's reason for the stamps standing on the row, built in SQL as
        :func:`~langgraph_fence.lease.transitions.dead_letter_reason` builds it (``how``:
        "taken over",
        "resumed"), at the token the statement moves the row to."""
        reason: ColumnElement[str] = (
            literal(f"{how} at token ", Text)
            + cast(self.next_epoch, Text)
            + literal(" by ", Text)
            + holder
            + literal(": non-idempotent writes stamped and never cleared: ", Text)
            + literal_column(STAMP_SQL[self.dialect]["standing_writes"], Text)
            + literal("; they may have happened, so the execution is not repeated", Text)
        )
        return reason

    def _take_over(self, now: ColumnElement[float], ttl: Any) -> Any:
        # The take and the decision are one statement, on the row as it is now: the stamp
        # set read with the candidate may have changed since (an expired holder may still
        # stamp).
        stamps = STAMP_SQL[self.dialect]
        non_idempotent = literal_column(stamps["non_idempotent"], Boolean)
        holder = bindparam("p_holder", type_=Text)
        reason = self._standing_reason("taken over", holder)
        takeable = _takeable(now)
        # The takeover budget, as transitions.decide_take_over counts it: a mark other than the
        # stored one is progress; a take from an expired holder (status still running)
        # counts 1. p_max is a huge number when there is no budget.
        mark = bindparam("p_progress_mark", type_=Text)
        max_takeovers = bindparam("p_max_takeovers", type_=Integer)
        crashed = _C.status == LeaseStatus.RUNNING.value
        takeovers = case((_C.progress_mark.is_distinct_from(mark), 0), else_=_C.takeovers) + case(
            (crashed, 1), else_=0
        )
        over_budget = and_(crashed, takeovers > max_takeovers)
        budget = (
            literal("taken over at token ", Text)
            + cast(self.next_epoch, Text)
            + literal(" by ", Text)
            + holder
            + literal(": crashed ", Text)
            + cast(_C.takeovers, Text)
            + literal(" workers in a row with no new checkpoint (the last ", Text)
            + func.coalesce(_C.holder, literal("", Text))
            + literal(" at token ", Text)
            + cast(_C.epoch, Text)
            + literal(
                ", where serve() ran it alone: the likely cause), over the takeover budget "
                "(max_takeovers=",
                Text,
            )
            + cast(max_takeovers, Text)
            + literal("); fix the step, then `langgraph-fence resolve --retry` runs it again", Text)
        )
        dead = or_(non_idempotent, over_budget)
        return (
            update(LEASES)
            .where(self._when_classified(and_(_KEY, _C.epoch == bindparam("p_epoch"), takeable)))
            .values(
                epoch=self.next_epoch,
                holder=case((dead, null()), else_=holder),
                expires_at=case((dead, null()), else_=now + ttl),
                status=case(
                    (dead, LeaseStatus.DEAD_LETTERED.value),
                    else_=LeaseStatus.RUNNING.value,
                ),
                reason=case((non_idempotent, reason), (over_budget, budget), else_=null()),
                # Dead-lettered: the set stays for inspection; resumed: it is cleared.
                pending_effects=case((dead, _C.pending_effects), else_=literal_column("'{}'")),
                takeovers=takeovers,
                progress_mark=mark,
                updated_at=now,
            )
            .returning(*RETURNING)
        )

    def _renew_many(self) -> Any:
        """Renew many holds in one statement: the leases come as one JSON parameter (the
        same statement text for any number, so it is compiled and prepared once), each row
        guarded by :func:`~langgraph_fence.lease.guard.guard_sql` against its own hold."""
        now = self.now_sql
        if self.dialect == "postgresql":
            columns = "t text, e text, h text, ep bigint"
            holds = f"jsonb_to_recordset(CAST(:p_leases AS jsonb)) AS v({columns})"
        else:
            holds = (
                "(SELECT json_extract(value, '$.t') AS t, json_extract(value, '$.e') AS e, "
                "json_extract(value, '$.h') AS h, json_extract(value, '$.ep') AS ep "
                "FROM json_each(:p_leases)) AS v"
            )
        guard = guard_sql(tenant_id="v.t", execution_id="v.e", holder="v.h", epoch="v.ep")
        returning = ", ".join(column.name for column in RETURNING)
        return text(
            f"UPDATE {LEASES.name} SET expires_at = {now} + CAST(:p_ttl AS DOUBLE PRECISION), "
            f"updated_at = {now} "
            f"FROM {holds} WHERE {guard} RETURNING {returning}"
        ).columns(*RETURNING)


def _takeable(now: ColumnElement[float]) -> ColumnElement[bool]:
    """:func:`~langgraph_fence.lease.transitions.is_takeover_candidate` in SQL: running and
    expired, or pending, free, and past its not-before time when it has one (a woken yielded
    tree)."""
    return or_(
        and_(
            _C.status == LeaseStatus.RUNNING.value,
            or_(_C.expires_at.is_(None), _C.expires_at <= now),
        ),
        and_(
            _C.status == LeaseStatus.PENDING.value,
            _C.holder.is_(None),
            or_(_C.expires_at.is_(None), _C.expires_at <= now),
        ),
    )


#: The statuses ``fence_leases_takeable`` indexes, as constants: a planner proves a partial
#: index's predicate only from literals, never from bound parameters.
_RUNNING = literal_column("'running'", Text)
_INDEXED = (literal_column("'pending'", Text), _RUNNING)
_NO_EXPIRY = literal_column("0.0", Double)
_ONE = literal_column("1", Integer)


def _expiry(columns: Any) -> ColumnElement[float]:
    """A row's expiry as ``fence_leases_takeable`` holds it (a pending row's NULL counts as
    0): the expression must be the index's own for a planner to use the index."""
    return func.coalesce(columns.expires_at, _NO_EXPIRY)


def _age(columns: Any, *, labelled: bool = False) -> tuple[Any, ...]:
    """The order of a tenant's candidates: the longest expired or waiting first (the
    columns of ``fence_leases_takeable`` after the tenant)."""
    age = (_expiry(columns), columns.updated_at, columns.scope_key)
    if not labelled:
        return age
    names = ("age", "age_updated", "age_key")
    return tuple(column.label(name) for column, name in zip(age, names, strict=True))


def _in_index(columns: Any, now: ColumnElement[float]) -> ColumnElement[bool]:
    """:func:`_takeable`, said as a range of ``fence_leases_takeable`` (so a read stops at
    the first row still held) and the one test the range leaves: the rows whose time has
    come, but for a pending one that somebody holds. The same rows as :func:`_takeable`'s,
    as a store's clock is never below 0, the age of a row with no expiry.

    Every constant is a literal, and no test of the status is split by an ``OR``: with the
    statuses bound, or their selectivity counted twice, PostgreSQL's custom plans read each
    tenant's rows from another index and sort its whole backlog.
    """
    return and_(
        columns.status.in_(_INDEXED),
        _expiry(columns) <= now,
        or_(columns.status == _RUNNING, columns.holder.is_(None)),
    )


def _on_index(query: Any, aliases: tuple[Any, ...]) -> Any:
    """``query`` on SQLite, each of ``aliases`` read through ``fence_leases_takeable``
    (``INDEXED BY``, which SQLAlchemy does not render for SQLite). langgraph-fence never
    analyses a SQLite database, and with no statistics its planner reads a status's rows from
    another index and sorts them at each step of the walk. A missing index then fails the
    read loudly rather than slowly."""
    compiled = query.compile(dialect=sqlite_dialect.dialect(paramstyle="named"))
    sql = str(compiled)
    for alias in aliases:
        plain = f"fence_leases AS {alias.name}"
        if sql.count(plain) != 1:
            raise AssertionError(f"the window's SQL names {plain!r} {sql.count(plain)} times")
        sql = sql.replace(plain, f"{plain} INDEXED BY fence_leases_takeable")
    constants = {k: v for k, v in compiled.params.items() if k not in ("p_now", "p_limit")}
    columns = [LEASES.c[column.name] for column in RETURNING]
    return text(sql).bindparams(**constants).columns(*columns)

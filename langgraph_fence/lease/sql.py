"""The SQL lease store: SQLAlchemy 2 async Core on SQLite (aiosqlite) and PostgreSQL (asyncpg).

Every operation is ONE statement (an upsert guarded by expiry, or an update guarded by key +
holder + epoch, each with ``RETURNING``); on PostgreSQL it runs in autocommit, so it costs
one round trip. Only a refused operation pays a second read, to report the epoch it saw.

The statements are SQLAlchemy constructs, written once for both databases. The writes (a
run's take and release among them) run on the driver, each construct compiled once for the
engine's dialect, on connections kept checked out (:mod:`langgraph_fence.database.driver`): a run
pays the round trip, not SQLAlchemy's per-statement CPU. The reads and the batched
renewals (on a pool of their own) go through SQLAlchemy.
"""

from __future__ import annotations

import copy
import json
import sqlite3
import time
from collections.abc import AsyncIterator, Callable, Iterable, Mapping, Sequence
from contextlib import asynccontextmanager
from typing import Any, NamedTuple

from sqlalchemy import (
    Boolean,
    ColumnElement,
    Double,
    Integer,
    Text,
    and_,
    bindparam,
    case,
    cast,
    exists,
    func,
    literal,
    literal_column,
    null,
    or_,
    select,
    text,
    true,
    union_all,
    update,
)
from sqlalchemy.dialects import postgresql as pg_dialect
from sqlalchemy.dialects import sqlite as sqlite_dialect
from sqlalchemy.engine import Row
from sqlalchemy.ext.asyncio import AsyncEngine

from langgraph_fence._compat import aiosqlite_call
from langgraph_fence.database import (
    autocommit,
    check_engine,
    create_engine,
    own_pool,
    read_only,
    single_statement,
)
from langgraph_fence.database.driver import Connections, DriverStatement, fetch, sqlite_fetch
from langgraph_fence.database.migrations import migrate
from langgraph_fence.database.retry import retry_connection_errors
from langgraph_fence.errors import ExecutionFencedError
from langgraph_fence.lease import (
    REOPENABLE_STATUSES,
    RESOLVABLE_STATUSES,
    TERMINAL_STATUSES,
    Lease,
    LeaseKey,
    LeaseStatus,
    PendingEffect,
    clean_reason,
    validate_holder,
    validate_pending_effect,
    validate_ttl,
)
from langgraph_fence.lease.checks import check_key, check_lease, check_leases, check_limit
from langgraph_fence.lease.guard import guard_sql
from langgraph_fence.lease.schema import (
    LEASE_MIGRATIONS,
    LEASES,
    STAMP_SQL,
    effects_from_json,
    not_yielded,
    stamp_patch,
)
from langgraph_fence.lease.transitions import (
    abandon_reason,
    decide_abandon,
    decide_dead_letter,
    decide_retry,
    fair_order,
    fenced_error,
    is_yielded,
    release_status,
    validate_effect_keys,
    validate_max_takeovers,
    validate_progress_mark,
)
from langgraph_fence.validate import text_id

__all__ = ["SqlLeaseRepository", "Taken"]

#: The record's columns :meth:`SqlLeaseRepository.take` binds by name (``recorded_at``
#: comes as ``at``, ``thread_id`` is the take's own).
_RECORD_BINDS = ("graph", "input_type", "input", "run_type", "run")


class Taken(NamedTuple):
    """What :meth:`SqlLeaseRepository.take` did: the lease taken (or ``None``) and the
    execution id the thread is bound to (``None``: take again)."""

    lease: Lease | None
    bound: str | None


_C = LEASES.c
# The statuses an operator resolves, in a stable order (one cached statement).
_RESOLVABLE = sorted(status.value for status in RESOLVABLE_STATUSES)
_RETURNING = (
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


class SqlLeaseRepository:
    """An :class:`~langgraph_fence.ExecutionLeaseRepository` on SQLite or PostgreSQL.

    Build it as ``SqlLeaseRepository(engine)`` then ``await repo.setup()``, or as
    ``async with SqlLeaseRepository.from_conn_string(url) as repo:``.

    Args:
        engine: an engine from :func:`langgraph_fence.database.create_engine` (PostgreSQL in
            autocommit, SQLite with ``BEGIN IMMEDIATE``); any PostgreSQL engine works, a
            SQLite one made otherwise is refused (:func:`~langgraph_fence.database.check_engine`).
        clock: the store's clock. ``None`` (the default) means the database's own clock on
            PostgreSQL (``now()``) and this process's ``time.time`` on SQLite. Tests pass a
            controlled clock.

    From its first write the store keeps up to a quarter of the engine's pool checked out
    (at least one connection) for its next writes, until :meth:`aclose` or the engine is
    disposed of: build one store per engine and share it, not one per call.
    """

    def __init__(self, engine: AsyncEngine, *, clock: Callable[[], float] | None = None) -> None:
        self._dialect = check_engine(engine)
        self._engine = engine
        # Reads (get, takeover_candidates) never take SQLite's write lock.
        self._reader = read_only(engine)
        # Every write is one statement, on a held driver connection in autocommit (SQLite's
        # are, asyncpg's are outside a transaction): no BEGIN/COMMIT around it. A burst of
        # starts spills over to the pool rather than queue behind the held few.
        self._connections = Connections(engine, share=4, spill=True)
        self._compiled: dict[int, tuple[Any, DriverStatement]] = {}
        # Renewals on a pool of their own (PostgreSQL): a burst of starts or checkpoint
        # writes holding every pooled connection must not make them wait.
        self._renewals = (
            own_pool(engine)
            if self._dialect == "postgresql"
            else single_statement(autocommit(engine))
        )
        if self._dialect == "sqlite" and clock is None:
            clock = time.time
        self._clock = clock
        url = engine.url.render_as_string(hide_password=True)
        self._store_id = f"sql:{url}"
        self._build_statements()
        self._takes: dict[bool, Any] = {}

    def on_engine(self, engine: AsyncEngine) -> SqlLeaseRepository:
        """This store (same table, same clock, same statements) through ``engine``, an
        engine on the same database (:func:`~langgraph_fence.database.twin_engine`): for
        calls from another event loop, whose connections must be its own. Leases pass
        between the two."""
        twin = copy.copy(self)
        twin._dialect = check_engine(engine)
        twin._engine = engine
        twin._reader = read_only(engine)
        # Driver connections of its own: held ones belong to the loop that opened them.
        twin._connections = Connections(engine, share=4, spill=True)
        twin._compiled = {}
        twin._renewals = single_statement(autocommit(engine))  # a pool of its own already
        twin._takes = {}
        return twin

    @classmethod
    @asynccontextmanager
    async def from_conn_string(
        cls, url: str, *, clock: Callable[[], float] | None = None, schema: str | None = None
    ) -> AsyncIterator[SqlLeaseRepository]:
        """Open an engine on ``url`` (in ``schema`` on PostgreSQL, created if missing: see
        :func:`langgraph_fence.database.create_engine`), migrate, yield the store, and
        dispose of the engine."""
        engine = create_engine(url, schema=schema)
        try:
            repo = cls(engine, clock=clock)
            await repo.setup()
            yield repo
            await repo.aclose()
        finally:
            await engine.dispose()

    async def aclose(self) -> None:
        """Give the connections this store holds back to the engine's pool (disposing of
        the engine closes them too)."""
        await self._connections.aclose()

    @property
    def engine(self) -> AsyncEngine:
        """The engine this store writes through."""
        return self._engine

    @property
    def store_id(self) -> str:
        """Identifies this store (its database); leases carry it and other stores refuse them."""
        return self._store_id

    async def setup(self) -> None:
        """Create or upgrade the lease table and, beside it, the execution records' tables
        (an :class:`~langgraph_fence.Instance` built on this store keeps its records there,
        where every other instance looks); safe from several processes at once."""
        await migrate(self._engine, "leases", LEASE_MIGRATIONS)
        # Imported here: the records' module needs LangGraph's serializer, which the CLI's
        # listings (a lease store, no records) must not load.
        from langgraph_fence.lease.records import EXECUTION_MIGRATIONS

        await migrate(self._engine, "executions", EXECUTION_MIGRATIONS)

    # -- statements, built once so SQLAlchemy's compiled cache and asyncpg's prepared
    # statement cache serve every call.

    def _now(self) -> ColumnElement[float]:
        if self._clock is None:
            return cast(func.extract("epoch", func.now()), Double)
        return bindparam("p_now", type_=Double)

    def _build_statements(self) -> None:
        now = self._now()
        ttl = bindparam("p_ttl", type_=Double)
        self._acquire = {reopen: self._acquire_upsert(reopen=reopen) for reopen in (False, True)}
        self._renew = (
            update(LEASES)
            .where(_GUARD)
            .values(expires_at=now + ttl, updated_at=now)
            .returning(*_RETURNING)
        )
        self._build_rest(now, ttl)

    def _acquire_upsert(self, *, reopen: bool, when: Any = None) -> Any:
        """The acquire: one upsert that decides the next token and the stamps it finds.

        With ``when`` (a condition), the row is offered only where it holds (``INSERT ...
        SELECT ... WHERE``): nothing is inserted or updated where it does not (the take of
        a run, :meth:`take`).
        """
        now = self._now()
        ttl = bindparam("p_ttl", type_=Double)
        insert = pg_dialect.insert if self._dialect == "postgresql" else sqlite_dialect.insert
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
        standing = literal_column(STAMP_SQL[self._dialect]["non_idempotent"], Boolean)
        takeable: ColumnElement[bool] = _C.status.not_in(terminal)
        if reopen:
            takeable = or_(takeable, _C.status.in_(reopenable))
        values: dict[str, Any] = {
            "tenant_id": bindparam("p_tenant_id", type_=Text),
            "execution_id": bindparam("p_execution_id", type_=Text),
            "scope_key": bindparam("p_scope_key", type_=Text),
            "epoch": literal(1, Integer),
            "holder": bindparam("p_holder", type_=Text),
            "expires_at": now + ttl,
            "status": literal(LeaseStatus.RUNNING.value, Text),
            "updated_at": now,
        }
        if when is None:
            stmt = insert(LEASES).values(**values)
        else:
            offered = select(*(value.label(name) for name, value in values.items())).where(when)
            stmt = insert(LEASES).from_select(list(values), offered)
        return stmt.on_conflict_do_update(
            index_elements=[_C.tenant_id, _C.execution_id],
            set_={
                "epoch": _C.epoch + 1,
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
        ).returning(*_RETURNING)

    def _build_rest(self, now: ColumnElement[float], ttl: Any) -> None:
        stamps = STAMP_SQL[self._dialect]
        self._renew_many = self._build_renew_many()
        self._yield = (
            update(LEASES)
            .where(_GUARD)
            .values(status=LeaseStatus.WAITING.value, expires_at=None, updated_at=now)
            .returning(*_RETURNING)
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
        self._retake = (
            update(LEASES)
            .where(retakeable)
            .values(
                epoch=_C.epoch + 1,
                holder=bindparam("p_holder"),
                expires_at=now + ttl,
                status=LeaseStatus.RUNNING.value,
                reason=None,
                updated_at=now,
            )
            .returning(*_RETURNING)
        )
        patched = text(stamps["patch"].format(param=":p_patch"))
        status = bindparam("p_status", type_=Text)
        self._release = (
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
            .returning(*_RETURNING)
        )
        # Stamping and clearing both apply a merge patch to the stamp set.
        self._patch = (
            update(LEASES)
            .where(_GUARD)
            .values(pending_effects=patched, updated_at=now)
            .returning(*_RETURNING)
        )
        self._patch_renew = (
            update(LEASES)
            .where(_GUARD)
            .values(pending_effects=patched, expires_at=now + ttl, updated_at=now)
            .returning(*_RETURNING)
        )
        self._clear_all = (
            update(LEASES)
            .where(_GUARD)
            .values(pending_effects=literal_column("'{}'"), updated_at=now)
            .returning(*_RETURNING)
        )
        dead_letter_values = {
            "holder": None,
            "expires_at": None,
            "status": LeaseStatus.DEAD_LETTERED.value,
            "reason": bindparam("p_reason"),
            "updated_at": now,
        }
        self._dead_letter = (
            update(LEASES).where(_KEY).values(**dead_letter_values).returning(*_RETURNING)
        )
        self._dead_letter_at_epoch = (
            update(LEASES)
            .where(and_(_KEY, _C.epoch == bindparam("p_epoch")))
            .values(**dead_letter_values)
            .returning(*_RETURNING)
        )
        self._get = select(*_RETURNING).where(_KEY)
        _age = (func.coalesce(_C.expires_at, literal(0.0)), _C.updated_at, _C.scope_key)
        self._candidates = (
            select(*_RETURNING)
            .where(_takeable(now))
            # Fair across tenants: each tenant's oldest candidate first, then each one's
            # second, ... (round-robin by tenant), so one tenant's burst of submitted runs
            # does not starve the others; within a tenant, the longest expired or waiting.
            .order_by(
                func.row_number().over(partition_by=_C.tenant_id, order_by=_age),
                *_age,
            )
            .limit(bindparam("p_limit"))
        )
        self._now_stmt = select(now)
        self._take_over = self._build_take_over(now, ttl)
        non_idempotent = literal_column(stamps["non_idempotent"], Boolean)
        self._retry = (
            update(LEASES)
            .where(and_(_KEY, _C.status.in_(_RESOLVABLE), ~non_idempotent))
            .values(
                holder=None,
                expires_at=None,
                status=LeaseStatus.PENDING.value,
                reason=None,
                takeovers=0,
                updated_at=now,
            )
            .returning(*_RETURNING)
        )
        self._abandon = (
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
            .returning(*_RETURNING)
        )

    def _standing_reason(self, how: str, holder: Any) -> ColumnElement[str]:
        """The dead letter's reason for the stamps standing on the row, built in SQL as
        :func:`~langgraph_fence.lease.transitions.dead_letter_reason` builds it (``how``:
        "taken over",
        "resumed"), at the token the statement moves the row to."""
        reason: ColumnElement[str] = (
            literal(f"{how} at token ", Text)
            + cast(_C.epoch + 1, Text)
            + literal(" by ", Text)
            + holder
            + literal(": non-idempotent writes stamped and never cleared: ", Text)
            + literal_column(STAMP_SQL[self._dialect]["standing_writes"], Text)
            + literal("; they may have happened, so the execution is not repeated", Text)
        )
        return reason

    def _build_take_over(self, now: ColumnElement[float], ttl: Any) -> Any:
        # The take and the decision are one statement, on the row as it is now: the stamp
        # set read with the candidate may have changed since (an expired holder may still
        # stamp).
        stamps = STAMP_SQL[self._dialect]
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
            + cast(_C.epoch + 1, Text)
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
            .where(and_(_KEY, _C.epoch == bindparam("p_epoch"), takeable))
            .values(
                epoch=_C.epoch + 1,
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
            .returning(*_RETURNING)
        )

    @property
    def now_sql(self) -> str:
        """The store's clock as SQL text, for a textual statement on ``fence_leases`` (this
        store's renewals, the run queue's lease writes); bind :meth:`now_params` with it."""
        if self._clock is not None:
            return "CAST(:p_now AS DOUBLE PRECISION)"
        return "CAST(EXTRACT(epoch FROM now()) AS DOUBLE PRECISION)"

    def now_params(self) -> dict[str, float]:
        """The parameters :attr:`now_sql` needs now (none for the database's own clock)."""
        return {} if self._clock is None else {"p_now": self._clock()}

    def _build_renew_many(self) -> Any:
        """Renew many holds in one statement: the leases come as one JSON parameter (the
        same statement text for any number, so it is compiled and prepared once), each row
        guarded by :func:`~langgraph_fence.lease.guard.guard_sql` against its own hold."""
        now = self.now_sql
        if self._dialect == "postgresql":
            columns = "t text, e text, h text, ep bigint"
            holds = f"jsonb_to_recordset(CAST(:p_leases AS jsonb)) AS v({columns})"
        else:
            holds = (
                "(SELECT json_extract(value, '$.t') AS t, json_extract(value, '$.e') AS e, "
                "json_extract(value, '$.h') AS h, json_extract(value, '$.ep') AS ep "
                "FROM json_each(:p_leases)) AS v"
            )
        guard = guard_sql(tenant_id="v.t", execution_id="v.e", holder="v.h", epoch="v.ep")
        returning = ", ".join(column.name for column in _RETURNING)
        return text(
            f"UPDATE {LEASES.name} SET expires_at = {now} + CAST(:p_ttl AS DOUBLE PRECISION), "
            f"updated_at = {now} "
            f"FROM {holds} WHERE {guard} RETURNING {returning}"
        ).columns(*_RETURNING)

    # -- I/O

    def _params(self, **values: Any) -> dict[str, Any]:
        # Bound names carry a p_ prefix: SQLAlchemy reserves the bare column names.
        params = {f"p_{name}": value for name, value in values.items()}
        if self._clock is not None:
            params["p_now"] = self._clock()
        return params

    def _driver_statement(self, stmt: Any) -> DriverStatement:
        # Keyed by identity: the constructs live as long as the store, built once.
        found = self._compiled.get(id(stmt))
        if found is None:
            found = self._compiled[id(stmt)] = (stmt, DriverStatement(stmt, self._engine.dialect))
        return found[1]

    async def _one(self, stmt: Any, params: dict[str, Any]) -> Any:
        """Run one write statement, once: acquire, take_over, dead_letter and retry are not
        repeated after a connection error (a repeat of one that landed would be refused).
        Its first row (by column name), or ``None``."""
        compiled = self._driver_statement(stmt)
        async with self._connections() as driver:
            rows = await fetch(driver, compiled, params)
        return rows[0] if rows else None

    async def _read(self, stmt: Any, params: dict[str, Any], *, what: str) -> list[Row[Any]]:
        """Run one read statement, retried on a connection error."""

        async def once() -> list[Row[Any]]:
            async with self._reader.connect() as conn:
                return list((await conn.execute(stmt, params)).all())

        return await retry_connection_errors(once, what=what)

    def _lease(self, row: Row[Any] | Mapping[str, Any]) -> Lease:
        """The lease of a row: SQLAlchemy's, or a driver's (asyncpg's, sqlite3's)."""
        found: Any = row._mapping if isinstance(row, Row) else row
        return Lease(
            key=LeaseKey(found["tenant_id"], found["execution_id"]),
            holder=found["holder"],
            epoch=found["epoch"],
            expires_at=found["expires_at"],
            pending_effects=effects_from_json(found["pending_effects"]),
            status=LeaseStatus(found["status"]),
            reason=found["reason"],
            store_id=self._store_id,
            takeovers=found["takeovers"],
            progress_mark=found["progress_mark"],
        )

    async def now(self) -> float:
        """The store's clock, in seconds."""
        if self._clock is not None:
            return self._clock()
        rows = await self._read(self._now_stmt, {}, what="now")
        return float(rows[0][0])

    def _acquire_params(
        self, key: LeaseKey, holder: str, ttl: float, **extra: Any
    ) -> dict[str, Any]:
        check_key(key)
        validate_holder(holder)
        return self._params(
            tenant_id=key.tenant_id,
            execution_id=key.execution_id,
            scope_key=key.scope_key,
            holder=holder,
            ttl=validate_ttl(ttl),
            **extra,
        )

    async def acquire(
        self, key: LeaseKey, holder: str, ttl: float, *, reopen: bool = False
    ) -> Lease | None:
        """Take the lease (absent: epoch 1; free or expired: epoch + 1), or ``None``: one
        statement, which dead-letters instead while a non-idempotent stamp stands
        (:func:`~langgraph_fence.lease.transitions.decide_acquire`)."""
        params = self._acquire_params(key, holder, ttl)
        # Not repeated (see _one): the caller gets the error; nothing runs.
        row = await self._one(self._acquire[bool(reopen)], params)
        return None if row is None else self._lease(row)

    async def take(
        self,
        key: LeaseKey,
        holder: str,
        ttl: float,
        *,
        thread_id: str,
        record: Mapping[str, Any] | None = None,
    ) -> Taken:
        """Start a run of ``key`` on the tenant's ``thread_id``: one statement on
        PostgreSQL, one transaction on SQLite.

        Binds the thread to ``key`` unless it is bound; takes the lease (as :meth:`acquire`
        with ``reopen``) only if the thread is bound to ``key`` and, for a run with a
        ``record``, no submitted run of the execution waits for a worker; writes ``record``
        (the columns of :meth:`~langgraph_fence.lease.records.SqlExecutionRecords.columns`) only
        if the lease was taken, so a refused start never rewrites the record of the run in
        flight. Not repeated after a connection error (as :meth:`acquire`): the caller gets
        the error, and a take that landed unheard expires and is taken over with its record.

        Returns:
            The lease taken (``None``: refused; the caller asks why), and the execution id
            the thread is bound to (``None`` on PostgreSQL when a racing first run of the
            thread bound it after this statement began: nothing was written; take again).
        """
        text_id("thread_id", thread_id, what="the thread the run is of")
        params = self._acquire_params(key, holder, ttl, thread_id=thread_id, at=time.time())
        if record is not None:
            params.update({f"p_{name}": record[name] for name in _RECORD_BINDS})
            params["p_recorded_at"] = record["at"]
        stmt = self._take_statement(with_record=record is not None)
        if self._dialect == "postgresql":
            row = await self._one(stmt, params)
            assert row is not None  # the statement returns one row, taken or not
            return Taken(None if row["epoch"] is None else self._lease(row), row["bound"])
        from langgraph_fence.lease.records import BIND_THREAD, BOUND_TO, UPSERT_RECORD

        bind, take, bound_to, upsert = (
            self._driver_statement(s) for s in (BIND_THREAD, stmt, BOUND_TO, UPSERT_RECORD)
        )
        binding = {"tenant_id": key.tenant_id, "thread_id": thread_id}

        def body(conn: sqlite3.Connection) -> tuple[Any, str]:
            # BEGIN IMMEDIATE: the write lock from the first statement on, so no other
            # writer comes between the binding, the lease and the record. The whole
            # transaction is one call on the connection's thread: one hop, not five.
            conn.execute("BEGIN IMMEDIATE")
            try:
                sqlite_fetch(
                    conn, bind, {**binding, "execution_id": key.execution_id, "at": params["p_at"]}
                )
                rows = sqlite_fetch(conn, take, params)
                if rows:
                    if record is not None:
                        sqlite_fetch(conn, upsert, record)
                    found: tuple[Any, str] = (rows[0], key.execution_id)
                else:
                    found = (None, sqlite_fetch(conn, bound_to, binding)[0]["execution_id"])
                conn.execute("COMMIT")
            except BaseException:
                if conn.in_transaction:
                    conn.execute("ROLLBACK")
                raise
            return found

        async with self._connections() as driver:
            row, bound = await aiosqlite_call(driver, body)
        return Taken(None if row is None else self._lease(row), bound)

    def _take_statement(self, *, with_record: bool) -> Any:
        stmt = self._takes.get(with_record)
        if stmt is None:
            stmt = self._takes[with_record] = self._build_take(with_record=with_record)
        return stmt

    def _build_take(self, *, with_record: bool) -> Any:
        """The take's lease statement (SQLite: the acquire offered only where the thread is
        bound to the key), or the whole take as one statement of CTEs (PostgreSQL)."""
        # Imported here: the records' module loads LangGraph's serializer, which the CLI's
        # listings (a lease store, no runs) must not.
        from langgraph_fence.lease.records import (
            BINDINGS,
            CLEARED,
            EXECUTIONS,
            RECORDED,
            SUBMIT_WAITING,
        )

        tenant = bindparam("p_tenant_id", type_=Text)
        thread = bindparam("p_thread_id", type_=Text)
        execution = bindparam("p_execution_id", type_=Text)
        # New input is refused while a submitted run waits (run.py says so with the reason).
        no_submit_waiting = text(
            "NOT EXISTS (SELECT 1 FROM fence_leases l WHERE l.tenant_id = :p_tenant_id "
            f"AND l.execution_id = :p_execution_id AND {SUBMIT_WAITING})"
        )
        b = BINDINGS.c
        if self._dialect == "sqlite":
            # The binding was written (or found) by the transaction's first statement.
            when: Any = exists().where(
                b.tenant_id == tenant, b.thread_id == thread, b.execution_id == execution
            )
            if with_record:
                when = and_(when, no_submit_waiting)
            return self._acquire_upsert(reopen=True, when=when)
        # PostgreSQL: every part sees the table as it was when the statement began, and the
        # parts see each other's rows only through RETURNING. A first run that loses the
        # race to bind the thread finds no binding at all (its insert met the winner's row,
        # which its snapshot does not show): it takes nothing and writes nothing.
        existing = (select(b.execution_id).where(b.tenant_id == tenant, b.thread_id == thread)).cte(
            "existing"
        )
        bind = pg_dialect.insert(BINDINGS).from_select(
            ["tenant_id", "thread_id", "execution_id", "bound_at"],
            select(tenant, thread, execution, bindparam("p_at", type_=Double)).where(
                ~exists(select(existing.c.execution_id))
            ),
        )
        inserted = (
            bind.on_conflict_do_nothing(index_elements=["tenant_id", "thread_id"])
            .returning(b.execution_id)
            .cte("inserted")
        )
        binding = union_all(select(existing.c.execution_id), select(inserted.c.execution_id)).cte(
            "binding"
        )
        when = exists(select(binding.c.execution_id).where(binding.c.execution_id == execution))
        if with_record:
            when = and_(when, no_submit_waiting)
        taken = self._acquire_upsert(reopen=True, when=when).cte("taken")
        one = select(literal(1, Integer).label("one")).subquery("one")
        stmt = select(
            select(binding.c.execution_id).limit(1).scalar_subquery().label("bound"),
            *taken.c,
        ).select_from(one.outerjoin(taken, true()))
        if not with_record:
            return stmt
        e = EXECUTIONS.c
        offered = select(
            tenant,
            execution,
            *(bindparam(f"p_{name}", type_=e[name].type) for name in RECORDED),
        ).where(exists(select(taken.c.epoch)))
        record = pg_dialect.insert(EXECUTIONS).from_select(
            ["tenant_id", "execution_id", *RECORDED], offered
        )
        upsert = record.on_conflict_do_update(
            index_elements=["tenant_id", "execution_id"],
            set_={
                **{name: record.excluded[name] for name in RECORDED},
                **dict.fromkeys(CLEARED, null()),
            },
        ).returning(e.tenant_id)
        return stmt.add_cte(upsert.cte("recorded"))

    async def _guarded(
        self,
        stmt: Any,
        lease: Lease,
        action: str,
        *,
        landed: Callable[[Lease], bool] | None = None,
        **extra: Any,
    ) -> Lease:
        """One statement guarded by holder + epoch, repeated on a connection error (the
        guard decides again). ``landed(current)`` tells, for an operation whose repeat the
        guard refuses, that an earlier attempt landed before its connection died."""
        params = self._params(
            tenant_id=lease.key.tenant_id,
            execution_id=lease.key.execution_id,
            holder=lease.holder,
            epoch=lease.epoch,
            **extra,
        )
        tries = 0

        async def once() -> Any:
            nonlocal tries
            tries += 1
            return await self._one(stmt, params)

        row = await retry_connection_errors(once, what=action)
        if row is None:
            current = await self.get(lease.key)
            if tries > 1 and landed is not None and current is not None and landed(current):
                return current
            raise fenced_error(lease, current, action=action)
        return self._lease(row)

    async def renew(self, lease: Lease, ttl: float) -> Lease:
        """Extend the hold to store-now + ``ttl``; guarded."""
        check_lease(self, lease)
        return await self._guarded(self._renew, lease, "renew", ttl=validate_ttl(ttl))

    async def renew_many(
        self, leases: Sequence[Lease], ttl: float
    ) -> list[Lease | ExecutionFencedError]:
        """Renew each of ``leases`` (guarded, each on its own) in one statement, repeated on
        a connection error (renewing again is harmless); a refused lease costs one read, for
        the epoch its refusal names."""
        leases = check_leases(self, leases)
        if not leases:
            return []
        params = self._params(
            ttl=validate_ttl(ttl),
            leases=json.dumps(
                [
                    {
                        "t": lease.key.tenant_id,
                        "e": lease.key.execution_id,
                        "h": lease.holder,
                        "ep": lease.epoch,
                    }
                    for lease in leases
                ]
            ),
        )

        async def once() -> list[Row[Any]]:
            async with self._renewals.connect() as conn:
                return list((await conn.execute(self._renew_many, params)).all())

        rows = await retry_connection_errors(once, what="renew_many")
        renewed = {(row.tenant_id, row.execution_id): self._lease(row) for row in rows}
        answers: list[Lease | ExecutionFencedError] = []
        for lease in leases:
            got = renewed.get((lease.key.tenant_id, lease.key.execution_id))
            if got is None:
                answers.append(fenced_error(lease, await self.get(lease.key), action="renew"))
            else:
                answers.append(got)
        return answers

    async def release(self, lease: Lease, status: LeaseStatus, reason: str | None = None) -> Lease:
        """Give the lease up with ``status`` (pending, waiting, done, failed); guarded."""
        check_lease(self, lease)
        status = release_status(status)

        def landed(current: Lease) -> bool:
            return current.epoch == lease.epoch and current.status is status

        return await self._guarded(
            self._release,
            lease,
            "release",
            landed=landed,
            status=status.value,
            reason=clean_reason(reason),
        )

    async def get(self, key: LeaseKey) -> Lease | None:
        """The lease of ``key`` as stored now, or ``None``."""
        check_key(key)
        rows = await self._read(
            self._get,
            {"p_tenant_id": key.tenant_id, "p_execution_id": key.execution_id},
            what="get",
        )
        return self._lease(rows[0]) if rows else None

    async def mark_pending_effect(self, lease: Lease, effect: PendingEffect, ttl: float) -> Lease:
        """Add ``effect`` to the stamp set and renew, in one guarded write."""
        check_lease(self, lease)
        ttl = validate_ttl(ttl)
        effect = validate_pending_effect(effect)
        return await self._guarded(
            self._patch_renew, lease, "mark_pending_effect", ttl=ttl, patch=stamp_patch([effect])
        )

    async def clear_pending_effects(self, lease: Lease, keys: Iterable[str] | None = None) -> Lease:
        """Remove the entries ``keys`` (all with ``None``) from the stamp set; guarded."""
        check_lease(self, lease)
        wanted = validate_effect_keys(keys)
        if wanted is None:
            return await self._guarded(self._clear_all, lease, "clear_pending_effects")
        return await self._guarded(
            self._patch, lease, "clear_pending_effects", patch=stamp_patch(remove=wanted)
        )

    async def dead_letter(self, key: LeaseKey, reason: str, *, epoch: int | None = None) -> Lease:
        """End the execution as ``dead_lettered``; guarded by ``epoch`` when given."""
        check_key(key)
        reason = clean_reason(reason, required=True)
        params = self._params(tenant_id=key.tenant_id, execution_id=key.execution_id, reason=reason)
        if epoch is None:
            row = await self._one(self._dead_letter, params)
        else:
            params["p_epoch"] = epoch
            row = await self._one(self._dead_letter_at_epoch, params)
        if row is None:
            # Refused: let the pure decision say why (no row, or the epoch moved).
            current = await self.get(key)
            decide_dead_letter(current, key, reason, epoch=epoch)
            # The row appeared at that very epoch between the two statements (a first take
            # racing this call): the statement still saw it absent, so report that.
            raise KeyError(f"no lease for execution {key.scope_key!r}")
        return self._lease(row)

    async def takeover_candidates(
        self, limit: int = 100, *, after_tenant: str | None = None
    ) -> Sequence[Lease]:
        """Leases any instance may take now, in claim order from ``after_tenant`` (one read:
        the window; the order within it is
        :func:`~langgraph_fence.lease.transitions.fair_order`)."""
        check_limit(limit)
        rows = await self._read(self._candidates, self._params(limit=limit), what="candidates")
        return fair_order([self._lease(row) for row in rows], after_tenant)

    async def take_over(
        self,
        candidate: Lease,
        holder: str,
        ttl: float,
        *,
        progress_mark: str | None = None,
        max_takeovers: int | None = None,
    ) -> Lease | None:
        """Take a candidate over and decide its fate (resume or dead-letter): one statement."""
        check_lease(self, candidate)
        budget = validate_max_takeovers(max_takeovers)
        params = self._params(
            tenant_id=candidate.key.tenant_id,
            execution_id=candidate.key.execution_id,
            epoch=candidate.epoch,
            holder=validate_holder(holder),
            ttl=validate_ttl(ttl),
            progress_mark=validate_progress_mark(progress_mark),
            max_takeovers=_NO_BUDGET if budget is None else budget,
        )
        # Not repeated (see _one): a take that landed and was not heard of leaves the lease
        # to expire; it is then taken again.
        row = await self._one(self._take_over, params)
        return None if row is None else self._lease(row)

    async def yield_lease(self, lease: Lease) -> Lease:
        """Give the hold up while the tree waits for remote children: one guarded statement."""
        check_lease(self, lease)

        def landed(current: Lease) -> bool:
            return current.epoch == lease.epoch and is_yielded(current.status, current.holder)

        return await self._guarded(self._yield, lease, "yield", landed=landed)

    async def retake(self, lease: Lease, ttl: float) -> Lease:
        """Take ``lease`` again at epoch + 1 for its holder: one statement, refused once
        anyone else took it (:func:`~langgraph_fence.lease.transitions.decide_retake`)."""
        check_lease(self, lease)

        def landed(current: Lease) -> bool:
            return (
                current.epoch == lease.epoch + 1
                and current.holder == lease.holder
                and current.status is LeaseStatus.RUNNING
            )

        return await self._guarded(
            self._retake, lease, "retake", landed=landed, ttl=validate_ttl(ttl)
        )

    async def retry(self, key: LeaseKey) -> Lease:
        """Make a dead-lettered or cancelled execution ``pending`` again, its takeover
        budget reset (:func:`~langgraph_fence.lease.transitions.decide_retry`): one guarded
        statement."""
        check_key(key)
        params = self._params(tenant_id=key.tenant_id, execution_id=key.execution_id)
        row = await self._one(self._retry, params)
        if row is None:
            # Refused: let the pure decision say why (no row, not resolvable, stamps).
            decide_retry(await self.get(key), key)
            raise ValueError(
                f"execution {key.scope_key!r} changed while it was retried; look again"
            )
        return self._lease(row)

    async def abandon(self, key: LeaseKey, reason: str) -> Lease:
        """End a dead-lettered or cancelled execution ``failed``, its reason the operator's
        (:func:`~langgraph_fence.lease.transitions.decide_abandon`): one guarded statement."""
        check_key(key)
        params = self._params(
            tenant_id=key.tenant_id, execution_id=key.execution_id, reason=abandon_reason(reason)
        )
        row = await self._one(self._abandon, params)
        if row is None:
            # Refused: let the pure decision say why (no row, not resolvable).
            decide_abandon(await self.get(key), key, reason)
            raise ValueError(
                f"execution {key.scope_key!r} changed while it was abandoned; look again"
            )
        return self._lease(row)


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


#: ``p_max_takeovers`` when there is no budget: more takes than any execution gets.
_NO_BUDGET = 2**31 - 1

"""The SQL lease store: SQLAlchemy 2 async Core on SQLite (aiosqlite) and PostgreSQL (asyncpg).

Every operation is ONE statement (an upsert guarded by expiry, or an update guarded by key +
holder + epoch, each with ``RETURNING``); on PostgreSQL it runs in autocommit, so it costs
one round trip. Only a refused operation pays a second read, to report the epoch it saw.

The statements are SQLAlchemy constructs, written once for both databases
(:mod:`langgraph_fence.lease.sql._statements`, the take of a run in
:mod:`langgraph_fence.lease.sql._take`). The writes (a run's take and release among them)
run on the driver, each construct compiled once for the engine's dialect, on connections
kept checked out (:mod:`langgraph_fence.database.driver`): a run pays the round trip, not
SQLAlchemy's per-statement CPU. The reads and the batched renewals (on a pool of their own)
go through SQLAlchemy.
"""

from __future__ import annotations

import asyncio
import copy
import json
import logging
import time
from collections.abc import AsyncIterator, Callable, Iterable, Mapping, Sequence
from contextlib import asynccontextmanager
from functools import partial
from time import monotonic
from typing import Any, NamedTuple

from sqlalchemy import text
from sqlalchemy.engine import Row
from sqlalchemy.exc import DBAPIError
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
from langgraph_fence.database.driver import Connections, DriverStatement, fetch
from langgraph_fence.database.migrations import migrate
from langgraph_fence.database.retry import (
    is_connection_error,
    is_database_connection_error,
    retry_connection_errors,
)
from langgraph_fence.errors import ExecutionFencedError
from langgraph_fence.lease import (
    Lease,
    LeaseKey,
    LeaseStatus,
    PendingEffect,
    clean_reason,
    validate_holder,
    validate_pending_effect,
    validate_ttl,
)
from langgraph_fence.lease.attempts import Attempt
from langgraph_fence.lease.checks import check_key, check_lease, check_leases, check_limit
from langgraph_fence.lease.schema import (
    HELD_BACK,
    LEASE_MIGRATIONS,
    effects_from_json,
    stamp_patch,
)
from langgraph_fence.lease.sql._attempts import newest_attempt, record_epoch, start_attempt
from langgraph_fence.lease.sql._failover import CLASSIFIED, sweep_statement
from langgraph_fence.lease.sql._statements import NO_BUDGET, LeaseStatements
from langgraph_fence.lease.sql._take import SqliteTake, build_take, record_params
from langgraph_fence.lease.timeline import (
    FailoverReport,
    OnFailover,
    Quarantined,
    failover_mode,
    timeline_sql,
)
from langgraph_fence.lease.transitions import (
    Takeover,
    abandon_reason,
    decide_abandon,
    decide_dead_letter,
    decide_retry,
    fair_order,
    fenced_error,
    is_yielded,
    release_status,
    validate_effect_keys,
)
from langgraph_fence.validate import text_id

__all__ = ["SqlLeaseRepository", "Taken"]

logger = logging.getLogger("langgraph_fence.lease")
# Whether an execution's current submitted run counts against a flow key (queue/_flows.py).
_KEYED_RUN = text(
    "SELECT 1 FROM fence_runs WHERE tenant_id = :tenant_id AND execution_id = :execution_id "
    "AND status = 'current' AND flow_key IS NOT NULL"
)

_READ_TIMELINE = text(f"SELECT {timeline_sql('postgresql')}")

#: How many times a classification that deadlocked is run again.
_DEADLOCK_TRIES = 5


def _sqlstate(exc: DBAPIError) -> str:
    code = getattr(exc.orig, "sqlstate", None) or getattr(exc.orig, "pgcode", None)
    return code if isinstance(code, str) else ""


def _window_size(limit: int) -> int:
    """The size a window of ``limit`` candidates is read at: the next power of two, at
    least 4. On PostgreSQL the size is written into the read's SQL (so that, on the
    database's clock, it is planned once per connection), and every size is a prepared
    statement of its own on every connection: a worker's windows follow its free slots and
    the backlog of graphs it does not serve, so without this they took any size."""
    return max(4, 1 << (limit - 1).bit_length())


class Taken(NamedTuple):
    """What :meth:`SqlLeaseRepository.take` did: the lease taken (or ``None``) and the
    execution id the thread is bound to (``None``: take again)."""

    lease: Lease | None
    bound: str | None


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
        on_failover: what a PostgreSQL failover does to the executions in flight when it
            happened (:mod:`langgraph_fence.lease.timeline`). ``"quarantine"`` (the
            default): no take and no stamp lands until they are dead-lettered, never
            repeated; the promoted server may lack the old primary's last commits.
            ``"trust"``: they resume; only for synchronous replication or quorum storage,
            where a failover loses no commit. Either way tokens keep rising across it.
            ``None``: ``$LANGGRAPH_FENCE_ON_FAILOVER``, else ``"quarantine"`` (so the CLI,
            the Agent Server and your own code on one database say the same).

    From its first write the store keeps up to a quarter of the engine's pool checked out
    (at least one connection) for its next writes, until :meth:`aclose` or the engine is
    disposed of: build one store per engine and share it, not one per call.
    """

    def __init__(
        self,
        engine: AsyncEngine,
        *,
        clock: Callable[[], float] | None = None,
        on_failover: OnFailover | None = None,
    ) -> None:
        self.on_failover = failover_mode(on_failover)
        #: What each failover this store saw and settled was (:meth:`settle_failover`).
        self.failovers: list[FailoverReport] = []
        self._failover_listeners: list[Callable[[FailoverReport], object]] = []
        self._dialect = check_engine(engine)
        self._engine = engine
        # Reads (get, takeover_candidates) never take SQLite's write lock.
        self._reader = read_only(engine)
        # Every write is one statement, on a held driver connection in autocommit (SQLite's
        # are, asyncpg's are outside a transaction): no BEGIN/COMMIT around it. A burst of
        # starts spills over to the pool rather than queue behind the held few.
        self._connections = Connections(engine, share=4, spill=True)
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
        self._statements = LeaseStatements(
            self._dialect, clocked=clock is not None, on_failover=self.on_failover
        )
        self._takes: dict[bool, Any] = {}
        self._sweep = sweep_statement(self._statements.now_sql)
        self._settling = asyncio.Lock()
        self._ledger_seen: float | None = None

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
        twin._renewals = single_statement(autocommit(engine))  # a pool of its own already
        twin._takes = {}
        twin._settling = asyncio.Lock()  # a lock belongs to the loop that first waits on it
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

    async def setup(self) -> None:
        """Create or upgrade the lease table and, beside it, the execution records' tables
        (an :class:`~langgraph_fence.Instance` built on this store keeps its records there,
        where every other instance looks); safe from several processes at once.

        Raises:
            RuntimeError: PostgreSQL refused the role the functions every take reads the
                server's timeline with (``pg_walfile_name(pg_current_wal_lsn())``, which
                keeps tokens rising across a failover), naming the grant that fixes it.
        """
        if self._dialect == "postgresql":
            await self._check_timeline_readable()
        await migrate(self._engine, "leases", LEASE_MIGRATIONS)
        # Imported here: the records' module needs LangGraph's serializer, which the CLI's
        # listings (a lease store, no records) must not load.
        from langgraph_fence.lease.records import EXECUTION_MIGRATIONS

        await migrate(self._engine, "executions", EXECUTION_MIGRATIONS)

    async def _check_timeline_readable(self) -> None:
        async def once() -> None:
            async with self._reader.connect() as conn:
                await conn.execute(_READ_TIMELINE)

        try:
            await retry_connection_errors(once, what="timeline read")
        except DBAPIError as exc:
            if is_connection_error(exc):
                raise
            # The driver's own words (SQLAlchemy 2.0's wrapper puts its class name before them).
            said = exc.orig.__cause__ or exc.orig if exc.orig is not None else exc
            raise RuntimeError(
                "langgraph-fence reads the PostgreSQL server's timeline in every take, with "
                "pg_walfile_name(pg_current_wal_lsn()), so that tokens keep rising across a "
                f"failover (docs/replication.md); this server refused it: {said}. Let "
                "the role call them: GRANT EXECUTE ON FUNCTION pg_current_wal_lsn(), "
                "pg_walfile_name(pg_lsn) TO <the role>"
            ) from exc

    # -- the database it is on, and its clock

    @property
    def engine(self) -> AsyncEngine:
        """The engine this store writes through."""
        return self._engine

    @property
    def now_sql(self) -> str:
        """The store's clock as SQL text, for a textual statement on ``fence_leases`` (this
        store's renewals, the run queue's lease writes); bind :meth:`now_params` with it."""
        return self._statements.now_sql

    def now_params(self) -> dict[str, float]:
        """The parameters :attr:`now_sql` needs now (none for the database's own clock)."""
        return {} if self._clock is None else {"p_now": self._clock()}

    # -- I/O

    def _params(self, **values: Any) -> dict[str, Any]:
        # Bound names carry a p_ prefix: SQLAlchemy reserves the bare column names.
        params = {f"p_{name}": value for name, value in values.items()}
        if self._clock is not None:
            params["p_now"] = self._clock()
        return params

    def _driver_statement(self, stmt: Any) -> DriverStatement:
        # The constructs live as long as the store: each compiled once.
        return self._connections.statement(stmt)

    async def _one(self, stmt: Any, params: dict[str, Any]) -> Any:
        """Run one write statement, once: acquire, take_over, dead_letter and retry are not
        repeated after a connection error (a repeat of one that landed would be refused).
        Its first row (by column name), or ``None``."""
        rows = await self._connections.rows(stmt, params)
        return rows[0] if rows else None

    async def _read(self, stmt: Any, params: dict[str, Any], *, what: str) -> list[Row[Any]]:
        """Run one read statement, retried on a connection error."""

        async def once() -> list[Row[Any]]:
            async with self._reader.connect() as conn:
                return list((await conn.execute(stmt, params)).all())

        return await retry_connection_errors(once, what=what)

    def lease_of(self, row: Row[Any] | Mapping[str, Any]) -> Lease:
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

    # -- a failover of the database (langgraph_fence.lease.timeline)

    def on_failover_settled(self, listener: Callable[[FailoverReport], object]) -> None:
        """Call ``listener`` with each :class:`FailoverReport` this store settles."""
        self._failover_listeners.append(listener)

    async def settle_failover(self) -> FailoverReport | None:
        """Classify the executions of a failover, if the database failed over since they
        were last classified: under ``"quarantine"`` every execution in flight is
        dead-lettered with a reason naming the failover; under ``"trust"`` none is. Either
        way takes land again. ``None`` when there was nothing to settle (always on SQLite).
        Safe from any number of instances at once: one of them classifies."""
        if self._dialect != "postgresql":
            return None
        began = monotonic()

        async def check() -> bool:
            # On the renewals' pool: the watch runs beside the runs, never behind them.
            async with self._renewals.connect() as conn:
                return bool((await conn.execute(CLASSIFIED)).scalar_one())

        if await retry_connection_errors(check, what="failover check"):
            return None
        params = {**self.now_params(), "quarantine": self.on_failover == "quarantine"}

        async def sweep() -> list[Row[Any]]:
            for attempt in range(_DEADLOCK_TRIES):
                try:
                    async with self._renewals.connect() as conn:
                        return list((await conn.execute(self._sweep, params)).all())
                except DBAPIError as exc:
                    # A deadlock with a statement that locks rows in another order: the
                    # sweep rolled back whole; run it again.
                    if _sqlstate(exc) != "40P01" or attempt == _DEADLOCK_TRIES - 1:
                        raise
            raise AssertionError("unreachable")

        # Repeated on a connection error: a sweep that landed unheard left the ledger
        # moved, and the repeat changes nothing (its report then names nothing).
        rows = await retry_connection_errors(sweep, what="failover quarantine")
        if not rows:
            return None
        quarantined = tuple(
            Quarantined(LeaseKey(row.tenant_id, row.execution_id), int(row.epoch), row.reason)
            for row in rows
            if row.tenant_id is not None
        )
        report = FailoverReport(
            previous=None if rows[0].previous is None else int(rows[0].previous),
            timeline=int(rows[0].timeline),
            on_failover=self.on_failover,
            quarantined=quarantined,
            seconds=monotonic() - began,
        )
        self.failovers.append(report)
        logger.warning(
            "the database failed over (timeline %s to %d); on_failover=%s: %d executions in "
            "flight dead-lettered, never repeated%s",
            report.previous,
            report.timeline,
            report.on_failover,
            len(quarantined),
            "".join(f"\n  {q.key.scope_key} (now token {q.token})" for q in quarantined[:50]),
        )
        for listener in list(self._failover_listeners):
            try:
                listener(report)
            except Exception:
                logger.exception("failover listener %r failed", listener)
        return report

    async def _take_one(
        self,
        stmt: Any,
        params: dict[str, Any],
        *,
        refused: Callable[[Any], bool] = lambda row: row is None,
    ) -> Any:
        """:meth:`_one` for a take. Under quarantine a refused take asks, on the same
        connection, whether a failover's executions are unclassified; if so it settles
        them and takes once more."""
        check = self._statements.classified is not None
        compiled = self._driver_statement(stmt)
        async with self._connections() as driver:
            rows = await fetch(driver, compiled, params)
            row = rows[0] if rows else None
            if not (check and refused(row)):
                return row
            classified = await fetch(driver, self._driver_statement(CLASSIFIED), {})
        if classified[0]["classified"]:
            changed_at = classified[0]["changed_at"]
            if changed_at == self._ledger_seen:
                return row  # refused by the execution's own state
            # The ledger moved since this store last looked: another instance may have
            # classified between the refused take and the check. A refused take wrote
            # nothing: take again.
            self._ledger_seen = changed_at
            return await self._one(stmt, params)
        seen = len(self.failovers)
        async with self._settling:  # the takes refused at once settle once
            if len(self.failovers) == seen:
                await self.settle_failover()  # None: another instance settled it
        return await self._one(stmt, params)

    # -- the lease contract (ExecutionLeaseRepository)

    @property
    def store_id(self) -> str:
        """Identifies this store (its database); leases carry it and other stores refuse them."""
        return self._store_id

    async def now(self) -> float:
        """The store's clock, in seconds."""
        if self._clock is not None:
            return self._clock()
        rows = await self._read(self._statements.read_now, {}, what="now")
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
        row = await self._take_one(self._statements.acquire[bool(reopen)], params)
        return None if row is None else self.lease_of(row)

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
            params.update(record_params(record))
        stmt = self._take_statement(with_record=record is not None)
        if self._dialect == "postgresql":
            row = await self._take_one(
                stmt, params, refused=lambda row: row["epoch"] is None and row["bound"] is not None
            )
            assert row is not None  # the statement returns one row, taken or not
            return Taken(None if row["epoch"] is None else self.lease_of(row), row["bound"])
        from langgraph_fence.lease.records import BIND_THREAD, BOUND_TO, UPSERT_RECORD

        sqlite = SqliteTake(
            *(self._driver_statement(s) for s in (BIND_THREAD, stmt, BOUND_TO, UPSERT_RECORD))
        )
        body = partial(sqlite.run, key=key, thread_id=thread_id, params=params, record=record)
        async with self._connections() as driver:
            row, bound = await aiosqlite_call(driver, body)
        return Taken(None if row is None else self.lease_of(row), bound)

    def _take_statement(self, *, with_record: bool) -> Any:
        stmt = self._takes.get(with_record)
        if stmt is None:
            stmt = self._takes[with_record] = build_take(self._statements, with_record=with_record)
        return stmt

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
            if self._statements.classified is not None:
                # A stamp refused while a failover is unclassified: classify it now, so
                # the refusal names the failover and no later write of the run lands.
                await self.settle_failover()
            current = await self.get(lease.key)
            if tries > 1 and landed is not None and current is not None and landed(current):
                return current
            raise fenced_error(lease, current, action=action)
        return self.lease_of(row)

    async def renew(self, lease: Lease, ttl: float) -> Lease:
        """Extend the hold to store-now + ``ttl``; guarded."""
        check_lease(self, lease)
        return await self._guarded(self._statements.renew, lease, "renew", ttl=validate_ttl(ttl))

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
                return list((await conn.execute(self._statements.renew_many, params)).all())

        rows = await retry_connection_errors(once, what="renew_many")
        renewed = {(row.tenant_id, row.execution_id): self.lease_of(row) for row in rows}
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
            self._statements.release,
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
            self._statements.get,
            {"p_tenant_id": key.tenant_id, "p_execution_id": key.execution_id},
            what="get",
        )
        return self.lease_of(rows[0]) if rows else None

    async def mark_pending_effect(self, lease: Lease, effect: PendingEffect, ttl: float) -> Lease:
        """Add ``effect`` to the stamp set and renew, in one guarded write."""
        check_lease(self, lease)
        ttl = validate_ttl(ttl)
        effect = validate_pending_effect(effect)
        return await self._guarded(
            self._statements.patch_renew,
            lease,
            "mark_pending_effect",
            ttl=ttl,
            patch=stamp_patch([effect]),
        )

    async def clear_pending_effects(self, lease: Lease, keys: Iterable[str] | None = None) -> Lease:
        """Remove the entries ``keys`` (all with ``None``) from the stamp set; guarded."""
        check_lease(self, lease)
        wanted = validate_effect_keys(keys)
        if wanted is None:
            return await self._guarded(self._statements.clear_all, lease, "clear_pending_effects")
        return await self._guarded(
            self._statements.patch, lease, "clear_pending_effects", patch=stamp_patch(remove=wanted)
        )

    async def dead_letter(self, key: LeaseKey, reason: str, *, epoch: int | None = None) -> Lease:
        """End the execution as ``dead_lettered``; guarded by ``epoch`` when given."""
        check_key(key)
        reason = clean_reason(reason, required=True)
        params = self._params(tenant_id=key.tenant_id, execution_id=key.execution_id, reason=reason)
        if epoch is None:
            row = await self._one(self._statements.dead_letter, params)
        else:
            params["p_epoch"] = epoch
            row = await self._one(self._statements.dead_letter_at_epoch, params)
        if row is None:
            # Refused: let the pure decision say why (no row, or the epoch moved).
            current = await self.get(key)
            decide_dead_letter(current, key, reason, epoch=epoch)
            # The row appeared at that very epoch between the two statements (a first take
            # racing this call): the statement still saw it absent, so report that.
            raise KeyError(f"no lease for execution {key.scope_key!r}")
        return self.lease_of(row)

    async def takeover_candidates(
        self, limit: int = 100, *, after_tenant: str | None = None
    ) -> Sequence[Lease]:
        """Leases any instance may take now, in claim order from ``after_tenant`` (one read:
        the window; the order within it is
        :func:`~langgraph_fence.lease.transitions.fair_order`)."""
        check_limit(limit)
        rows = await self._read(
            self._statements.candidates, self._params(limit=_window_size(limit)), what="candidates"
        )
        # The window is a prefix of any larger one (its order is total): cut it to size.
        return fair_order([self.lease_of(row) for row in rows[:limit]], after_tenant)

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
        taker = Takeover(holder, ttl, progress_mark, max_takeovers)
        params = self._params(
            tenant_id=candidate.key.tenant_id,
            execution_id=candidate.key.execution_id,
            epoch=candidate.epoch,
            holder=taker.holder,
            ttl=taker.ttl,
            progress_mark=taker.progress_mark,
            max_takeovers=NO_BUDGET if taker.max_takeovers is None else taker.max_takeovers,
        )
        # Not repeated (see _one): a take that landed and was not heard of leaves the lease
        # to expire; it is then taken again.
        row = await self._take_one(self._statements.take_over, params)
        return None if row is None else self.lease_of(row)

    async def yield_lease(self, lease: Lease) -> Lease:
        """Give the hold up while the tree waits for remote children: one guarded statement."""
        check_lease(self, lease)

        def landed(current: Lease) -> bool:
            return current.epoch == lease.epoch and is_yielded(current.status, current.holder)

        return await self._guarded(self._statements.yield_lease, lease, "yield", landed=landed)

    async def retake(self, lease: Lease, ttl: float) -> Lease:
        """Take ``lease`` again at epoch + 1 for its holder: one statement, refused once
        anyone else took it (:func:`~langgraph_fence.lease.transitions.decide_retake`)."""
        check_lease(self, lease)

        def landed(current: Lease) -> bool:
            # Above, not just + 1: after a failover the token jumps to the new floor.
            return (
                current.epoch > lease.epoch
                and current.holder == lease.holder
                and current.status is LeaseStatus.RUNNING
            )

        return await self._guarded(
            self._statements.retake, lease, "retake", landed=landed, ttl=validate_ttl(ttl)
        )

    async def supersede(
        self, key: LeaseKey, attempt: Attempt, holder: str, ttl: float
    ) -> Lease | None:
        """Start Agent Server ``attempt`` of ``key`` for ``holder``
        (:mod:`langgraph_fence.lease.attempts`): the lease taken over from an earlier attempt
        of its run, or ``None`` (left as it was); one transaction.

        Raises:
            ExecutionSupersededError: a newer attempt of the run started; nothing written.
        """
        check_key(key)
        validate_holder(holder)
        ttl = validate_ttl(ttl)
        return await start_attempt(
            self._engine,
            self.now,
            self.lease_of,
            key,
            attempt,
            holder,
            ttl,
            quarantine=self.on_failover == "quarantine",
        )

    async def record_epoch(self, key: LeaseKey, attempt: Attempt, epoch: int) -> bool:
        """Record that ``attempt`` of ``key`` took ``epoch``; ``False`` when a newer attempt
        of its run started meanwhile (nothing written)."""
        return await record_epoch(self._engine, key, attempt, epoch)

    async def newest_attempt(self, key: LeaseKey, run_id: str) -> int | None:
        """The newest attempt of server run ``run_id`` of ``key`` that started, or ``None``."""
        return await newest_attempt(self._engine, key, run_id)

    async def retry(self, key: LeaseKey) -> Lease:
        """Make a dead-lettered or cancelled execution ``pending`` again, its takeover
        budget reset (:func:`~langgraph_fence.lease.transitions.decide_retry`): one guarded
        statement. A run of a flow key (``submit(flow=...)``) is held back again, for a
        worker's look to admit it under its key's limits, as when it was submitted."""
        check_key(key)
        params = self._params(
            tenant_id=key.tenant_id,
            execution_id=key.execution_id,
            not_before=await self._held_back(key),
        )
        # Under quarantine, pending again only once a failover is classified (the retry's
        # statement says so too): the classification must see it as it is.
        row = await self._take_one(self._statements.retry, params)
        if row is None:
            # Refused: let the pure decision say why (no row, not resolvable, stamps).
            decide_retry(await self.get(key), key)
            raise ValueError(
                f"execution {key.scope_key!r} changed while it was retried; look again"
            )
        return self.lease_of(row)

    async def _held_back(self, key: LeaseKey) -> float | None:
        """:data:`~langgraph_fence.lease.schema.HELD_BACK` when the execution's submitted run
        counts against a flow key, else ``None`` (also where the records' tables, and so the
        queue, do not exist)."""
        params = {"tenant_id": key.tenant_id, "execution_id": key.execution_id}
        try:
            async with self._engine.connect() as conn:
                keyed = (await conn.execute(_KEYED_RUN, params)).first() is not None
        except DBAPIError as exc:
            if is_database_connection_error(exc):
                raise
            return None  # no fence_runs: no queue, no flow keys
        return HELD_BACK if keyed else None

    async def abandon(self, key: LeaseKey, reason: str) -> Lease:
        """End a dead-lettered or cancelled execution ``failed``, its reason the operator's
        (:func:`~langgraph_fence.lease.transitions.decide_abandon`): one guarded statement."""
        check_key(key)
        params = self._params(
            tenant_id=key.tenant_id, execution_id=key.execution_id, reason=abandon_reason(reason)
        )
        row = await self._one(self._statements.abandon, params)
        if row is None:
            # Refused: let the pure decision say why (no row, not resolvable).
            decide_abandon(await self.get(key), key, reason)
            raise ValueError(
                f"execution {key.scope_key!r} changed while it was abandoned; look again"
            )
        return self.lease_of(row)

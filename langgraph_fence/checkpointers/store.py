"""``SqlStore``: LangGraph's long-term memory (a ``BaseStore``) on SQLite and PostgreSQL, with the
fencing token checked inside every write.

Inside a fenced step whose lease lives in this database's ``fence_leases`` table, every put
and delete is ONE statement whose ``WHERE`` holds the lease guard
(:func:`langgraph_fence.lease.guard.guard_sql`; on PostgreSQL the lease row is read ``FOR SHARE``,
so a take-over committing meanwhile is waited for and seen): a write under a superseded
token leaves nothing, is recorded on the run like a refused checkpoint write
(:func:`langgraph_fence.fence.admission.refuse_write`) and raises
:class:`~langgraph_fence.ExecutionFencedError`. Every item row records the token it was
written under (``fence_token``; ``NULL`` for a write from outside any fenced step, an admin
script, which is allowed). Reads, searches and ``list_namespaces`` are never fenced.

Items are keyed by tenant: inside a step, the lease's tenant; outside, the store's
``tenant_id`` (default: the default tenant, ``"default"``, the tenant a run with no tenant
has). Each item also names the execution whose fenced step wrote it last
(``fence_execution``): erasing a thread deletes the items its runs wrote
(:meth:`SqlStore.erase_written_by`).
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Callable, Iterable, Sequence
from datetime import UTC, datetime
from typing import Any

from langgraph.store.base import (
    BaseStore,
    GetOp,
    Item,
    ListNamespacesOp,
    Op,
    PutOp,
    Result,
    SearchItem,
    SearchOp,
    TTLConfig,
)
from langgraph.store.memory import _compare_values, _does_match
from sqlalchemy import text
from sqlalchemy.ext.asyncio import AsyncConnection, AsyncEngine

from langgraph_fence.checkpointers._rows import Guard
from langgraph_fence.database import Dialect, check_engine, read_only, single_statement, transaction
from langgraph_fence.database.migrations import Migration, migrate
from langgraph_fence.errors import ExecutionLeaseLostError
from langgraph_fence.fence import RunHandle, running_handle
from langgraph_fence.fence.admission import checked_ops, refuse_write, step_config
from langgraph_fence.fence.tenancy import DEFAULT_TENANT
from langgraph_fence.from_thread import run_on_loop
from langgraph_fence.lease.guard import guard_sql, holds
from langgraph_fence.lease.schema import LEASE_MIGRATIONS
from langgraph_fence.lease.transitions import fenced_error

__all__ = ["STORE_COMPONENT", "STORE_MIGRATIONS", "SqlStore"]

#: The component name in ``fence_schema_versions``.
STORE_COMPONENT = "store"

_ITEMS = """
CREATE TABLE IF NOT EXISTS fence_store_items (
    tenant_id TEXT NOT NULL,
    prefix TEXT NOT NULL,
    key TEXT NOT NULL,
    value TEXT NOT NULL,
    created_at DOUBLE PRECISION NOT NULL,
    updated_at DOUBLE PRECISION NOT NULL,
    expires_at DOUBLE PRECISION,
    ttl_minutes DOUBLE PRECISION,
    fence_token BIGINT,
    PRIMARY KEY (tenant_id, prefix, key)
)
"""
_EXPIRES = (
    "CREATE INDEX IF NOT EXISTS fence_store_items_expires ON fence_store_items (expires_at)"
    " WHERE expires_at IS NOT NULL"
)

# Version 2: each item names the execution whose step wrote it last (NULL: written from
# outside any fenced step), so erasing a thread erases the items its runs wrote; and the items
# of the old default tenant '' move to the one default tenant, 'default', unless that tenant
# has an item of the same namespace and key (never overwritten; the old one stays under '').
_WRITER = "ALTER TABLE fence_store_items ADD COLUMN fence_execution TEXT"
_WRITER_INDEX = (
    "CREATE INDEX IF NOT EXISTS fence_store_items_execution "
    "ON fence_store_items (tenant_id, fence_execution) WHERE fence_execution IS NOT NULL"
)
_TO_DEFAULT = (
    f"UPDATE fence_store_items SET tenant_id = '{DEFAULT_TENANT}' WHERE tenant_id = '' "
    "AND NOT EXISTS (SELECT 1 FROM fence_store_items d WHERE "
    f"d.tenant_id = '{DEFAULT_TENANT}' AND d.prefix = fence_store_items.prefix "
    "AND d.key = fence_store_items.key)"
)

STORE_MIGRATIONS: tuple[Migration, ...] = (
    Migration(1, "store items, keyed by tenant", (_ITEMS, _EXPIRES), (_ITEMS, _EXPIRES)),
    Migration(
        2,
        "the execution that wrote each item; the old default tenant's items to 'default'",
        (_WRITER, _WRITER_INDEX, _TO_DEFAULT),
        (_WRITER, _WRITER_INDEX, _TO_DEFAULT),
    ),
)

_GUARD = guard_sql(
    tenant_id=":g_tenant", execution_id=":g_execution", holder=":g_holder", epoch=":g_epoch"
)
_LOCK = {"postgresql": " FOR SHARE", "sqlite": ""}
_COLUMNS = "prefix, key, value, created_at, updated_at, expires_at, ttl_minutes"
_LIVE = "(expires_at IS NULL OR expires_at > {now})"
#: The database's clock, in seconds since the epoch, as SQL (the store's clock when none is
#: given): the same on every host, as the leases' expiry is.
_DATABASE_NOW = {
    "postgresql": "CAST(EXTRACT(epoch FROM now()) AS DOUBLE PRECISION)",
    "sqlite": "((julianday('now') - 2440587.5) * 86400.0)",
}
_GIVEN_NOW = "CAST(:now AS DOUBLE PRECISION)"

_UPSERT = """INSERT INTO fence_store_items
    (tenant_id, prefix, key, value, created_at, updated_at, expires_at, ttl_minutes, fence_token,
    fence_execution)
SELECT CAST(:tenant AS TEXT), CAST(:prefix AS TEXT), CAST(:key AS TEXT), CAST(:value AS TEXT),
    {now}, {now}, {now} + CAST(:ttl AS DOUBLE PRECISION) * 60,
    CAST(:ttl AS DOUBLE PRECISION), CAST(:token AS BIGINT), CAST(:execution AS TEXT)
WHERE {guard}
ON CONFLICT (tenant_id, prefix, key) DO UPDATE SET value = excluded.value,
    updated_at = excluded.updated_at, expires_at = excluded.expires_at,
    ttl_minutes = excluded.ttl_minutes, fence_token = excluded.fence_token,
    fence_execution = excluded.fence_execution,
    created_at = CASE WHEN fence_store_items.expires_at IS NOT NULL
        AND fence_store_items.expires_at <= excluded.updated_at
        THEN excluded.created_at ELSE fence_store_items.created_at END"""
_DELETE = """DELETE FROM fence_store_items
WHERE tenant_id = :tenant AND prefix = :prefix AND key = :key AND {guard}"""
_UNGUARDED = "1 = 1"
#: The parameters the store's clock needs in a statement (none: the database's clock).
Now = dict[str, float]
_ERASE_WRITTEN = text(
    "DELETE FROM fence_store_items WHERE tenant_id = :tenant AND fence_execution = :execution"
)


def _guarded(statement: str, dialect: Dialect, guard: Guard | None, now: str) -> Any:
    condition = (
        _UNGUARDED
        if guard is None
        else f"EXISTS (SELECT 1 FROM fence_leases WHERE {_GUARD}{_LOCK[dialect]})"
    )
    return text(statement.format(guard=condition, now=now))


def _prefix(namespace: tuple[str, ...]) -> str:
    # LangGraph refuses a label holding a period, so the joined text is unambiguous.
    return ".".join(namespace)


def _when(seconds: float) -> datetime:
    return datetime.fromtimestamp(seconds, tz=UTC)


class SqlStore(BaseStore):
    """A LangGraph store on SQLite or PostgreSQL whose writes are fenced by the step's token.

    Build it as ``SqlStore(engine)`` then ``await store.setup()`` on the event loop that will
    use it (``Instance.open(url)`` does both and offers it as ``instance.store``).

    Args:
        engine: from :func:`langgraph_fence.database.create_engine` (the same engine rules
            as :class:`checkpointers.SqlCheckpointer`).
        ttl: LangGraph's TTL config (``default_ttl`` and ``refresh_on_read``, minutes).
        tenant_id: whose items a call from outside any fenced step reads and writes
            (default: the default tenant). Inside a step, the lease's tenant.
        clock: the store's clock in seconds, for timestamps and TTL. ``None`` (the
            default) means the database's own clock (PostgreSQL's ``now()``, SQLite's
            ``julianday('now')``), as the leases' expiry is judged: every host sees an item
            live or expired alike, whatever its own clock says. Tests pass a controlled one.

    Guarantee: a put or delete made inside a fenced step lands only while the step's token
    is the lease's epoch, checked in the write's own statement: no window. A write from
    outside any fenced step is not fenced (``fence_token`` is ``NULL``). A batch with
    several writes is one transaction: a refused write lands none of them. An item's TTL,
    its ``created_at`` and ``updated_at`` are read from the database's clock (unless a
    ``clock`` is given), never the calling host's: a host with a skewed clock neither hides
    live items, nor sweeps them, nor writes items that others see as expired.

    Semantic search (``query=``, an index config) is not offered: it is refused with
    ``ValueError`` (no embeddings index, no vector column).
    """

    supports_ttl = True
    #: Items are keyed by tenant here: :class:`~langgraph_fence.FencedStore` adds no label.
    scopes_tenants = True

    def __init__(
        self,
        engine: AsyncEngine,
        *,
        ttl: TTLConfig | None = None,
        tenant_id: str = DEFAULT_TENANT,
        clock: Callable[[], float] | None = None,
    ) -> None:
        dialect = check_engine(engine)  # the one engine rule of every store
        if not isinstance(tenant_id, str) or "\x00" in tenant_id:
            raise ValueError(
                f"tenant_id must be a str without NUL bytes (whose items to act on outside a "
                f"fenced step; {DEFAULT_TENANT!r} for the default tenant), got {tenant_id!r}"
            )
        self._engine = engine
        self._dialect: Dialect = dialect
        self._store_id = f"sql:{engine.url.render_as_string(hide_password=True)}"
        self.ttl_config = ttl
        self.tenant_id = tenant_id
        self._clock = clock
        self._now = _DATABASE_NOW[dialect] if clock is None else _GIVEN_NOW
        self.loop: asyncio.AbstractEventLoop | None = None

    @property
    def store_id(self) -> str:
        """Identifies this store's database, as :attr:`SqlLeaseRepository.store_id` does."""
        return self._store_id

    def guards(self, handle: object) -> bool:
        """Whether this store checks ``handle``'s token inside its own writes (its lease
        table is in this database)."""
        return isinstance(handle, RunHandle) and handle.repository.store_id == self._store_id

    async def setup(self) -> None:
        """Create or upgrade the item table (and the lease table its guard joins)."""
        await migrate(self._engine, "leases", LEASE_MIGRATIONS)
        await migrate(self._engine, STORE_COMPONENT, STORE_MIGRATIONS)
        self.loop = asyncio.get_running_loop()

    def _now_params(self) -> Now:
        """The parameters :attr:`_now` needs now (none for the database's own clock)."""
        return {} if self._clock is None else {"now": self._clock()}

    async def erase_written_by(self, tenant_id: str, execution_id: str) -> int:
        """Delete the tenant's items whose last write was made by a fenced step of
        ``execution_id`` (an item another execution, or an admin, wrote over since is its
        writer's: kept); how many. Part of erasing a thread (:mod:`langgraph_fence.saver.admin`)."""
        async with transaction(self._engine) as conn:
            params = {"tenant": tenant_id, "execution": execution_id}
            return int((await conn.execute(_ERASE_WRITTEN, params)).rowcount)

    # -- the batch

    def batch(self, ops: Iterable[Op]) -> list[Result]:
        """Sync twin of :meth:`abatch`: runs it on the store's loop, from another thread."""
        listed = checked_ops(ops)
        # The step is this thread's: the loop runs the batch in a context of its own.
        handle = running_handle()
        return run_on_loop(
            self.loop,
            lambda: self._run(listed, handle),
            what="SqlStore.batch",
            on_loop="use the async methods there (await store.aput(...), store.aget(...))",
        )

    async def abatch(self, ops: Iterable[Op]) -> list[Result]:
        """Run ``ops``: reads first (as ``InMemoryStore`` does), then the writes, fenced.

        Raises:
            ExecutionFencedError: a write inside a fenced step under a superseded token
                (nothing of the batch's writes landed; the refusal is recorded on the run).
            ValueError: semantic search asked for, a value that is not JSON, a step
                whose lease lives in another database, or a namespace or key no store can
                keep (NUL, lone surrogate, too long: the message names it and the limit).
        """
        return await self._run(checked_ops(ops), running_handle())

    async def _run(self, listed: list[Op], handle: RunHandle | None) -> list[Result]:
        now = self._now_params()
        tenant = self.tenant_id if handle is None else handle.key.tenant_id
        results: list[Result] = [None] * len(listed)
        puts: dict[tuple[tuple[str, ...], str], PutOp] = {}
        reads: list[tuple[int, Op]] = []
        for i, op in enumerate(listed):
            if isinstance(op, PutOp):
                puts[(op.namespace, op.key)] = op
            elif isinstance(op, GetOp | SearchOp | ListNamespacesOp):
                if isinstance(op, SearchOp) and op.query:
                    raise ValueError(
                        "SqlStore has no semantic search: search(query=...) needs an "
                        "embeddings index and a vector column, which this store does not "
                        "offer. Drop query= (filter= and namespace prefixes work), or use a "
                        "store with an index (e.g. FencedStore(PostgresStore(index=...)))"
                    )
                reads.append((i, op))
            else:
                raise ValueError(f"ops: unknown operation type {type(op).__name__}")
        if reads:
            await self._reads(reads, results, tenant, now)
        if puts:
            await self._writes(list(puts.values()), handle, tenant, now)
        return results

    # -- reads

    async def _reads(
        self, reads: Sequence[tuple[int, Op]], results: list[Result], tenant: str, now: Now
    ) -> None:
        refresh: set[tuple[str, str]] = set()
        async with read_only(self._engine).connect() as conn:
            for i, op in reads:
                if isinstance(op, GetOp):
                    rows = await self._get(conn, tenant, now, _prefix(op.namespace), op.key)
                    results[i] = self._item(rows[0]) if rows else None
                    if rows and op.refresh_ttl:
                        refresh.add((rows[0].prefix, rows[0].key))
                elif isinstance(op, SearchOp):
                    rows = await self._search(conn, tenant, now, op.namespace_prefix)
                    found = [r for r in rows if self._matches(r, op.filter)]
                    page = found[op.offset : op.offset + op.limit]
                    results[i] = [self._item(r, search=True) for r in page]
                    if op.refresh_ttl:
                        refresh.update((r.prefix, r.key) for r in page)
                elif isinstance(op, ListNamespacesOp):
                    results[i] = await self._namespaces(conn, tenant, now, op)
        if refresh:
            await self._refresh(tenant, refresh, now)

    async def _get(
        self, conn: AsyncConnection, tenant: str, now: Now, prefix: str, key: str
    ) -> list[Any]:
        """The live item at ``prefix``/``key`` (a list of one or none)."""
        where = "prefix = :prefix AND key = :key"
        return await self._live(conn, where, {"tenant": tenant, "prefix": prefix, "key": key}, now)

    async def _search(
        self, conn: AsyncConnection, tenant: str, now: Now, under: tuple[str, ...]
    ) -> list[Any]:
        """The live items at or under the namespace ``under`` (every one when it is empty)."""
        if not under:
            return await self._live(conn, "TRUE", {"tenant": tenant}, now)
        # No LIKE: a label may hold % or _.
        dotted = _prefix(under) + "."
        where = "(prefix = :under OR substr(prefix, 1, :n) = :under_dot)"
        params = {"tenant": tenant, "under": _prefix(under), "under_dot": dotted, "n": len(dotted)}
        return await self._live(conn, where, params, now)

    async def _live(
        self, conn: AsyncConnection, where: str, params: dict[str, Any], now: Now
    ) -> list[Any]:
        statement = text(
            f"SELECT {_COLUMNS} FROM fence_store_items"
            f" WHERE tenant_id = :tenant AND {_LIVE.format(now=self._now)} AND {where}"
            " ORDER BY prefix, key"
        )
        return list((await conn.execute(statement, {**params, **now})).all())

    async def _namespaces(
        self, conn: AsyncConnection, tenant: str, now: Now, op: ListNamespacesOp
    ) -> list[tuple[str, ...]]:
        rows = await conn.execute(
            text(
                "SELECT DISTINCT prefix FROM fence_store_items"
                f" WHERE tenant_id = :tenant AND {_LIVE.format(now=self._now)}"
            ),
            {"tenant": tenant, **now},
        )
        namespaces = [tuple(prefix.split(".")) for (prefix,) in rows.all()]
        if op.match_conditions:
            namespaces = [
                ns for ns in namespaces if all(_does_match(c, ns) for c in op.match_conditions)
            ]
        if op.max_depth is not None:
            namespaces = list({ns[: op.max_depth] for ns in namespaces})
        return sorted(namespaces)[op.offset : op.offset + op.limit]

    @staticmethod
    def _matches(row: Any, filter: dict[str, Any] | None) -> bool:
        if not filter:
            return True
        value = json.loads(row.value)
        # The same comparison InMemoryStore makes, so both stores answer a filter alike.
        return all(_compare_values(value.get(k), v) for k, v in filter.items())

    @staticmethod
    def _item(row: Any, *, search: bool = False) -> Item:
        kind = SearchItem if search else Item
        return kind(
            namespace=tuple(row.prefix.split(".")),
            key=row.key,
            value=json.loads(row.value),
            created_at=_when(row.created_at),
            updated_at=_when(row.updated_at),
        )

    async def _refresh(self, tenant: str, items: set[tuple[str, str]], now: Now) -> None:
        # A read's TTL refresh is no write of the step's: not fenced.
        statement = text(
            f"UPDATE fence_store_items SET expires_at = {self._now} + ttl_minutes * 60"
            " WHERE tenant_id = :tenant AND prefix = :prefix AND key = :key"
            " AND ttl_minutes IS NOT NULL"
        )
        params = [{"tenant": tenant, "prefix": p, "key": k, **now} for p, k in items]
        async with transaction(self._engine) as conn:
            await conn.execute(statement, params)

    # -- writes

    def _guard(self, handle: RunHandle | None) -> Guard | None:
        if handle is None:
            return None
        if not self.guards(handle):
            raise ValueError(
                f"SqlStore write: the step's lease is of store {handle.repository.store_id!r}, "
                f"and this store's database is {self._store_id!r}: it cannot check that token "
                "inside its writes. Keep the leases in the store's database, or wrap the "
                "store: FencedStore(store) checks the token before delegating"
            )
        if handle.error is not None:
            raise refuse_write(handle, step_config(), handle.error)
        return Guard.of(handle.lease)

    def _write_params(
        self, op: PutOp, tenant: str, guard: Guard | None, now: Now
    ) -> dict[str, Any]:
        params: dict[str, Any] = {"tenant": tenant, "prefix": _prefix(op.namespace), "key": op.key}
        if guard is not None:
            params.update(
                g_tenant=guard.tenant_id,
                g_execution=guard.execution_id,
                g_holder=guard.holder,
                g_epoch=guard.epoch,
            )
        if op.value is None:
            return params
        try:
            value = json.dumps(op.value)
        except (TypeError, ValueError) as exc:
            raise ValueError(
                f"put({op.namespace!r}, {op.key!r}): value must be a JSON-serializable dict "
                f"({exc}); store plain data (str, numbers, lists, dicts)"
            ) from None
        ttl = op.ttl
        params.update(
            now,
            value=value,
            ttl=ttl,
            token=None if guard is None else guard.epoch,
            execution=None if guard is None else guard.execution_id,
        )
        return params

    async def _writes(
        self, puts: Sequence[PutOp], handle: RunHandle | None, tenant: str, now: Now
    ) -> None:
        guard = self._guard(handle)
        statements = [
            (
                _guarded(_DELETE if op.value is None else _UPSERT, self._dialect, guard, self._now),
                self._write_params(op, tenant, guard, now),
                op,
            )
            for op in puts
        ]
        refused: PutOp | None = None
        if len(statements) == 1:
            statement, params, op = statements[0]
            async with single_statement(self._engine).connect() as conn:
                landed = (await conn.execute(statement, params)).rowcount
                await conn.commit()
            refused = op if guard is not None and not landed else None
        else:
            async with transaction(self._engine) as conn:
                for statement, params, op in statements:
                    landed = (await conn.execute(statement, params)).rowcount
                    if guard is not None and not landed:
                        refused = op
                        await conn.rollback()
                        break
        if refused is not None:
            assert handle is not None
            await self._refused(handle, refused)

    async def _refused(self, handle: RunHandle, op: PutOp) -> None:
        # The failure path only: one read to tell a refusal from a delete of nothing, and to
        # say which epoch the store has now. Epochs never go back, so a lease still held now
        # was held when the statement ran.
        current = await handle.repository.get(handle.key)
        action = f"store {'delete' if op.value is None else 'put'} of {op.namespace!r}/{op.key!r}"
        if op.value is None and holds(handle.lease, current):
            return
        error: ExecutionLeaseLostError = fenced_error(handle.lease, current, action=action)
        raise refuse_write(handle, step_config(), error)

    # -- maintenance

    async def sweep_ttl(self) -> int:
        """Delete the items whose TTL has run out by the database's clock (or the store's
        ``clock``), never this host's; returns how many. Reads never see them anyway; this
        frees the space. Not fenced (maintenance)."""
        async with single_statement(self._engine).connect() as conn:
            result = await conn.execute(
                text(f"DELETE FROM fence_store_items WHERE expires_at <= {self._now}"),
                self._now_params(),
            )
            await conn.commit()
        return int(result.rowcount)

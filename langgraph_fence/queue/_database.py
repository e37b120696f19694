"""The database the run queue is on: the lease store's, read and written the same way by
every part of the queue."""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Mapping, Sequence
from typing import TYPE_CHECKING, Any, TypeVar

from sqlalchemy import text
from sqlalchemy.ext.asyncio import AsyncConnection

from langgraph_fence.database import dialect_of, single_statement
from langgraph_fence.database.driver import Connections
from langgraph_fence.database.retry import retry_connection_errors
from langgraph_fence.lease.timeline import FailoverUnclassified, token_floor
from langgraph_fence.queue._statements import LEASE, LeaseWrites
from langgraph_fence.queue.notifications import NOTIFY_SQL

if TYPE_CHECKING:
    from sqlalchemy.sql.elements import TextClause

    from langgraph_fence.lease.sql import SqlLeaseRepository

__all__ = ["QueueDatabase"]

T = TypeVar("T")


class QueueDatabase:
    """The run queue's side of the SQL lease store's database.

    Attributes:
        store: the lease store; its clock stamps every lease row the queue writes.
        engine: the engine of the lease table (and the execution records).
        writer: ``engine`` for one statement in autocommit (a read takes no write lock).
        pg: whether the database is PostgreSQL (NOTIFY, one round trip on the driver).
        leases: the queue's writes of lease rows, on the store's clock.
        lease_row: the read of a lease row (status, holder, epoch, reason) that locks it
            for the rest of the transaction.
    """

    def __init__(self, store: SqlLeaseRepository) -> None:
        self.store = store
        self.engine = store.engine
        self.writer = single_statement(self.engine)
        self.pg = dialect_of(self.engine) == "postgresql"
        self.leases = LeaseWrites(
            store.now_sql,
            dialect_of(self.engine),
            quarantine=store.on_failover == "quarantine",
        )
        # PostgreSQL: two writers of one key wait for each other; SQLite's BEGIN IMMEDIATE
        # serialises every writer already.
        self.lease_row: TextClause = text(LEASE + (" FOR UPDATE" if self.pg else ""))
        self._read_now = text(f"SELECT {store.now_sql}")
        # A served run's own statements (its pin, its output, the NOTIFY of its end) run on
        # the driver on PostgreSQL, as the lease store's take and release do: SQLAlchemy's
        # own work and pool checkout cost a statement as much CPU as the statement.
        self._connections = Connections(self.engine, share=4, spill=True) if self.pg else None

    @property
    def on_driver(self) -> bool:
        """Whether :meth:`driver_rows` runs here (PostgreSQL)."""
        return self._connections is not None

    async def driver_rows(self, statement: Any, params: Mapping[str, Any]) -> Sequence[Any]:
        """The rows of ``statement`` (a construct built once, kept for the database's life)
        run once on the driver, in autocommit, each readable by column name; PostgreSQL
        only (:attr:`on_driver`)."""
        assert self._connections is not None, "driver statements are for PostgreSQL"
        return await self._connections.rows(statement, params)

    async def aclose(self) -> None:
        """Give the connections held for :meth:`driver_rows` back to the engine's pool."""
        if self._connections is not None:
            await self._connections.aclose()

    def now(self) -> dict[str, float]:
        """The parameters the lease writes' clock needs now."""
        return self.store.now_params()

    async def store_now(self, conn: AsyncConnection) -> float:
        """The store's clock, as ``conn``'s transaction reads it (epoch seconds)."""
        return float((await conn.execute(self._read_now, self.now())).scalar_one())

    async def first(self, statement: Any, params: Mapping[str, Any], *, what: str) -> Any:
        """The first row ``statement`` reads (``None``: none), in one read retried on a
        connection error."""

        async def once() -> Any:
            async with self.engine.connect() as conn:
                return (await conn.execute(statement, dict(params))).first()

        return await retry_connection_errors(once, what=what)

    async def first_all(self, statement: Any, params: Mapping[str, Any], *, what: str) -> list[Any]:
        """Every row ``statement`` reads, in one read retried on a connection error."""

        async def once() -> list[Any]:
            async with self.engine.connect() as conn:
                return list(await conn.execute(statement, dict(params)))

        return await retry_connection_errors(once, what=what)

    async def classified(self, conn: AsyncConnection) -> None:
        """Raise :class:`~langgraph_fence.lease.timeline.FailoverUnclassified` on ``conn``'s
        transaction while a failover's executions are unclassified (PostgreSQL under
        ``on_failover="quarantine"``): work begun now must not be taken for the old
        primary's, nor move an execution of it out of the classification's way."""
        if not self.pg or self.store.on_failover != "quarantine":
            return
        _, ok = await token_floor(conn, "postgresql")
        if not ok:
            raise FailoverUnclassified()

    async def settled_first(self, operation: Callable[[], Awaitable[T]]) -> T:
        """``await operation()``; if a failover was unclassified, classify it and once more."""
        try:
            return await operation()
        except FailoverUnclassified:
            await self.store.settle_failover()
            return await operation()

    async def notify(self, conn: AsyncConnection, channel: str, payload: str) -> None:
        """Say on ``channel`` what ``conn``'s transaction changed, delivered on its commit
        (PostgreSQL; nothing elsewhere, where waiters poll)."""
        if self.pg:
            await conn.execute(NOTIFY_SQL, {"channel": channel, "payload": payload})

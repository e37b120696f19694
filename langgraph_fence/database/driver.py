"""Statements run straight on the driver (asyncpg / aiosqlite), on connections kept checked
out between calls: the hot paths of the saver and of the lease store.

SQLAlchemy Core costs about 0.5 ms of CPU per statement (compiled-cache look-up, parameter
processing, result rows) and a checkout from its async pool (and its check-in, which on
SQLite costs a rollback round trip to the connection's thread) 0.2 to 0.5 ms more: as much
as the statement itself. So a hot path keeps the connections it used checked out, idle,
and takes them again for the next call, and runs its statements on the driver: SQL text
the saver writes itself, or a SQLAlchemy construct compiled once for the engine's dialect
(:class:`DriverStatement`), so the lease store's statements stay written once.

Each owner holds at most a share of the pool's size (the saver half, the lease store a
quarter: the records and others share the engine). The saver runs no more calls at once
than it holds: a fan-out superstep saves all its tasks' writes at the same moment, and
past the pool's size SQLAlchemy would open overflow connections and close them after one
use. The lease store's calls beyond its share (a burst of starts) spill over to the pool.

A call interrupted on its connection (cancelled mid-statement, or failed on a connection
error) closes that connection at the driver (:func:`langgraph_fence.database.discard`): its
state is unknown, an asyncpg connection may still be cancelling the statement, and the pool
(in autocommit, its reset sends nothing) would hand it to the next operation, which then
fails with "another operation is in progress" or "connection is closed". Raw driver calls
bypass SQLAlchemy's own disconnect handling, so nothing else would. The close and the
give-back run in order in a task of their own (:func:`give_back`), which a second cancel of
the caller does not stop.

The held connections are given back by :meth:`Connections.aclose` (the owner's ``aclose``),
and closed when the engine is disposed (its ``engine_disposed`` event), so they never
outlive the engine.
"""

from __future__ import annotations

import asyncio
import logging
import sqlite3
from collections.abc import AsyncIterator, Mapping, Sequence
from contextlib import asynccontextmanager
from typing import Any

from sqlalchemy import event
from sqlalchemy.engine import Dialect
from sqlalchemy.ext.asyncio import AsyncConnection, AsyncEngine
from sqlalchemy.sql import ClauseElement
from sqlalchemy.sql.compiler import SQLCompiler

from langgraph_fence._compat import aiosqlite_call
from langgraph_fence.database import discard
from langgraph_fence.database.retry import is_connection_error

__all__ = ["Connections", "DriverStatement", "fetch", "give_back", "sqlite_fetch"]

logger = logging.getLogger("langgraph_fence.driver")


class Connections:
    """Driver connections (asyncpg / aiosqlite) from ``engine``'s pool, reused across calls:
    at most ``1 / share`` of the pool's size are held.

    With ``spill``, a call that finds every held connection busy takes one from the pool
    for itself (given back after it) instead of waiting: a burst then runs as wide as the
    pool lets it, as it would through SQLAlchemy, paying the checkout only then.
    """

    def __init__(self, engine: AsyncEngine, *, share: int = 2, spill: bool = False) -> None:
        self._engine = engine
        size = getattr(engine.pool, "size", None)
        self._limit = max(1, size() // share) if callable(size) else 1
        self._spill = spill
        self._slots: asyncio.Semaphore | None = None
        self._idle: list[tuple[AsyncConnection, Any]] = []
        self._generation = 0
        # Constructs compiled for the engine's dialect, by identity (each kept alive beside
        # its compiled form, so an identity is never reused): built once, run often.
        self._compiled: dict[int, tuple[Any, DriverStatement]] = {}
        event.listen(engine.sync_engine, "engine_disposed", self._on_dispose)

    def statement(self, construct: ClauseElement) -> DriverStatement:
        """``construct`` (one the owner keeps for its life) compiled for the driver, once."""
        found = self._compiled.get(id(construct))
        if found is None:
            found = (construct, DriverStatement(construct, self._engine.dialect))
            self._compiled[id(construct)] = found
        return found[1]

    async def rows(self, construct: ClauseElement, params: Mapping[str, Any]) -> Sequence[Any]:
        """The rows of ``construct`` run once on a connection of these (:func:`fetch`)."""
        compiled = self.statement(construct)
        async with self() as driver:
            return await fetch(driver, compiled, params)

    @asynccontextmanager
    async def __call__(self) -> AsyncIterator[Any]:
        if self._slots is None:
            self._slots = asyncio.Semaphore(self._limit)
        if self._spill and self._slots.locked():
            async with self._using(*await self._open(), held=False) as driver:
                yield driver
            return
        async with self._slots:
            pair = self._idle.pop() if self._idle else await self._open()
            async with self._using(*pair, held=True) as driver:
                yield driver

    async def _open(self) -> tuple[AsyncConnection, Any]:
        conn = await self._engine.connect()
        try:
            return conn, (await conn.get_raw_connection()).driver_connection
        except BaseException:
            await conn.close()
            raise

    @asynccontextmanager
    async def _using(self, conn: AsyncConnection, driver: Any, *, held: bool) -> AsyncIterator[Any]:
        """One call on ``driver``; after it a ``held`` connection is kept for the next."""
        generation = self._generation
        try:
            yield driver
        except BaseException as exc:
            # The server went away (a connection error): the held idle ones are dead too.
            lost = not isinstance(exc, asyncio.CancelledError) and is_connection_error(exc)
            idle: list[tuple[AsyncConnection, Any]] = []
            if lost:
                idle, self._idle = self._idle, []
            await give_back(conn, exc, also=[c for c, _ in idle])
            raise
        if held and generation == self._generation:
            self._idle.append((conn, driver))
        else:
            # A call of a burst gives its connection back.
            await conn.close()

    async def aclose(self) -> None:
        """Give every held connection back to the engine's pool, and wait for the
        give-backs under way (:func:`give_back`) to end."""
        idle, self._idle = self._idle, []
        for conn, _ in idle:
            await conn.close()
        if _giving_back:
            await asyncio.gather(*_giving_back, return_exceptions=True)

    def _on_dispose(self, _engine: Any) -> None:
        # Called by engine.dispose(), after the pool was replaced: the held connections
        # belong to the old pool, so invalidate them (closes them at the driver) and never
        # reuse them. AsyncEngine.dispose() runs this inside SQLAlchemy's greenlet, where the
        # driver's close can be awaited; a bare sync dispose cannot, and leaves them to
        # SQLAlchemy's garbage-collection cleanup.
        self._generation += 1
        idle, self._idle = self._idle, []
        for conn, _ in idle:
            try:
                conn.sync_connection.invalidate()  # type: ignore[union-attr]
            except Exception:
                logger.debug("could not close a held connection on dispose", exc_info=True)


#: The give-backs under way (see :func:`give_back`): a task is kept alive by a strong
#: reference until it ends, whether or not its caller still waits for it.
_giving_back: set[asyncio.Task[None]] = set()


async def give_back(
    conn: AsyncConnection, failure: BaseException, *, also: Sequence[AsyncConnection] = ()
) -> None:
    """Give ``conn`` back to its pool after a raw driver call on it ended with ``failure``.

    A cancel or a connection error leaves the connection's state unknown, so it is closed
    at the driver first (:func:`langgraph_fence.database.discard`; on a connection error
    with the pool recycled, and ``also``, the other connections of the same server,
    dropped with it). Another error gives it back as it is: the pool resets it.

    The whole of it runs in a task of its own, in that order, and a caller cancelled again
    while it waits (LangGraph cancelling a step's task twice, a timeout wrapped around ours)
    stops waiting without stopping it: given back before its close ends, the connection
    would be checked out by the next operation and closed under it ("Cannot operate on a
    closed database", "connection is closed").
    """
    cancelled = isinstance(failure, asyncio.CancelledError)
    lost = not cancelled and is_connection_error(failure)

    async def settle() -> None:
        for each, drop in ((conn, cancelled or lost), *((other, True) for other in also)):
            try:  # each on its own: one that fails to close leaves the others to close
                if drop:
                    await discard(each, server_lost=lost and each is conn)
                await each.close()
            except Exception:
                logger.debug("could not give a connection back after a failed call", exc_info=True)

    task = asyncio.ensure_future(settle())
    _giving_back.add(task)
    task.add_done_callback(_giving_back.discard)
    await asyncio.shield(task)


class DriverStatement:
    """A SQLAlchemy construct compiled once for one dialect, to run on the driver.

    The SQL text is the one SQLAlchemy sends (its ``IN`` lists of constants expanded, its
    bind casts rendered), in the driver's positional paramstyle (asyncpg ``$1``, sqlite3
    ``?``); :meth:`args` maps the call's named parameters and the construct's own
    constants to the positions. A parameter the construct needs and the call lacks raises
    ``KeyError``, never binds ``NULL``.
    """

    __slots__ = ("_constants", "_names", "_processors", "sql")

    def __init__(self, construct: ClauseElement, dialect: Dialect) -> None:
        if dialect.paramstyle not in ("numeric_dollar", "qmark"):
            raise ValueError(f"no driver statements for the paramstyle {dialect.paramstyle!r}")
        compiled = construct.compile(dialect=dialect)
        assert isinstance(compiled, SQLCompiler)  # a statement, not DDL
        binds = compiled.binds.values()
        needed = {b.key for b in binds if b.required}
        late = [b.key for b in binds if b.required and (b.expanding or b.literal_execute)]
        if late:
            # Their SQL depends on the call's values: no one text serves every call.
            raise ValueError(f"parameters {sorted(late)} are rendered per call; bind them plainly")
        # The public way to the text SQLAlchemy would send for one set of parameters: the
        # needed ones stand in as NULL here; only the constants are kept.
        state = compiled.construct_expanded_state(dict.fromkeys(needed))
        self.sql: str = state.statement
        self._names = tuple(state.positiontup or ())
        self._constants = {k: v for k, v in state.parameters.items() if k not in needed}
        self._processors = dict(state.processors)

    def args(self, params: Mapping[str, Any]) -> list[Any]:
        """The positional arguments for ``params`` (the construct's bind names)."""
        constants = self._constants
        values = [
            params[name] if name not in constants else constants[name] for name in self._names
        ]
        if self._processors:
            for i, name in enumerate(self._names):
                process = self._processors.get(name)
                if process is not None:
                    values[i] = process(values[i])
        return values


def sqlite_fetch(
    conn: sqlite3.Connection, stmt: DriverStatement, params: Mapping[str, Any]
) -> list[sqlite3.Row]:
    """Run ``stmt`` on ``conn``, on its own thread (inside :func:`aiosqlite_call`, as one
    statement of a transaction run in one hop): its rows, readable by column name."""
    cursor = conn.cursor()
    cursor.row_factory = sqlite3.Row
    try:
        # Every row fetched: SQLite finishes (and, in autocommit, commits) a statement with
        # RETURNING only when it is stepped to its end.
        return cursor.execute(stmt.sql, stmt.args(params)).fetchall()
    finally:
        cursor.close()


async def fetch(driver: Any, stmt: DriverStatement, params: Mapping[str, Any]) -> Sequence[Any]:
    """Run ``stmt`` on ``driver`` (a connection from :class:`Connections`) in one round trip:
    its rows, each readable by column name (``row["epoch"]``)."""
    if hasattr(driver, "fetchrow"):  # asyncpg
        rows: list[Any] = await driver.fetch(stmt.sql, *stmt.args(params))
        return rows
    return await aiosqlite_call(driver, lambda conn: sqlite_fetch(conn, stmt, params))

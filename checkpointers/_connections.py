"""The driver connections the saver's hot paths run on, kept checked out between calls.

A checkout from SQLAlchemy's async pool (and its check-in, which on SQLite costs a rollback
round trip to the connection's thread) takes 0.2 to 0.5 ms: as much as the write itself.
So the saver keeps the connections it used checked out, idle, and takes them again for the
next call. At most half the pool's size are held (the lease store and others share the
engine), and no more than that many calls run at once: a fan-out superstep saves all its
tasks' writes at the same moment, and past the pool's size SQLAlchemy would open overflow
connections and close them after one use.

A call interrupted on its connection (cancelled mid-statement, or failed on a connection
error) closes that connection at the driver (:func:`langgraph_fence.database.discard`): its
state is unknown, an asyncpg connection may still be cancelling the statement, and the pool
(in autocommit, its reset sends nothing) would hand it to the next operation, which then
fails with "another operation is in progress" or "connection is closed". Raw driver calls
bypass SQLAlchemy's own disconnect handling, so nothing else would.

The held connections are given back by :meth:`Connections.aclose` (the saver's ``aclose``),
and closed when the engine is disposed (its ``engine_disposed`` event), so they never
outlive the engine.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

from sqlalchemy import event
from sqlalchemy.ext.asyncio import AsyncConnection, AsyncEngine

from langgraph_fence.database import discard
from langgraph_fence.retry import is_connection_error

__all__ = ["Connections"]

logger = logging.getLogger(__name__)


class Connections:
    """Driver connections (asyncpg / aiosqlite) from ``engine``'s pool, reused across calls."""

    def __init__(self, engine: AsyncEngine) -> None:
        self._engine = engine
        size = getattr(engine.pool, "size", None)
        self._limit = max(1, size() // 2) if callable(size) else 1
        self._slots: asyncio.Semaphore | None = None
        self._idle: list[tuple[AsyncConnection, Any]] = []
        self._generation = 0
        event.listen(engine.sync_engine, "engine_disposed", self._on_dispose)

    @asynccontextmanager
    async def __call__(self) -> AsyncIterator[Any]:
        if self._slots is None:
            self._slots = asyncio.Semaphore(self._limit)
        async with self._slots:
            generation = self._generation
            if self._idle:
                conn, driver = self._idle.pop()
            else:
                conn = await self._engine.connect()
                try:
                    driver = (await conn.get_raw_connection()).driver_connection
                except BaseException:
                    await conn.close()
                    raise
            reuse = False
            try:
                yield driver
                reuse = generation == self._generation
            except BaseException as exc:
                if isinstance(exc, asyncio.CancelledError):
                    await discard(conn)  # see the module docstring
                elif is_connection_error(exc):
                    # The server went away: the held idle connections are dead too.
                    await discard(conn, server_lost=True)
                    await self._discard_idle()
                raise
            finally:
                if reuse:
                    self._idle.append((conn, driver))
                else:
                    # After an error the connection's state is unknown: give it back to the
                    # pool, which resets it (or drops it, discarded above).
                    await conn.close()

    async def _discard_idle(self) -> None:
        idle, self._idle = self._idle, []
        for conn, _ in idle:
            await discard(conn)
            await conn.close()

    async def aclose(self) -> None:
        """Give every held connection back to the engine's pool."""
        idle, self._idle = self._idle, []
        for conn, _ in idle:
            await conn.close()

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

"""What a test or a benchmark counts as the SQL a run sends beyond its checkpoints."""

from __future__ import annotations

import asyncio
import weakref
from typing import Any

from sqlalchemy import event
from sqlalchemy.ext.asyncio import AsyncEngine

try:
    from sqlalchemy.util.concurrency import await_
except ImportError:  # SQLAlchemy before 2.1 (the lowest CI run has 2.0.43)
    from sqlalchemy.util.concurrency import await_only as await_

__all__ = ["Statements"]


class Statements:
    """The statements sent on ``engine``'s connections beyond the saver's, by their first
    words.

    Traced at the driver (asyncpg's query loggers, sqlite3's trace callback, installed on
    each connection when it is checked out), so a statement counts whether SQLAlchemy sends
    it or the lease store runs it on the driver, and SQLite's BEGIN and COMMIT count too.
    The saver's statements are left out by their connection: in a window, a connection
    that touched a checkpoint table is the saver's (it holds its connections, as the lease
    store holds its own).

    asyncpg's query loggers do not see the statements SQLAlchemy sends (it runs them as
    prepared statements); with ``sqlalchemy=True`` those are counted too, from SQLAlchemy's
    ``before_cursor_execute`` (on SQLite the trace sees them already).
    """

    def __init__(self, engine: AsyncEngine, *, sqlalchemy: bool = False) -> None:
        self._seen: list[tuple[int, str]] = []
        self._traced: weakref.WeakSet[Any] = weakref.WeakSet()
        self._postgres = engine.dialect.name == "postgresql"
        event.listen(engine.sync_engine, "checkout", self._trace)
        if sqlalchemy and self._postgres:
            event.listen(engine.sync_engine, "before_cursor_execute", self._sent)

    def _sent(self, conn: Any, _cursor: Any, statement: str, *_args: Any) -> None:
        self._seen.append((id(conn.connection.driver_connection), statement))

    def _trace(self, dbapi_connection: Any, _record: Any, _proxy: Any) -> None:
        driver = dbapi_connection.driver_connection
        if driver in self._traced:
            return
        self._traced.add(driver)
        owner = id(driver)

        def seen(statement: str) -> None:
            self._seen.append((owner, statement))

        if self._postgres:
            driver.add_query_logger(lambda record: seen(record.query))
        else:
            # On the connection's own thread (sqlite3 refuses another); the checkout runs
            # in SQLAlchemy's greenlet, where the driver's coroutine can be awaited.
            await_(driver.set_trace_callback(seen))

    async def take(self) -> list[str]:
        # asyncpg hands each record to its loggers with loop.call_soon; the loop runs its
        # callbacks in the order they were scheduled, so once a callback scheduled now has
        # run, the records of every query that has finished have been delivered.
        delivered = asyncio.get_running_loop().create_future()
        asyncio.get_running_loop().call_soon(delivered.set_result, None)
        await delivered
        seen, self._seen = self._seen, []
        saver = {owner for owner, sql in seen if "fence_checkpoint" in sql.lower()}
        return [" ".join(sql.split()[:3]).upper() for owner, sql in seen if owner not in saver]

"""PostgreSQL LISTEN/NOTIFY for the run queue: which channel says what, and one LISTEN
connection per queue that every waiter shares.

A submit, a recorded child or a hand-back says an execution became runnable
(:data:`NOTIFY_CHANNEL`); a submitted run's end says so on :data:`ENDS_CHANNEL`. Each is
sent and listened to per schema, so instances on another schema of the same database are
not woken. A notification is a hint: every waiter also looks on its own schedule.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncIterator, Collection
from contextlib import asynccontextmanager
from typing import Any

from sqlalchemy import text
from sqlalchemy.ext.asyncio import AsyncEngine

__all__ = [
    "CHANNELS",
    "ENDS_CHANNEL",
    "MAX_LISTEN_BACKOFF",
    "NOTIFY_CHANNEL",
    "NOTIFY_SQL",
    "OF_SCHEMA",
    "Notifications",
]

logger = logging.getLogger("langgraph_fence.notifications")

#: The PostgreSQL channel that says an execution became runnable: a submit, a child
#: recorded, a run handed back (the payload: the graph name, where known). Sent and
#: listened to per schema: as ``<channel>_<12 hex digits of md5(current_schema())>``.
NOTIFY_CHANNEL = "langgraph_fence_runs"
#: The PostgreSQL channel that says a submitted run ended (the payload: its scope key).
ENDS_CHANNEL = "langgraph_fence_ends"
CHANNELS = (NOTIFY_CHANNEL, ENDS_CHANNEL)
# Each channel is of the schema the tables are in (the connection's ``current_schema()``):
# instances on another schema of the same database are not woken by this one's runs.
OF_SCHEMA = ":channel || '_' || left(md5(current_schema()), 12)"
NOTIFY_SQL = text(f"SELECT pg_notify({OF_SCHEMA}, :payload)")
CHANNEL_NAME = text(f"SELECT {OF_SCHEMA}")
#: The longest pause before the LISTEN connection is opened again after it was dropped.
MAX_LISTEN_BACKOFF = 5.0


class Notifications:
    """PostgreSQL LISTEN for every waiter of one queue, on ONE pooled connection.

    The connection is opened when the first waiter subscribes and closed when the last
    leaves. One the database drops (a restart, ``pg_terminate_backend``) is opened again
    (backing off up to :data:`MAX_LISTEN_BACKOFF`), and every waiter is woken once then:
    a notification sent while it was down is lost, so each looks again.

    Attributes:
        backend_pid: the server process of the LISTEN connection, while it is open.
    """

    def __init__(self, engine: AsyncEngine) -> None:
        self._engine = engine
        # (channel, payload(s) wanted or None for any, the event to set, the set the
        # payloads heard are added to or None).
        self._waiters: list[
            tuple[str, str | Collection[str] | None, asyncio.Event, set[str] | None]
        ] = []
        self._task: asyncio.Task[None] | None = None
        self._open = asyncio.Event()
        self._names: dict[str, str] = {}  # the schema's channel name -> the channel
        self.backend_pid: int | None = None

    @asynccontextmanager
    async def subscribe(
        self,
        channel: str,
        wake: asyncio.Event,
        payload: str | Collection[str] | None = None,
        *,
        within: float = 5.0,
        heard: set[str] | None = None,
    ) -> AsyncIterator[bool]:
        """Set ``wake`` on each notification on ``channel`` (with ``payload``, or one of
        the payloads of a collection, if given), and add its payload to ``heard`` if given,
        while the block runs; yields whether the connection was listening within
        ``within`` seconds (from then on nothing sent is missed; ``False``: poll)."""
        entry = (channel, payload, wake, heard)
        self._waiters.append(entry)
        if self._task is None or self._task.done():
            self._task = asyncio.create_task(self._listen(), name="langgraph-fence LISTEN")
        try:
            try:
                await asyncio.wait_for(self._open.wait(), within)
                listening = True
            except TimeoutError:
                listening = False
            yield listening
        finally:
            self._waiters.remove(entry)
            if not self._waiters and self._task is not None:
                task, self._task = self._task, None
                task.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await task

    def _notified(self, _conn: Any, _pid: int, name: str, payload: str) -> None:
        channel = self._names.get(name)
        for wanted_channel, wanted, wake, heard in self._waiters:
            if wanted_channel != channel:
                continue
            if (
                wanted is None
                or wanted == payload
                or (not isinstance(wanted, str) and payload in wanted)
            ):
                if heard is not None:
                    heard.add(payload)
                wake.set()

    async def _listen(self) -> None:
        pause, opened_before = 0.1, False
        while self._waiters:
            dropped = asyncio.Event()
            try:
                conn = await self._engine.connect()
            except Exception as exc:
                logger.info("cannot LISTEN (%s); polling until it can, in %.1fs", exc, pause)
                await asyncio.sleep(pause)
                pause = min(pause * 2, MAX_LISTEN_BACKOFF)
                continue
            try:
                driver: Any = (await conn.get_raw_connection()).driver_connection
                driver.add_termination_listener(lambda _c, gone=dropped: gone.set())
                self._names = {}
                for channel in CHANNELS:
                    name = str((await conn.execute(CHANNEL_NAME, {"channel": channel})).scalar())
                    self._names[name] = channel
                    await driver.add_listener(name, self._notified)
                self.backend_pid = driver.get_server_pid()
                self._open.set()
                pause = 0.1
                if opened_before:
                    for _, _, wake, _ in self._waiters:
                        wake.set()  # what was sent while it was down is lost: look again
                opened_before = True
                await dropped.wait()
                logger.info("the LISTEN connection was dropped; opening it again")
            except asyncio.CancelledError:
                raise
            except Exception as exc:
                logger.info("LISTEN failed (%s); trying again in %.1fs", exc, pause)
                await asyncio.sleep(pause)
                pause = min(pause * 2, MAX_LISTEN_BACKOFF)
            finally:
                self._open.clear()
                self.backend_pid = None
                # Never given back to the pool: a connection that still LISTENs must not
                # serve other work; one the database dropped is gone anyway.
                with contextlib.suppress(Exception):
                    await conn.invalidate()
                with contextlib.suppress(Exception):
                    await conn.close()

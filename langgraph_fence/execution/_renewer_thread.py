"""The renewer thread: an event loop and database connections of its own
(:func:`~langgraph_fence.database.twin_engine`), on which the keeper's renewals run while the
instance's loop is kept busy (:mod:`langgraph_fence.execution.keeper` says when they run
there).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import logging
import math
import os
import threading
from collections.abc import Awaitable, Callable
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from langgraph_fence.lease.sql import SqlLeaseRepository

__all__ = ["RenewerThread", "cancel_and_wait", "wait_quietly"]

#: How long a stopping renewer thread waits for a renewal statement in flight to end.
SEND_GRACE = 20.0
# Its records are the keeper's: one logger for an operator to set.
logger = logging.getLogger("langgraph_fence.keeper")


class RenewerThread:
    """The renewer thread, running ``renew(thread)`` (the keeper's renewal loop) on its own
    loop, through a twin of ``source`` on connections of its own, until stopped.

    Args:
        source: the store the instance's leases are in.
        holder: the instance's holder id (the thread's name, its log lines).
        clock: the instance's clock.
        renew: the renewal loop, given this thread.
        sending: the renewal statements in flight on this thread's loop (the keeper's
            set): cancelled when the thread ends.
    """

    def __init__(
        self,
        source: SqlLeaseRepository,
        *,
        holder: str,
        clock: Callable[[], float],
        renew: Callable[[RenewerThread], Awaitable[None]],
        sending: set[asyncio.Task[None]],
    ) -> None:
        self._source = source
        self._holder = holder
        self._clock = clock
        self._renew = renew
        self._sending = sending
        self.loop = asyncio.new_event_loop()
        self.store: SqlLeaseRepository = source  # its twin, once the thread runs
        #: Set (from either thread) to end the thread.
        self.stopping = False
        self._main: asyncio.Task[None] | None = None
        self._wake = asyncio.Event()
        self._wake_at = math.inf  # when it wakes by itself, on the keeper's clock
        self._ended: concurrent.futures.Future[None] = concurrent.futures.Future()
        self._pid = os.getpid()
        self._thread = threading.Thread(
            target=self._run, name=f"langgraph-fence renewer {holder}", daemon=True
        )
        self._thread.start()

    @property
    def alive(self) -> bool:
        """Whether it renews (it has not ended and is not ending, and it runs in this
        process: a forked child has the object, not the thread)."""
        return (
            not self.stopping
            and not self._ended.done()
            and self._pid == os.getpid()
            and self._thread.is_alive()
        )

    def wake_by(self, due: float) -> None:
        """Make sure it wakes by ``due`` (called from the instance's loop)."""
        if due < self._wake_at:
            with contextlib.suppress(RuntimeError):  # ended meanwhile: keep() starts another
                self.loop.call_soon_threadsafe(self._wake.set)

    def poke(self) -> None:
        """Wake it now (on the thread's loop)."""
        self._wake.set()

    async def wait(self, seconds: float) -> None:
        """Wait ``seconds``, or until woken (on the thread's loop)."""
        self._wake_at = self._clock() + seconds
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(seconds):
                await self._wake.wait()
        self._wake.clear()
        self._wake_at = math.inf

    async def stop(self) -> None:
        """End the thread, its renewals and its connections (from the instance's loop)."""
        self.stopping = True

        def cancel() -> None:
            if self._main is not None:
                self._main.cancel()

        with contextlib.suppress(RuntimeError):  # its loop is closed: it has ended
            self.loop.call_soon_threadsafe(cancel)
        try:
            await asyncio.wait_for(asyncio.wrap_future(self._ended), 30.0)
        except TimeoutError:
            logger.warning("the renewer thread of %s did not end in 30 s", self._holder)

    def _run(self) -> None:
        asyncio.set_event_loop(self.loop)
        try:
            self.loop.run_until_complete(self._serve())
        except BaseException:
            logger.exception(
                "the renewer thread of %s failed: its leases are no longer renewed",
                self._holder,
            )
        finally:
            self.stopping = True
            with contextlib.suppress(Exception):
                self.loop.run_until_complete(self.loop.shutdown_asyncgens())
            self.loop.close()
            self._ended.set_result(None)

    async def _serve(self) -> None:
        from langgraph_fence.database import twin_engine

        self._main = asyncio.current_task()
        if self.stopping:
            return
        engine = twin_engine(self._source.engine)
        self.store = self._source.on_engine(engine)
        try:
            await self._renew(self)
        except asyncio.CancelledError:
            if not self.stopping:
                raise
        finally:
            # A renewal statement in flight is waited for, not cancelled (as on the
            # instance's loop, Keeper._stop_tasks): cancelled between its messages, an
            # asyncpg connection is left mid-statement, holding the lease row's lock until
            # the server drops it, and every take of that lease (and a DROP of its schema)
            # waits. Only one that does not end within SEND_GRACE is cancelled.
            sending = list(self._sending)
            if sending:
                _, late = await asyncio.wait(sending, timeout=SEND_GRACE)
                await cancel_and_wait(list(late))
            await engine.dispose()


async def cancel_and_wait(tasks: list[asyncio.Task[None]]) -> None:
    """Cancel ``tasks`` and wait for them to end (a failure is logged)."""
    for task in tasks:
        task.cancel()
    for task in tasks:
        try:
            await task
        except asyncio.CancelledError:
            pass
        except Exception:
            logger.exception("keeper task failed")


async def wait_quietly(tasks: list[asyncio.Task[None]]) -> None:
    """Wait for ``tasks`` to end without cancelling them, not even when the wait itself is
    cancelled (a failure is logged)."""
    if not tasks:
        return
    await asyncio.wait(tasks)
    for task in tasks:
        if not task.cancelled() and task.exception() is not None:
            logger.error("keeper task failed", exc_info=task.exception())

"""An instance's watch on its database's timeline (:mod:`langgraph_fence.lease.timeline`).

Takes and stamps refuse, in SQL, while a failover's executions are unclassified, and a
refused take settles the failover at once. The watch bounds the rest: an instance that
only renews (it takes nothing new) checks the timeline once per renew interval, on the
renewals' own connections, so its holds are classified within one interval of the
promotion. Each execution the classification dead-letters is told to the instance's
listeners (the journal among them) as ``dead_lettered``, with the failover in the reason.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncIterator

from langgraph_fence.events import EventKind, Listeners
from langgraph_fence.lease.sql import SqlLeaseRepository
from langgraph_fence.lease.timeline import FailoverReport

__all__ = ["watch_failovers"]

logger = logging.getLogger("langgraph_fence.instance")


@contextlib.asynccontextmanager
async def watch_failovers(
    repository: SqlLeaseRepository, events: Listeners, interval: float
) -> AsyncIterator[None]:
    """Settle a failover now and then every ``interval`` seconds until the block ends."""

    def tell(report: FailoverReport) -> None:
        for quarantined in report.quarantined:
            events.emit(
                EventKind.DEAD_LETTERED,
                quarantined.key.scope_key,
                quarantined.token,
                quarantined.reason,
            )

    repository.on_failover_settled(tell)
    await repository.settle_failover()
    if repository.engine.dialect.name != "postgresql":
        yield
        return

    async def watch() -> None:
        while True:
            await asyncio.sleep(interval)
            try:
                await repository.settle_failover()
            except Exception:  # the database is down: the next look tries again
                logger.debug("failover check failed", exc_info=True)

    task = asyncio.create_task(watch(), name="langgraph-fence failover watch")
    try:
        yield
    finally:
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task

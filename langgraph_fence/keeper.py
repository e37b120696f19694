"""The keeper: renewal and the watchdog of the runs an instance holds.

Every ``renew_interval`` a held run's lease is renewed (one guarded round trip; a refusal
marks the run's handle fenced, and the run drains). The watchdog stops a run whose
confirmed window ran out without a renewal getting through (the store was slow or out of
reach): its handle records a lease loss at that moment, on the instance's clock, and the
run drains. Both wait on the instance's injected ``sleep``.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable
from typing import Any

from .errors import ExecutionFencedError, ExecutionLeaseLostError
from .events import EventKind, Listeners
from .fence import RunHandle

__all__ = ["Keeper", "Sleep"]

logger = logging.getLogger(__name__)

Sleep = Callable[[float], Awaitable[Any]]


class Keeper:
    """Keeps the leases of an instance's runs: :meth:`keep` a handle while its run lasts."""

    def __init__(
        self,
        *,
        renew_interval: float,
        clock: Callable[[], float],
        sleep: Sleep,
        events: Listeners,
    ) -> None:
        self.renew_interval = renew_interval
        self._clock = clock
        self._sleep = sleep
        self._events = events

    def keep(self, handle: RunHandle) -> list[asyncio.Task[None]]:
        """Start renewing ``handle``'s lease and watching its window; returns the tasks,
        for :func:`release` when the run ends."""
        return [
            asyncio.create_task(self._renew_loop(handle), name=f"renew {handle.scope_key}"),
            asyncio.create_task(self._watchdog(handle), name=f"watchdog {handle.scope_key}"),
        ]

    async def _renew_loop(self, handle: RunHandle) -> None:
        while not isinstance(handle.error, ExecutionFencedError):
            await self._sleep(self.renew_interval)
            left = handle.confirmed_until - self._clock()
            try:
                # After a lapse this one more renewal tells a takeover (fenced) from a slow
                # store (lost); the run stops either way.
                await handle.renew()
                if left < self.renew_interval:
                    late = f"renewed with {max(left, 0.0):.1f} s of its proven hold left"
                    self._events.emit(EventKind.RENEWED_LATE, handle.scope_key, handle.token, late)
            except ExecutionLeaseLostError:
                return  # recorded on the handle; the run stops
            except Exception:
                # The store may be down for a moment: the watchdog decides when that
                # has lasted too long; until then the next renewal may get through.
                logger.warning("renewal of %s failed", handle.scope_key, exc_info=True)

    async def _watchdog(self, handle: RunHandle) -> None:
        while handle.error is None:
            remaining = handle.confirmed_until - self._clock()
            if remaining <= 0:
                try:
                    handle.check()
                except ExecutionLeaseLostError:
                    return
            await self._sleep(max(remaining, 0.0) + 1e-3)


async def release(tasks: list[asyncio.Task[None]]) -> None:
    """Stop keeping a run: cancel its keeper tasks and wait for them to end."""
    for task in tasks:
        task.cancel()
    for task in tasks:
        try:
            await task
        except asyncio.CancelledError:
            pass
        except Exception:
            logger.exception("timer task failed")

"""A controlled clock a test steps, waiting after each step for what it woke to settle.

:class:`~langgraph_fence.testing.ManualClock` wakes the sleeps whose time has come; what
they do then (a renewal, a watchdog's check, the next sleep) takes the event loop a few
turns of its own. :class:`SteppedClock` knows which task sleeps until when, so a test waits
for the real condition, "every other task on the loop sleeps on this clock, none of them
due", instead of counting loop turns.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable

from langgraph_fence.testing import ManualClock
from tests.support.polling import eventually


class SteppedClock(ManualClock):
    """A :class:`ManualClock` that knows the tasks sleeping on it, and until when."""

    def __init__(self, start: float = 1_000_000.0) -> None:
        super().__init__(start)
        self._until: dict[asyncio.Task[object], float] = {}

    async def sleep(self, seconds: float) -> None:
        task = asyncio.current_task()
        if task is None or seconds <= 0:
            await super().sleep(seconds)
            return
        self._until[task] = self() + seconds
        try:
            await super().sleep(seconds)
        finally:
            self._until.pop(task, None)

    def parked(self) -> bool:
        """Whether every task on the loop but the caller's sleeps on this clock, and none
        of those sleeps has come due (woken, it has not run yet)."""
        current = asyncio.current_task()
        now = self()
        return all(
            self._until.get(task, now) > now
            for task in asyncio.all_tasks()
            if task is not current and not task.done()
        )

    def describe(self) -> str:
        current = asyncio.current_task()
        busy = [
            task.get_name()
            for task in asyncio.all_tasks()
            if task is not current and not task.done() and task not in self._until
        ]
        return f"every task to sleep on the clock (not sleeping on it: {busy})"

    async def settled(self) -> None:
        """Wait until every other task sleeps on this clock, none due (:meth:`parked`)."""
        # interval 0: the tasks to settle need loop turns only, never wall-clock time.
        await eventually(self.parked, interval=0, what=self.describe)

    async def step_until(self, check: Callable[[], bool], *, within: float) -> None:
        """Move on a tenth of a second at a time, each step settled (:meth:`settled`), until
        ``check()`` holds; fail once the clock has moved ``within`` seconds without it."""
        until = self() + within
        await self.settled()
        while not check():
            assert self() < until, f"not within {within} s of the controlled clock"
            self.advance(0.1)
            await self.settled()

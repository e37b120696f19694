"""Durable sleep: a step waits for a time without holding anything while it waits.

``await get_execution_context().sleep(timedelta(hours=2))`` records when the sleep ends
(on the store's clock, under the step's hold, keyed by the step's task and the sleep's place
in it) and stops the run: its lease goes back ``pending`` with no holder, not to be taken
before that time, so the worker's slot and the lease are free meanwhile, and a worker killed
meanwhile loses nothing. Any worker's ``serve()`` takes the execution at the time (the next
token, as every take) and resumes it from its last checkpoint: the step runs again, its
``sleep`` finds the recorded end past and returns, and the step goes on. A step's steps
before the sleep run again (as after any resume): put the sleep first in its step, or in a
step of its own, and nothing before it that must not repeat.

The stop is a ``GraphBubbleUp`` (as LangGraph's ``interrupt()`` is): LangGraph does not
retry it, records no error for the step, and keeps what parallel steps of the superstep
wrote. To an ``Instance.ainvoke`` caller it is :class:`ExecutionSleeping`, with the time.
"""

from __future__ import annotations

import logging
from datetime import UTC, datetime
from typing import TYPE_CHECKING

from langgraph.errors import GraphBubbleUp

from langgraph_fence.errors import ExecutionFencedError
from langgraph_fence.queue import NotBefore, check_not_before

if TYPE_CHECKING:
    from langgraph_fence.fence import RunHandle
    from langgraph_fence.queue import SubmittedRuns

logger = logging.getLogger("langgraph_fence.sleep")

__all__ = ["ExecutionSleeping", "durable_sleep", "release_sleeping"]


class ExecutionSleeping(GraphBubbleUp):
    """A step of the execution sleeps until ``wake_at`` (epoch seconds, the store's clock):
    its lease was given back, and any worker's ``serve()`` resumes it then.

    Raised by :meth:`~langgraph_fence.ExecutionContext.sleep` out of the step and, for a run
    started with :meth:`~langgraph_fence.Instance.ainvoke`, to its caller.
    """

    def __init__(self, scope_key: str, wake_at: float) -> None:
        when = datetime.fromtimestamp(wake_at, UTC).isoformat(timespec="seconds")
        super().__init__(
            f"execution {scope_key!r} sleeps until {when}: its lease is given back, and a "
            "worker's serve() resumes it then"
        )
        self.scope_key = scope_key
        self.wake_at = wake_at


async def durable_sleep(
    handle: RunHandle, queue: SubmittedRuns, sleep_key: str, until: NotBefore
) -> None:
    """Sleep the step of ``handle``'s run until ``until`` (an aware ``datetime``, or a
    delay), recorded as ``sleep_key``: return at once when its recorded end is past, else
    raise :class:`ExecutionSleeping`.

    Raises:
        ExecutionSleeping: the sleep is not over; the run stops and gives its lease back.
        ExecutionFencedError: the run was taken over (nothing recorded).
        ValueError, TypeError: a bad ``until``, named.
    """
    checked = check_not_before(until)
    if checked is None:
        raise TypeError("sleep() needs until: an aware datetime, a timedelta or seconds")
    found = await queue.record_sleep(handle.lease, sleep_key, checked)
    if found is None:
        await handle.renew()  # raises the fencing error the refusal means
        raise ExecutionFencedError(
            f"the durable sleep of {handle.scope_key!r} was refused: its lease is not held",
            scope_key=handle.scope_key,
            token_held=handle.token,
            token_seen=None,
        )
    wake_at, now = found
    if now >= wake_at:
        return
    raise ExecutionSleeping(handle.scope_key, wake_at)


async def release_sleeping(
    handle: RunHandle, queue: SubmittedRuns, sleeping: ExecutionSleeping
) -> None:
    """Give the lease of ``handle``'s run back, pending until ``sleeping.wake_at``.

    Raises:
        ExecutionFencedError: the run was taken over meanwhile (its release refused).
    """
    when = datetime.fromtimestamp(sleeping.wake_at, UTC).isoformat(timespec="seconds")
    if await queue.release_sleeping(handle.lease, sleeping.wake_at, f"sleeping until {when}"):
        return
    await handle.renew()  # raises the fencing error the refusal means
    raise RuntimeError(f"the sleep of {handle.scope_key!r} could not give its lease back")

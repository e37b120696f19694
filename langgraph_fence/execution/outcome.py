"""The outcome of a run: what its end means for its lease, decided with no I/O.

From what the run's handle holds (its fencing error, its dead letter) and how the graph
ended (returned, or the exception it raised), :func:`decide_outcome` says, in this order:

1. a fencing error (recorded on the handle, or found anywhere in the exception's cause
   chain or groups) stands above everything: the run raises it, never a cancellation, a
   drain or a sibling's error in its place (guarantee 5);
2. a dead letter: the execution is dead-lettered and the dead letter raised;
3. a durable sleep of a step: handed back ``pending``, for any instance to resume when it
   wakes; a drain by request, or a cancellation (Ctrl-C, SIGTERM, a cancelled task): handed
   back ``pending`` for any instance to resume at once;
4. an infrastructure error (a database connection error anywhere in the chain): the run
   stops as lease-lost and is handed back, never ``failed`` (guarantee 6);
5. only then the graph's own error: ``failed``, with the error as reason;
6. a graph that returned: ``done`` or ``waiting``, as the caller learns how it ended
   (LangGraph's lifecycle callbacks, ``run.GraphEnd``; the thread's state where they
   cannot tell).

``run.py`` carries the decision out.
"""

from __future__ import annotations

import asyncio
import enum
from dataclasses import dataclass

from langgraph.errors import GraphDrained

from langgraph_fence.database.retry import is_database_connection_error, is_lock_conflict
from langgraph_fence.errors import (
    ExecutionDeadLetteredError,
    ExecutionLeaseLostError,
    find_error,
    find_fence_error,
    linked_errors,
)
from langgraph_fence.execution.sleeps import ExecutionSleeping
from langgraph_fence.redact import bounded_reason, failure_reason

__all__ = ["Outcome", "Settle", "decide_outcome"]


class Settle(enum.Enum):
    """How a run's end settles its lease."""

    FENCED = "fenced"  # raise the fencing error that stands (lost or taken over)
    DEAD_LETTER = "dead_letter"  # dead-letter the execution, raise the dead letter
    HAND_BACK = "hand_back"  # drained by request, or cancelled: release ``pending``
    SLEEP = "sleep"  # a step sleeps durably: release ``pending`` until it wakes
    LOST_TO_STORE = "lost_to_store"  # the store could not be reached: lease-lost, handed back
    FAILED = "failed"  # the graph's own error: release ``failed``
    ENDED = "ended"  # the graph returned: release ``done`` or ``waiting``


@dataclass(frozen=True, slots=True)
class Outcome:
    """The decision: how to settle, and with what.

    ``fence_error``: a fencing error found in the exception, to record on the handle before
    raising the one that stands (None when the handle's own stands). ``dead_letter``: the
    dead letter to dead-letter the execution with. ``raise_dead_letter``: raise it (False
    when it is the graph's exception itself, which propagates as it is). ``reason``: the
    reason stored with the release.
    """

    settle: Settle
    fence_error: ExecutionLeaseLostError | None = None
    dead_letter: ExecutionDeadLetteredError | None = None
    raise_dead_letter: bool = False
    reason: str | None = None
    sleeping: ExecutionSleeping | None = None


def decide_outcome(
    exc: BaseException | None,
    *,
    fence_error: ExecutionLeaseLostError | None,
    dead_letter: ExecutionDeadLetteredError | None,
    stopped: bool = True,
) -> Outcome:
    """How a run that ended with ``exc`` (None: the graph returned) settles its lease.

    Args:
        exc: what the graph raised, or None if it returned.
        fence_error: the fencing error recorded on the run's handle, if any.
        dead_letter: the dead letter recorded on the run's handle, if any.
        stopped: the run's own task is being cancelled (Ctrl-C, SIGTERM, its caller): a
            ``CancelledError`` is then the process stopping the run, handed back; one the
            graph raised by itself (nobody cancelled the run) is the graph's own failure,
            never handed back to be taken and fail again for ever.
    """
    found = find_fence_error(exc)
    if found is not None or fence_error is not None:
        return Outcome(Settle.FENCED, fence_error=found)
    dead = dead_letter or find_error(exc, ExecutionDeadLetteredError)
    if dead is not None:
        return Outcome(
            Settle.DEAD_LETTER,
            dead_letter=dead,
            raise_dead_letter=dead is not exc,
            reason=failure_reason(dead),
        )
    if exc is None:
        return Outcome(Settle.ENDED)
    sleeping = find_error(exc, ExecutionSleeping)
    if sleeping is not None:
        return Outcome(Settle.SLEEP, sleeping=sleeping)
    if isinstance(exc, GraphDrained):
        return Outcome(Settle.HAND_BACK, reason=bounded_reason(f"drained: {exc.reason}"))
    if any(is_database_connection_error(e) or is_lock_conflict(e) for e in linked_errors(exc)):
        return Outcome(Settle.LOST_TO_STORE, reason=failure_reason(exc))
    if isinstance(exc, asyncio.CancelledError) and stopped:
        # Ctrl-C, SIGTERM, a cancelled task: the process (or its caller) stopped the run, the
        # graph did not fail. Handed back at once, so a serving instance resumes it from its
        # last checkpoint without waiting out the lease (a write stamped mid-step is then
        # dead-lettered by that take, never repeated).
        return Outcome(
            Settle.HAND_BACK, reason="cancelled (its process stopping, or its caller): handed back"
        )
    return Outcome(Settle.FAILED, reason=failure_reason(exc))

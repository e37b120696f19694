"""What an instance tells its listeners: one frozen event per turn in a lease's life.

An :class:`~langgraph_fence.Instance` calls every listener added with
:meth:`~langgraph_fence.Instance.add_listener` with a :class:`FenceEvent` when a run of it

* ``acquired``: took an execution's lease to start or resume a run (``token`` is the run's);
* ``renewed_late``: renewed with less than one renew interval of its proven hold left (a
  renewal before it failed, or the timers ran late): the lease was close to lapsing;
* ``lost``: could no longer prove its hold (renewals failed until the hold ran out);
* ``fenced``: was refused because another worker holds a newer token (``token`` is the
  stale one this run held);
* ``taken_over``: took over, in ``serve()``, an execution whose holder died or froze
  (``token`` is the new one, ``reason`` names the old holder);
* ``dead_lettered``: dead-lettered an execution (``reason`` says why);
* ``handed_back``: drained a run and gave its execution back as ``pending``;
* ``yielded``: gave a run's lease up while the tree's only running steps wait for remote
  children (``token`` is the one it held);
* ``retaken``: took a yielded lease again before a step of the tree runs or the wait
  returns (``token`` is the new one, the old + 1).

Listeners are plain callables, called on the instance's event loop, in the order the
events happen; they must not block. A listener that raises is logged and never changes the
run: the run, the other listeners and the lease go on as if it had not been called.
Events cost no round trip: they are told what the instance learned anyway.
"""

from __future__ import annotations

import enum
import logging
import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass

__all__ = ["EventKind", "FenceEvent", "FenceListener", "Listeners"]

logger = logging.getLogger("langgraph_fence.events")


class EventKind(enum.StrEnum):
    """The kinds of :class:`FenceEvent`, in the words of the module docstring."""

    ACQUIRED = "acquired"
    RENEWED_LATE = "renewed_late"
    LOST = "lost"
    FENCED = "fenced"
    TAKEN_OVER = "taken_over"
    DEAD_LETTERED = "dead_lettered"
    HANDED_BACK = "handed_back"
    YIELDED = "yielded"
    RETAKEN = "retaken"


@dataclass(frozen=True, slots=True)
class FenceEvent:
    """One turn in the life of an execution's lease, as one instance saw it.

    Attributes:
        kind: what happened.
        scope_key: the execution's scope key (``tenant:execution``).
        token: the fencing token the event is about (see :class:`EventKind`).
        holder: the instance that saw it (its ``instance_id``).
        reason: why, in words (the error, the dead letter's reason), or ``None``.
        at: when, in seconds since the epoch (``time.time()`` of this process).
        thread_id: the execution's thread, where this instance ran it (else ``None``).
        graph: the graph name it runs under, where this instance ran it (else ``None``).
    """

    kind: EventKind
    scope_key: str
    token: int
    holder: str
    reason: str | None = None
    at: float = 0.0
    thread_id: str | None = None
    graph: str | None = None


FenceListener = Callable[[FenceEvent], object]


#: How many executions' thread and graph an instance remembers for its events.
DESCRIBED = 10_000


class Listeners:
    """The listeners of one instance, and the one place events are sent from."""

    __slots__ = ("_described", "_holder", "_listeners")

    def __init__(self, holder: str) -> None:
        self._holder = holder
        self._listeners: list[FenceListener] = []
        self._described: OrderedDict[str, tuple[str, str | None]] = OrderedDict()

    def describe(self, scope_key: str, thread_id: str, graph: str | None) -> None:
        """Name the thread and graph of ``scope_key``'s run: its events carry them (the
        :data:`DESCRIBED` most recent executions are remembered)."""
        if not self._listeners:
            return
        self._described[scope_key] = (thread_id, graph)
        self._described.move_to_end(scope_key)
        while len(self._described) > DESCRIBED:
            self._described.popitem(last=False)

    def add(self, listener: FenceListener) -> Callable[[], None]:
        """Add ``listener``; returns a function that removes it again."""
        if not callable(listener):
            raise ValueError(f"listener must be a callable taking a FenceEvent, got {listener!r}")
        self._listeners.append(listener)

        def remove() -> None:
            if listener in self._listeners:
                self._listeners.remove(listener)

        return remove

    def emit(self, kind: EventKind, scope_key: str, token: int, reason: str | None = None) -> None:
        """Tell every listener; one that raises is logged and the others still hear."""
        if not self._listeners:
            return
        thread_id, graph = self._described.get(scope_key, (None, None))
        event = FenceEvent(
            kind, scope_key, token, self._holder, reason, time.time(), thread_id, graph
        )
        for listener in list(self._listeners):
            try:
                listener(event)
            except Exception:
                logger.exception(
                    "event listener %r failed on %s of %s at token %d",
                    listener,
                    kind.value,
                    scope_key,
                    token,
                    extra={"scope_key": scope_key, "token": token},
                )

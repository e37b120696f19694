"""The garbage collector's full passes, kept shorter than the leases held can wait.

CPython's cyclic collector stops the whole process (every thread: the renewer thread too)
for a full pass, and a full pass walks every object the process tracks. An instance that
holds thousands of runs holds millions of objects, nearly all long-lived: measured, full
passes grew from 0.2 s to 2.7 s as 10 000 runs started at TTL 3 s, collected nothing, and
every lease lapsed behind them (``benchmarks/bench_scale.py``).

While a keeper of the process holds leases, this module, process-wide:

* every :data:`PERIOD` seconds (looked at where a keeper waits for its next renewal, so
  never while a renewal is due), collects what is not frozen, then moves every object that
  survived into the permanent generation (``gc.freeze()``): the interpreter's own full
  passes then walk only what became long-lived since, a pause bounded by the period, not
  by the heap. What it froze is counted as it goes; the frozen set is counted exactly (a
  walk of it) at most once a :data:`RECOUNT`, and only when a full pass may be due;
* makes the full pass over everything (``gc.unfreeze()``, ``gc.collect()``,
  ``gc.freeze()``), which returns the memory of unreachable cycles among the frozen
  objects, when the frozen set has grown by a quarter since the last one (CPython's own
  rule) and either no keeper of the process holds a lease or the pass fits in half the
  smallest slack a held lease has beyond its renewal (``Keeper.margin``). The pass is
  estimated from the slowest pace a pass has had here, scaled up for a larger heap (the
  pace per object grows with the heap: cache misses);
* otherwise puts the full pass off, and says so once the frozen set has doubled meanwhile,
  naming the fix (a longer TTL or fewer runs per instance): memory held by unreachable
  cycles comes back at the next pass that fits, at the latest at a look while the process
  holds no lease;
* when no open keeper holds a lease any more (the last one closed, or the others hold
  nothing), unfreezes what it froze.

An application that froze objects itself (``gc.freeze()`` before a fork) when the first
keeper came, or that disabled the collector, is left alone. The collector is the
process's: ``Instance(manage_gc=False)`` keeps an instance out of it, and an application
that runs the collector itself passes it to every instance.
"""

from __future__ import annotations

import gc
import logging
import threading
import time
import weakref
from collections.abc import Callable
from typing import Protocol

__all__ = ["PERIOD", "RECOUNT", "Collector", "Kept", "collector"]

logger = logging.getLogger("langgraph_fence.collector")

#: Seconds between two looks: what became long-lived in that time is what the
#: interpreter's own full passes still walk.
PERIOD = 5.0
#: Seconds a full pass takes per tracked object until one was measured here: above what
#: CPython 3.11 to 3.13 take on a 2-core box (0.06 to 0.15 µs at 0.2 to 2 million objects).
FIRST_PACE = 0.5e-6
#: How the pace per object grows with the heap: (heap / heap measured) ** this (measured:
#: 2.2 times slower per object at 10 times the objects).
PACE_GROWTH = 0.35
#: A full pass when the frozen set has grown by this share since the last one.
GROWTH = 0.25
#: Seconds between two exact counts of the frozen set (a walk of all of it).
RECOUNT = 60.0


class Kept(Protocol):
    """What the collector asks a keeper: how many runs it holds or is starting (a lease
    being taken is not renewed yet, and lapses as a held one would), and the window a held
    lease has left beyond its renewal (seconds) when its renewal goes out on time."""

    @property
    def busy(self) -> int: ...

    @property
    def margin(self) -> float: ...


class Collector:
    """The process's collector under the keepers' watch (:mod:`this module <.collector>`).

    Thread-safe: keepers on the instance's loop and in renewer threads call :meth:`look`.
    """

    def __init__(
        self, clock: Callable[[], float] = time.monotonic, *, growth: float = GROWTH
    ) -> None:
        self._clock = clock
        self._growth = growth
        self._lock = threading.Lock()
        self._keepers: weakref.WeakSet[Kept] = weakref.WeakSet()
        self._next = 0.0
        self._recount_at = 0.0
        #: Whether it manages the collector now (it froze, and unfreezes when done).
        self.managing = False
        #: Seconds per object of the slowest full pass here, and the objects it walked
        #: (the pace on a larger heap is scaled up from it: :meth:`estimate`).
        self.pace = FIRST_PACE
        self.paced_at = 0
        #: The frozen set's size after the last full pass (``None``: none yet), and now (at
        #: most: objects that died since they were frozen are counted until a recount).
        self.after_full: int | None = None
        self.frozen = 0
        #: Full passes made, and put off (for tests and benchmarks).
        self.full_passes = 0
        self.put_off = 0
        self._told = False

    @property
    def watching(self) -> int:
        """How many keepers it watches."""
        return len(self._keepers)

    def join(self, keeper: Kept) -> None:
        """Watch ``keeper`` from now until :meth:`leave`."""
        with self._lock:
            self._keepers.add(keeper)

    def leave(self, keeper: Kept) -> None:
        """``keeper`` closed; once no keeper left holds a lease, what was frozen thaws."""
        with self._lock:
            self._keepers.discard(keeper)
            if not any(k.busy for k in list(self._keepers)):
                self._thaw()

    def _thaw(self) -> None:
        if self.managing:
            gc.unfreeze()
        self.managing = False
        self.after_full = None
        self._next = self._recount_at = 0.0

    def estimate(self, objects: int) -> float:
        """Seconds a full pass over ``objects`` tracked objects would stop the process."""
        if not self.paced_at:  # none measured: FIRST_PACE, slow for any heap already
            return objects * self.pace
        scale: float = max(1.0, objects / self.paced_at) ** PACE_GROWTH
        return objects * self.pace * scale

    def look(self) -> None:
        """Freeze what survived since the last look, and make the full pass if it is due
        and fits (see the module); at most once a :data:`PERIOD`."""
        now = self._clock()
        if now < self._next:
            return
        if not self._lock.acquire(blocking=False):
            return  # another thread is looking
        try:
            self._next = now + PERIOD
            keepers = list(self._keepers)
            held = sum(k.busy for k in keepers)
            if not held:
                if self.managing:
                    assert self.after_full is not None  # set by the first look
                    if gc.get_freeze_count() > self.after_full * (1 + self._growth):
                        self._full_pass(refreeze=False)  # nothing held: no pause costs
                self._thaw()
                return
            if not gc.isenabled():
                return  # the application runs the collector itself
            budget = min((k.margin for k in keepers if k.busy), default=float("inf")) / 2
            if not self.managing:
                if gc.get_freeze_count():
                    return  # the application froze objects itself: its collector
                self.managing = True
                # The first look: nothing frozen yet, so only the young generations are
                # collected (a pass over everything is what this keeps off), then
                # start-up's objects and the runs' are frozen and counted once.
                gc.collect(1)
                gc.freeze()
                self.frozen = self.after_full = gc.get_freeze_count()
                return
            # What is not frozen: short-lived cycles and those that reached the old
            # generation since the last look go now, not into the frozen set.
            gc.collect()
            # What survived is the unfrozen old generation now: counted by a walk of it
            # alone, not of the whole frozen set (about 25 ns an object: 0.4 s at 30 000
            # runs held).
            added = len(gc.get_objects(generation=2))
            gc.freeze()
            assert self.after_full is not None  # set by the first look
            # Frozen objects that died since are not taken off: the count only grows, and
            # is made exact before it decides anything.
            self.frozen += added
            due = self.after_full * (1 + self._growth)
            if self.frozen <= due or now < self._recount_at:
                return
            self._recount_at = now + RECOUNT
            self.frozen = frozen = gc.get_freeze_count()
            if frozen <= due:
                return
            estimate = self.estimate(frozen)
            if estimate > budget:
                self.put_off += 1
                if not self._told and frozen > 2 * self.after_full:
                    self._told = True
                    logger.warning(
                        "the garbage collector's full pass is put off while %d leases are "
                        "held: it would stop this process for about %.1f s, longer than "
                        "they can wait (%.1f s); memory of unreachable cycles comes back "
                        "when a pass fits or the process holds no lease. A longer "
                        "lease_ttl or fewer runs per instance lets it run",
                        held,
                        estimate,
                        budget,
                    )
                return
            self._full_pass(refreeze=True)
        finally:
            self._lock.release()

    def _full_pass(self, *, refreeze: bool) -> None:
        """The pass over everything, frozen included; its pace noted for the estimates.
        With ``refreeze`` what survived is frozen again (leases are still held)."""
        gc.unfreeze()
        # What the pass walks: every tracked object, the frozen and the rest (counted
        # with a walk a twentieth as long as the pass's).
        walked = len(gc.get_objects())
        started = time.perf_counter()
        gc.collect()
        took = time.perf_counter() - started
        if walked:
            pace = took / walked
            if self.full_passes == 0 or pace > self.pace:
                self.pace, self.paced_at = pace, walked
        self.full_passes += 1
        self._told = False
        if refreeze:
            gc.freeze()
            self.frozen = self.after_full = gc.get_freeze_count()


_COLLECTOR = Collector()


def collector() -> Collector:
    """The process's one :class:`Collector`."""
    return _COLLECTOR

"""The garbage collector's full passes, kept shorter than the leases held can wait.

CPython's cyclic collector stops the whole process (every thread: the renewer thread too)
for a full pass, and a full pass walks every object the process tracks. An instance that
holds thousands of runs holds millions of objects, nearly all long-lived: measured, full
passes grew from 0.2 s to 2.7 s as 10 000 runs started at TTL 3 s, collected nothing, and
every lease lapsed behind them (``benchmarks/bench_scale.py``).

While any keeper of the process is open, this module:

* every :data:`PERIOD` seconds (checked where the keepers already wake), collects the young
  generations, then moves every object that survived into the permanent generation
  (``gc.freeze()``): the interpreter's own full passes then walk only what became
  long-lived since, a pause bounded by the period, not by the heap. What it froze is
  counted as it goes; the frozen set is counted exactly (a walk of it) at most once a
  :data:`RECOUNT`, and only when a full pass may be due;
* makes the full pass itself (``gc.unfreeze()``, ``gc.collect()``, ``gc.freeze()``), which
  returns the memory of unreachable cycles among the frozen objects, when the frozen set
  has grown by a quarter since the last one (CPython's own rule) and either nothing is held
  or the pass, estimated from the last one's pace, fits in half the smallest slack a held
  lease has between its renewals (``Keeper.margin``): no lease waits longer than it can;
* otherwise puts the full pass off, and says so once the frozen set has doubled meanwhile,
  naming the fix (a longer TTL or fewer runs per instance): memory held by unreachable
  cycles comes back at the next pass that fits, at the latest when the instance holds
  nothing;
* when the last keeper closes, unfreezes: the process's collector is as it found it.

``Instance(manage_gc=False)`` leaves the collector alone.
"""

from __future__ import annotations

import gc
import logging
import threading
import time
import weakref
from collections.abc import Callable
from typing import Protocol

__all__ = ["PERIOD", "Collector", "Kept", "collector"]

logger = logging.getLogger("langgraph_fence.collector")

#: Seconds between two looks: what became long-lived in that time is what the
#: interpreter's own full passes still walk.
PERIOD = 5.0
#: Seconds a full pass takes per tracked object until one was measured: on the slow side
#: of what CPython 3.11 to 3.13 take (0.3 to 0.6 µs on a 2-core box).
FIRST_PACE = 1e-6
#: A full pass when the frozen set has grown by this share since the last one.
GROWTH = 0.25
#: Seconds between two exact counts of the frozen set (a walk of all of it).
RECOUNT = 60.0


class Kept(Protocol):
    """What the collector asks a keeper: how many leases it holds, and the window a held
    lease has left beyond its renewal (seconds) when its renewal goes out on time."""

    @property
    def held(self) -> int: ...

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
        #: Seconds a full pass took per object, the last one measured.
        self.pace = FIRST_PACE
        #: The frozen set's size after the last full pass (``None``: none yet), and now (at
        #: most: objects that died since they were frozen are counted until a recount).
        self.after_full: int | None = None
        self.frozen = 0
        self._recount_at = 0.0
        #: Full passes made, and put off (for tests and benchmarks).
        self.full_passes = 0
        self.put_off = 0
        self._told = False

    def join(self, keeper: Kept) -> None:
        """Watch for ``keeper`` from now until :meth:`leave`."""
        with self._lock:
            self._keepers.add(keeper)

    def leave(self, keeper: Kept) -> None:
        """``keeper`` closed; the last one to leave unfreezes the process's objects."""
        with self._lock:
            self._keepers.discard(keeper)
            if len(self._keepers) == 0:
                gc.unfreeze()
                self.after_full = None
                self._next = self._recount_at = 0.0

    def look(self, *, force: bool = False) -> None:
        """Freeze what survived since the last look, and make the full pass if it is due
        and fits (see the module); at most once a :data:`PERIOD` unless ``force``."""
        if not gc.isenabled():
            return  # the application runs the collector itself
        now = self._clock()
        if not force and now < self._next:
            return
        if not self._lock.acquire(blocking=False):
            return  # another thread is looking
        try:
            self._next = now + PERIOD
            keepers = list(self._keepers)
            if not keepers:
                return
            held = sum(k.held for k in keepers)
            budget = min((k.margin for k in keepers if k.held), default=float("inf")) / 2
            gc.collect(1)  # the short-lived cycles go now, not into the frozen set
            # What survived since the last look is the unfrozen old generation now: counted
            # by a walk of it alone, not of the whole frozen set (which takes about 25 ns an
            # object: 0.4 s at 30 000 runs held).
            added = len(gc.get_objects(generation=2))
            gc.freeze()
            if self.after_full is None:
                # The first look: start-up's objects, frozen and counted once.
                self.frozen = self.after_full = gc.get_freeze_count()
                return
            # Frozen objects that died since are not taken off: the count only grows, and is
            # made exact before it decides anything.
            self.frozen += added
            due = self.after_full * (1 + self._growth)
            if self.frozen <= due or now < self._recount_at:
                return
            self._recount_at = now + RECOUNT
            self.frozen = frozen = gc.get_freeze_count()
            if frozen <= due:
                return
            estimate = frozen * self.pace
            if held and estimate > budget:
                self.put_off += 1
                if not self._told and frozen > 2 * self.after_full:
                    self._told = True
                    logger.warning(
                        "the garbage collector's full pass is put off while %d leases are "
                        "held: it would stop this process for about %.1f s, longer than "
                        "they can wait (%.1f s); memory of unreachable cycles comes back "
                        "when a pass fits or the instance holds nothing. A longer lease_ttl "
                        "or fewer runs per instance lets it run",
                        held,
                        estimate,
                        budget,
                    )
                return
            started = time.perf_counter()
            gc.unfreeze()
            gc.collect()
            gc.freeze()
            took = time.perf_counter() - started
            self.pace = max(took / max(frozen, 1), 1e-9)
            self.frozen = self.after_full = gc.get_freeze_count()
            self.full_passes += 1
            self._told = False
        finally:
            self._lock.release()


_COLLECTOR = Collector()


def collector() -> Collector:
    """The process's one :class:`Collector`."""
    return _COLLECTOR

"""The garbage collector's full passes under the keepers' watch: put off while leases are
held and the pass would outlast their slack, made once it fits or nothing is held, and
what was frozen thawed when no keeper holds a lease; an application's own freeze, or its
disabled collector, left alone.

The collector is process-wide state: each test uses a collector of its own (a clock is
injected: time is the mock here, never a sleep) and leaves nothing frozen.
"""

from __future__ import annotations

import gc
import weakref
from collections.abc import Iterator
from dataclasses import dataclass

import pytest
from langgraph.checkpoint.memory import InMemorySaver

from langgraph_fence import Instance, MemoryLeaseRepository
from langgraph_fence.execution.collector import PERIOD, RECOUNT, Collector, collector
from langgraph_fence.testing import ManualClock

#: Objects kept alive so that a look finds the frozen set grown (well beyond the frozen
#: objects that die between two looks).
GROWN: list[list[list[None]]] = []


def grow() -> None:
    GROWN.append([[] for _ in range(20_000)])


def look_later(watch: Collector, clock: ManualClock, seconds: float = RECOUNT) -> None:
    """A look ``seconds`` on (by default one that may count the frozen set again), with
    the frozen set grown meanwhile."""
    grow()
    clock.advance(seconds)
    watch.look()


@dataclass(eq=False)
class Busy:
    """A keeper as the collector sees it: the runs it holds, and their slack (seconds)."""

    busy: int
    margin: float


class Cycle:
    """An object in a reference cycle: only the cyclic collector frees it."""

    def __init__(self) -> None:
        self.me = self


@pytest.fixture
def thawed() -> Iterator[None]:
    if not gc.isenabled():
        pytest.skip("the test process runs without the cyclic collector")
    gc.unfreeze()
    yield
    gc.unfreeze()
    GROWN.clear()


def test_a_full_pass_that_would_outlast_the_leases_slack_waits_until_nothing_is_held(
    thawed: None,
) -> None:
    clock = ManualClock()
    watch = Collector(clock, growth=0.0)
    keeper = Busy(busy=10_000, margin=1.7)  # TTL 3 s, renewed every second
    watch.join(keeper)
    watch.look()  # the first look freezes what there is
    assert gc.get_freeze_count() > 0
    watch.pace = 1.0  # a second per object: no pass fits in 0.85 s
    cycle = Cycle()
    seen = weakref.ref(cycle)
    look_later(watch, clock)  # the cycle, alive, is frozen
    del cycle  # ...and unreachable now: only a full pass returns it
    assert watch.put_off == 1
    look_later(watch, clock)
    assert watch.put_off == 2
    assert watch.full_passes == 0
    assert seen() is not None, "a full pass ran while the leases could not wait for it"

    keeper.busy = 0
    look_later(watch, clock, PERIOD)
    assert watch.full_passes == 1
    assert seen() is None, "nothing was held, and the unreachable cycle was kept"
    assert gc.get_freeze_count() == 0, "nothing is held: what was frozen thaws"
    watch.leave(keeper)


def test_a_full_pass_that_fits_runs_while_leases_are_held(thawed: None) -> None:
    clock = ManualClock()
    watch = Collector(clock, growth=0.0)
    keeper = Busy(busy=3, margin=18.0)  # TTL 30 s
    watch.join(keeper)
    watch.look()
    cycle = Cycle()
    seen = weakref.ref(cycle)
    look_later(watch, clock)
    del cycle
    assert watch.full_passes == 1
    look_later(watch, clock)
    assert watch.full_passes == 2
    assert watch.put_off == 0
    assert seen() is None
    assert gc.get_freeze_count() > 0, "frozen again after the pass, leases still held"
    watch.leave(keeper)


def test_looks_are_at_most_once_a_period(thawed: None) -> None:
    clock = ManualClock()
    watch = Collector(clock, growth=0.0)
    keeper = Busy(busy=1, margin=18.0)
    watch.join(keeper)
    watch.look()
    grow()
    watch.look()
    clock.advance(PERIOD / 2)
    watch.look()
    assert watch.full_passes == 0, "looked again within the period"
    clock.advance(PERIOD / 2)
    watch.look()
    assert watch.full_passes == 1
    watch.leave(keeper)


def test_what_was_frozen_thaws_when_no_keeper_holds_a_lease(thawed: None) -> None:
    watch = Collector(ManualClock())
    first, second = Busy(busy=1, margin=1.7), Busy(busy=1, margin=1.7)
    forgotten = Busy(busy=0, margin=1.7)  # an instance nobody closed, holding nothing
    for keeper in (first, second, forgotten):
        watch.join(keeper)
    watch.look()
    assert gc.get_freeze_count() > 0
    watch.leave(first)
    assert gc.get_freeze_count() > 0, "thawed while a keeper still holds leases"
    watch.leave(second)
    assert gc.get_freeze_count() == 0
    assert not watch.managing


def test_an_applications_own_freeze_is_left_as_it_is(thawed: None) -> None:
    gc.freeze()  # before a fork, say
    frozen = gc.get_freeze_count()
    clock = ManualClock()
    watch = Collector(clock, growth=0.0)
    keeper = Busy(busy=1, margin=18.0)
    watch.join(keeper)
    watch.look()
    look_later(watch, clock)
    watch.leave(keeper)
    assert watch.full_passes == 0
    assert gc.get_freeze_count() >= frozen, "the application's frozen objects were thawed"


def test_an_application_that_disabled_the_collector_is_left_alone(thawed: None) -> None:
    watch = Collector(ManualClock())
    keeper = Busy(busy=1, margin=1.7)
    watch.join(keeper)
    gc.disable()
    try:
        watch.look()
        assert gc.get_freeze_count() == 0
    finally:
        gc.enable()
    watch.leave(keeper)


async def test_an_instance_is_watched_until_it_closes_unless_it_opts_out() -> None:
    before = collector().watching
    managed = Instance(MemoryLeaseRepository(), InMemorySaver())
    left_alone = Instance(MemoryLeaseRepository(), InMemorySaver(), manage_gc=False)
    assert collector().watching == before + 1
    await managed.aclose()
    await left_alone.aclose()
    assert collector().watching == before


def test_manage_gc_must_be_a_bool() -> None:
    with pytest.raises(ValueError, match=r"manage_gc must be True or False.*'yes'"):
        Instance(MemoryLeaseRepository(), InMemorySaver(), manage_gc="yes")  # type: ignore[arg-type]


def test_a_pass_is_estimated_slower_per_object_on_a_larger_heap() -> None:
    watch = Collector(ManualClock())
    first = watch.estimate(1_000_000)
    assert first == pytest.approx(1_000_000 * watch.pace), "nothing measured: the first pace"
    watch.pace, watch.paced_at = 1e-7, 200_000  # a pass measured on a small heap
    assert watch.estimate(200_000) == pytest.approx(0.02)
    # Ten times the objects: about twice as long per object (cache misses), as measured.
    assert watch.estimate(2_000_000) > 20 * watch.estimate(200_000)

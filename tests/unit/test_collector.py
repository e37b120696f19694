"""The garbage collector's full passes under the keepers' watch: put off while leases are
held and the pass would outlast their slack, made once it fits or nothing is held, and the
process's collector left as it was found when the last keeper closes.

The collector is process-wide state: each test uses a collector of its own and unfreezes
on the way out. A clock is injected (time is the mock here, never a sleep).
"""

from __future__ import annotations

import gc
import weakref
from collections.abc import Iterator
from dataclasses import dataclass

import pytest
from langgraph.checkpoint.memory import InMemorySaver

from langgraph_fence import Instance, MemoryLeaseRepository
from langgraph_fence.execution.collector import PERIOD, RECOUNT, Collector
from langgraph_fence.testing import ManualClock


@dataclass(eq=False)
class Held:
    """A keeper as the collector sees it: the leases it holds and their slack (seconds)."""

    held: int
    margin: float


#: Objects kept alive so that a look finds the frozen set grown.
GROWN: list[list[list[None]]] = []


class Cycle:
    """An object in a reference cycle: only the cyclic collector frees it."""

    def __init__(self) -> None:
        self.me = self


def frozen_then_dropped(collector: Collector, clock: ManualClock) -> weakref.ref[Cycle]:
    """A cycle that lived through a look (so it is frozen), then became unreachable: the
    memory only a full pass returns."""
    cycle = Cycle()
    seen = weakref.ref(cycle)
    clock.advance(RECOUNT)  # a look that may count the frozen set again
    collector.look()
    del cycle
    GROWN.append([[] for _ in range(100)])  # what the next look finds grown
    return seen


@pytest.fixture
def thawed() -> Iterator[None]:
    if not gc.isenabled():
        pytest.skip("the test process runs without the cyclic collector")
    yield
    gc.unfreeze()
    GROWN.clear()


def test_a_full_pass_that_would_outlast_the_leases_slack_waits_until_nothing_is_held(
    thawed: None,
) -> None:
    clock = ManualClock()
    collector = Collector(clock, growth=0.0)
    keeper = Held(held=10_000, margin=1.7)  # TTL 3 s, renewed every second
    collector.join(keeper)
    collector.look()  # the first look freezes what start-up left
    collector.pace = 1.0  # a second per object: no pass fits in 0.85 s
    cycle = frozen_then_dropped(collector, clock)
    assert collector.put_off == 1
    assert collector.full_passes == 0
    GROWN.append([[] for _ in range(100)])
    clock.advance(RECOUNT)
    collector.look()
    assert collector.put_off == 2
    assert collector.full_passes == 0
    assert cycle() is not None, "a full pass ran while the leases could not wait for it"
    assert gc.get_freeze_count() > 0

    keeper.held = 0
    GROWN.append([[] for _ in range(100)])
    clock.advance(RECOUNT)
    collector.look()
    assert collector.full_passes == 1
    assert cycle() is None, "nothing was held, and the unreachable cycle was kept"
    collector.leave(keeper)


def test_a_full_pass_that_fits_runs_while_leases_are_held(thawed: None) -> None:
    clock = ManualClock()
    collector = Collector(clock, growth=0.0)
    keeper = Held(held=3, margin=18.0)  # TTL 30 s
    collector.join(keeper)
    collector.look()
    collector.pace = 1e-9
    cycle = frozen_then_dropped(collector, clock)
    assert collector.full_passes == 1
    clock.advance(RECOUNT)
    collector.look()
    assert collector.full_passes == 2
    assert collector.put_off == 0
    assert cycle() is None
    collector.leave(keeper)


def test_looks_are_at_most_once_a_period(thawed: None) -> None:
    clock = ManualClock()
    collector = Collector(clock, growth=0.0)
    keeper = Held(held=0, margin=1.7)
    collector.join(keeper)
    collector.look()
    GROWN.append([[] for _ in range(100)])
    collector.look()
    clock.advance(PERIOD / 2)
    collector.look()
    assert collector.full_passes == 0, "looked again within the period"
    clock.advance(PERIOD / 2)
    collector.look()
    assert collector.full_passes == 1
    collector.leave(keeper)


def test_the_last_keeper_to_close_leaves_nothing_frozen(thawed: None) -> None:
    clock = ManualClock()
    collector = Collector(clock)
    first, second = Held(held=1, margin=1.7), Held(held=1, margin=1.7)
    collector.join(first)
    collector.join(second)
    collector.look()
    assert gc.get_freeze_count() > 0
    collector.leave(first)
    assert gc.get_freeze_count() > 0, "unfrozen while a keeper still holds leases"
    collector.leave(second)
    assert gc.get_freeze_count() == 0


def test_an_application_that_disabled_the_collector_is_left_alone(thawed: None) -> None:
    collector = Collector(ManualClock())
    collector.join(Held(held=1, margin=1.7))
    gc.disable()
    try:
        collector.look()
        assert gc.get_freeze_count() == 0
    finally:
        gc.enable()


def test_manage_gc_must_be_a_bool() -> None:
    with pytest.raises(ValueError, match=r"manage_gc must be True or False.*'yes'"):
        Instance(MemoryLeaseRepository(), InMemorySaver(), manage_gc="yes")  # type: ignore[arg-type]

"""The takeover loop, step by step, with no wall clock.

``Server.poll_once()`` is one look at the store; the loop pauses on the server's injected
``sleep`` between looks. Here both run on a :class:`~langgraph_fence.testing.ManualClock`:
an expired execution is taken over by the first look, the loop looks again only once the
clock has moved by ``poll_interval``, and a store that cannot be read makes it back off
(doubling, bounded), never stop.
"""

from __future__ import annotations

import asyncio
import operator
from typing import Annotated, Any, TypedDict

import pytest
from langgraph.checkpoint.memory import InMemorySaver
from langgraph.graph import END, START, StateGraph
from sqlalchemy.exc import InterfaceError

from langgraph_fence import LeaseKey, LeaseStatus, MemoryLeaseRepository, fence_graph
from langgraph_fence.execution.serve import MAX_SERVE_BACKOFF, Server
from langgraph_fence.instance import Instance
from langgraph_fence.lease.records import ExecutionRecord
from langgraph_fence.testing import ManualClock
from tests.support.polling import eventually

TTL = 30.0
POLL = 60.0  # far longer than any deadline here: a wall-clock pause would show


class Log(TypedDict, total=False):
    log: Annotated[list[str], operator.add]


def graph_on(instance: Instance) -> Any:
    builder: StateGraph[Log] = StateGraph(Log)
    builder.add_node("step", lambda state: {"log": ["ran"]})
    builder.add_edge(START, "step")
    builder.add_edge("step", END)
    fence_graph(builder)
    return builder.compile(checkpointer=instance.checkpointer, name="g")


@pytest.fixture
def clock() -> ManualClock:
    return ManualClock()


@pytest.fixture
def instance(clock: ManualClock) -> Instance:
    store = MemoryLeaseRepository(clock=clock)
    return Instance(
        store, InMemorySaver(), instance_id="B", lease_ttl=TTL, clock=clock, sleep=clock.sleep
    )


async def expired(instance: Instance, clock: ManualClock, name: str) -> LeaseKey:
    """An execution of graph ``g`` recorded with input, whose holder died holding it."""
    key = LeaseKey("tenant", name)
    await instance.records.record(ExecutionRecord(key, "g", name, {"log": []}))
    assert await instance.repository.acquire(key, "died", TTL) is not None
    clock.advance(TTL + 1)
    return key


def server_of(instance: Instance, clock: ManualClock, **options: Any) -> Server:
    return Server(
        instance.host,
        {"g": graph_on(instance)},
        concurrency=options.get("concurrency", 4),
        poll_interval=options.get("poll", POLL),
        max_takeovers=3,
        kwargs={},
        sleep=options.get("sleep", clock.sleep),
    )


async def test_one_look_takes_an_expired_execution_over_and_runs_it(
    instance: Instance, clock: ManualClock
) -> None:
    key = await expired(instance, clock, "a")
    server = server_of(instance, clock)
    assert await server.poll_once() == POLL
    lease = await instance.repository.get(key)
    assert lease is not None
    assert lease.holder == "B"
    assert lease.epoch == 2
    (task,) = server.running
    await task
    lease = await instance.repository.get(key)
    assert lease is not None
    assert lease.status is LeaseStatus.DONE
    assert await server.poll_once() == POLL
    assert not server.running  # the ended run is forgotten by the next look


async def test_a_full_loop_takes_no_more_than_its_concurrency_per_look(
    instance: Instance, clock: ManualClock
) -> None:
    keys = [await expired(instance, clock, f"c{i}") for i in range(3)]
    server = server_of(instance, clock, concurrency=2)
    await server.poll_once()
    holders = [await instance.repository.get(k) for k in keys]
    assert sum(1 for lease in holders if lease is not None and lease.holder == "B") == 2
    await asyncio.gather(*server.running)
    await server.poll_once()  # the slots are free again: the third is taken now
    await asyncio.gather(*server.running)
    for k in keys:
        lease = await instance.repository.get(k)
        assert lease is not None
        assert lease.status is LeaseStatus.DONE


async def test_the_loop_looks_again_only_when_its_clock_has_moved_by_the_poll_interval(
    instance: Instance, clock: ManualClock
) -> None:
    # What the loop does, in order: each look (with the number of pauses ended before it),
    # each pause it begins (on the clock, for how long) and each that ends.
    looks: list[int] = []
    pauses: list[tuple[float, float]] = []
    ended: list[float] = []
    paused = asyncio.Event()

    async def pause(seconds: float) -> None:
        pauses.append((clock(), seconds))
        paused.set()
        await clock.sleep(seconds)
        ended.append(clock())

    server = server_of(instance, clock, sleep=pause)
    take_work = server.take_work

    async def counted(free: int, *, sweep: bool = True) -> None:
        looks.append(len(ended))
        await take_work(free, sweep=sweep)

    server.take_work = counted  # type: ignore[method-assign]
    stop = asyncio.Event()
    loop = asyncio.create_task(server.run(stop))
    await paused.wait()  # after its first look the loop pauses, on the clock, for POLL
    assert looks == [0]
    ((began, seconds),) = pauses
    assert seconds == POLL
    clock.advance(POLL - 0.1)
    key = await expired(instance, clock, "late")  # advances past the pause as well
    await eventually(lambda: len(looks) >= 2, timeout=5.0)
    # The second look came of the pause's end, never before it, and the pause lasted the
    # poll interval on the loop's clock: no wall clock, no other wake-up.
    assert looks[1] == 1
    assert ended[0] >= began + POLL

    async def done() -> bool:
        lease = await instance.repository.get(key)
        return lease is not None and lease.status is LeaseStatus.DONE

    await eventually(done)  # taken by the second look, and run to its end
    stop.set()
    await loop


async def test_a_store_that_cannot_be_read_makes_the_loop_back_off_never_stop(
    instance: Instance, clock: ManualClock
) -> None:
    server = server_of(instance, clock, poll=1.0)
    candidates = instance.repository.takeover_candidates

    async def down(**_: Any) -> Any:
        raise InterfaceError("SELECT", {}, ConnectionResetError("reset"))

    instance.repository.takeover_candidates = down  # type: ignore[method-assign]
    pauses = [await server.poll_once() for _ in range(5)]
    assert pauses == [2.0, 4.0, 8.0, MAX_SERVE_BACKOFF, MAX_SERVE_BACKOFF]
    instance.repository.takeover_candidates = candidates  # type: ignore[method-assign]
    key = await expired(instance, clock, "after")
    assert await server.poll_once() == 1.0  # back: the next look is at the usual pace
    await asyncio.gather(*server.running)
    lease = await instance.repository.get(key)
    assert lease is not None
    assert lease.status is LeaseStatus.DONE


async def test_a_full_instance_defers_takeovers_until_a_run_ends(clock: ManualClock) -> None:
    store = MemoryLeaseRepository(clock=clock)
    instance = Instance(
        store, InMemorySaver(), instance_id="B", lease_ttl=TTL, clock=clock, max_held=1
    )
    go, entered = asyncio.Event(), asyncio.Event()

    async def wait(state: Log) -> Log:
        entered.set()
        await go.wait()
        return {"log": ["held"]}

    builder: StateGraph[Log] = StateGraph(Log)
    builder.add_node("wait", wait)
    builder.add_edge(START, "wait")
    builder.add_edge("wait", END)
    holding = fence_graph(builder).compile(checkpointer=instance.checkpointer, name="hold")
    key = await expired(instance, clock, "deferred")
    run = asyncio.create_task(
        instance.ainvoke(holding, {"log": []}, {"configurable": {"thread_id": "h"}}, tenant_id="t")
    )
    await asyncio.wait_for(entered.wait(), 10)
    server = server_of(instance, clock)
    await server.poll_once()
    lease = await store.get(key)
    assert lease is not None
    assert lease.holder == "died"  # left for another instance
    assert not server.running
    go.set()
    await run
    await server.poll_once()  # the slot is free: taken now
    await asyncio.gather(*server.running)
    lease = await store.get(key)
    assert lease is not None
    assert (lease.status, lease.epoch) == (LeaseStatus.DONE, 2)

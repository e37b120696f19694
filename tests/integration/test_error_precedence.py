"""The fencing error wins at every place a run decides about a failure (guarantee 5)."""

from __future__ import annotations

import asyncio
import operator
from typing import Annotated, Any, TypedDict

import pytest
from langgraph.checkpoint.memory import InMemorySaver
from langgraph.graph import END, START, StateGraph
from langgraph.types import RetryPolicy

from langgraph_fence import ExecutionFencedError, MemoryLeaseRepository, fence_graph
from langgraph_fence.instance import Instance
from langgraph_fence.steps.context import get_execution_context
from tests.support.databases import unique


class State(TypedDict, total=False):
    log: Annotated[list[str], operator.add]


def _instance() -> Instance:
    return Instance(MemoryLeaseRepository(), InMemorySaver(), lease_ttl=30.0)


def _config() -> dict[str, Any]:
    return {"configurable": {"thread_id": unique("thread")}}


def _parallel(instance: Instance, left: Any, right: Any, **node_options: Any) -> Any:
    builder = StateGraph(State)
    builder.add_node("left", left, **node_options)
    builder.add_node("right", right)
    builder.add_edge(START, "left")
    builder.add_edge(START, "right")
    builder.add_edge("left", END)
    builder.add_edge("right", END)
    return fence_graph(builder).compile(checkpointer=instance.checkpointer, name="graph")


async def test_the_fencing_error_beats_a_siblings_simultaneous_error_every_time() -> None:
    instance = _instance()
    for _ in range(50):
        both_in = asyncio.Barrier(2)
        raised: list[ExecutionFencedError] = []

        async def fenced_side(
            state: State, both_in: asyncio.Barrier = both_in, raised: list[Any] = raised
        ) -> dict[str, Any]:
            fence = get_execution_context().fence
            await both_in.wait()
            error = fence.fenced(fence.token + 1)
            raised.append(error)
            raise error

        async def failing_side(state: State, both_in: asyncio.Barrier = both_in) -> dict[str, Any]:
            await both_in.wait()
            raise ValueError("a sibling failed at the same instant")

        graph = _parallel(instance, fenced_side, failing_side)
        with pytest.raises(ExecutionFencedError) as info:
            await instance.ainvoke(graph, {"log": []}, _config(), tenant_id="acme")
        assert info.value is raised[0]


async def test_the_fencing_error_beats_outer_cancellation() -> None:
    instance = _instance()
    entered = asyncio.Event()
    recorded: list[ExecutionFencedError] = []

    async def waits(state: State) -> dict[str, Any]:
        fence = get_execution_context().fence
        entered.set()
        recorded.append(fence.fenced(fence.token + 1))
        await asyncio.Event().wait()
        return {}

    builder = StateGraph(State)
    builder.add_node("waits", waits)
    builder.add_edge(START, "waits")
    builder.add_edge("waits", END)
    graph = fence_graph(builder).compile(checkpointer=instance.checkpointer, name="graph")
    run = asyncio.create_task(instance.ainvoke(graph, {"log": []}, _config(), tenant_id="acme"))
    await asyncio.wait_for(entered.wait(), 5)
    run.cancel("the caller gave up")
    with pytest.raises(ExecutionFencedError) as info:
        await asyncio.wait_for(run, 5)
    assert info.value is recorded[0]


async def test_a_fencing_error_inside_an_exception_group_is_raised_itself() -> None:
    instance = _instance()
    made: list[ExecutionFencedError] = []

    async def grouped(state: State) -> dict[str, Any]:
        error = ExecutionFencedError("the store saw token 9", token_held=1, token_seen=9)
        made.append(error)
        raise ExceptionGroup("task group", [ValueError("other"), ExceptionGroup("n", [error])])

    async def fine(state: State) -> dict[str, Any]:
        return {"log": ["fine"]}

    graph = _parallel(instance, grouped, fine)
    with pytest.raises(ExecutionFencedError) as info:
        await instance.ainvoke(graph, {"log": []}, _config(), tenant_id="acme")
    assert info.value is made[0]


async def test_a_fencing_error_as_the_cause_of_a_user_error_is_raised_itself() -> None:
    instance = _instance()
    made: list[ExecutionFencedError] = []

    async def wraps_it(state: State) -> dict[str, Any]:
        error = ExecutionFencedError("refused by the payments API", token_held=1, token_seen=2)
        made.append(error)
        try:
            raise error
        except ExecutionFencedError as exc:
            raise RuntimeError("payment failed") from exc

    async def fine(state: State) -> dict[str, Any]:
        return {}

    graph = _parallel(instance, wraps_it, fine)
    with pytest.raises(ExecutionFencedError) as info:
        await instance.ainvoke(graph, {"log": []}, _config(), tenant_id="acme")
    assert info.value is made[0]


async def test_a_fencing_error_under_retry_on_exception_runs_the_node_once() -> None:
    instance = _instance()
    attempts: list[int] = []

    async def flaky(state: State) -> dict[str, Any]:
        attempts.append(get_execution_context().attempt)
        raise RuntimeError("wrapped") from ExecutionFencedError("stale", token_held=1, token_seen=2)

    async def fine(state: State) -> dict[str, Any]:
        return {}

    graph = _parallel(
        instance,
        flaky,
        fine,
        retry_policy=RetryPolicy(retry_on=Exception, initial_interval=0.001, jitter=False),
    )
    with pytest.raises(ExecutionFencedError):
        await instance.ainvoke(graph, {"log": []}, _config(), tenant_id="acme")
    assert attempts == [1]

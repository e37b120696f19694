"""A worker stalled past its lease inside a step: B takes over, A is refused everywhere.

Uses the ``leases`` fixture users get from ``langgraph_fence.testing``: a real SQLite store
and checkpointer, a controlled clock, and instances that can be stalled and resumed.
"""

from __future__ import annotations

import asyncio
import contextlib
import contextvars
import operator
from typing import Annotated, Any, TypedDict

import pytest
from langchain_core.runnables import RunnableConfig
from langgraph.graph import END, START, StateGraph

from langgraph_fence import (
    Effect,
    ExecutionFencedError,
    ExecutionLeaseLostError,
    LeaseKey,
    LeaseStatus,
    fence_graph,
)
from langgraph_fence.steps.context import get_execution_context
from langgraph_fence.testing import Leases

worker: contextvars.ContextVar[str] = contextvars.ContextVar("worker", default="?")


class Order(TypedDict, total=False):
    log: Annotated[list[str], operator.add]


async def test_a_stalled_worker_is_fenced_after_a_takeover(leases: Leases) -> None:
    a = leases.instance("A", lease_ttl=30.0)
    b = leases.instance("B", lease_ttl=30.0)
    a_inside, a_go = asyncio.Event(), asyncio.Event()
    seen_by_a: dict[str, BaseException | None] = {}

    async def prepare(state: Order) -> dict[str, Any]:
        return {"log": [f"prepare by {worker.get()}"]}

    async def charge(state: Order) -> dict[str, Any]:
        frame = get_execution_context()
        if worker.get() == "A":
            a_inside.set()
            # The instance learned it lost the lease and cancelled the step.
            with contextlib.suppress(asyncio.CancelledError):
                await a_go.wait()
            for name, check in (("confirm_now", frame.fence.confirm_now),):
                try:
                    await check()
                    seen_by_a[name] = None
                except ExecutionLeaseLostError as exc:
                    seen_by_a[name] = exc
            try:
                frame.fence.assert_held()
                seen_by_a["assert_held"] = None
            except ExecutionLeaseLostError as exc:
                seen_by_a["assert_held"] = exc
        return {"log": [f"charge by {worker.get()} at token {frame.fence.token}"]}

    async def finish(state: Order) -> dict[str, Any]:
        return {"log": [f"finish by {worker.get()}"]}

    builder = StateGraph(Order)
    builder.add_node("prepare", prepare)
    builder.add_node("charge", charge)
    builder.add_node("finish", finish)
    builder.add_edge(START, "prepare")
    builder.add_edge("prepare", "charge")
    builder.add_edge("charge", "finish")
    builder.add_edge("finish", END)
    graph = fence_graph(builder, effects={"charge": Effect.IDEMPOTENT_WRITE}).compile(
        checkpointer=a.checkpointer, name="graph"
    )
    # The tenant is part of the thread key: reads name it as the runs do.
    config: RunnableConfig = {"configurable": {"thread_id": "order-7", "tenant_id": "acme"}}
    key = LeaseKey("acme", "order-7")

    async def run_a() -> Any:
        worker.set("A")
        return await a.ainvoke(graph, {"log": []}, config, tenant_id="acme", durability="sync")

    task_a = asyncio.create_task(run_a())
    await asyncio.wait_for(a_inside.wait(), 10)
    leases.stall(a)
    leases.advance(31.0)  # A's lease expires by the store's clock; A renews nothing

    worker.set("B")
    final = await b.ainvoke(graph, None, config, tenant_id="acme", durability="sync")
    assert final["log"] == ["prepare by A", "charge by B at token 2", "finish by B"]
    lease = await leases.store.get(key)
    assert lease is not None
    assert lease.status is LeaseStatus.DONE
    assert lease.epoch == 2

    leases.resume(a)
    a_go.set()
    with pytest.raises(ExecutionFencedError) as info:
        await asyncio.wait_for(task_a, 10)
    assert info.value.token_held == 1
    assert info.value.token_seen == 2
    assert isinstance(seen_by_a["confirm_now"], ExecutionFencedError)
    assert seen_by_a["assert_held"] is seen_by_a["confirm_now"]

    # A's writes were refused: the final state is B's alone, and nothing of token 1 after
    # the takeover reached the checkpoints.
    state = await graph.aget_state(config)
    assert state.values["log"] == final["log"]
    assert not state.next
    history = [s async for s in graph.aget_state_history(config)]
    assert all("charge by A" not in str(s.values) for s in history)
    lease = await leases.store.get(key)
    assert lease is not None
    assert lease.status is LeaseStatus.DONE
    assert lease.epoch == 2

"""Review reproducers (issue 37, durable sleep). Each fails on 1826fbd."""

from __future__ import annotations

from typing import Any, TypedDict

from langgraph.graph import END, START, StateGraph

from langgraph_fence import ChildPlacement, ExecutionSleeping, fence_graph, get_execution_context
from langgraph_fence.testing import Leases
from tests.support.databases import unique
from tests.support.graphs import one_step
from tests.support.serving import cfg
from tests.support.sleep_graphs import Nap, nap_graph


class Fan(TypedDict, total=False):
    results: list[Any]


async def test_review_a_sleep_in_a_parent_instance_child_is_not_swallowed(
    leases: Leases,
) -> None:
    """A PARENT_INSTANCE child whose step sleeps raises ExecutionSleeping (a GraphBubbleUp)
    out of its task; wait_children(return_exceptions=True) hands it to the parent's step as
    the child's *result*. The parent ends done, the child's steps after the sleep never
    run, and the recorded sleep is never woken."""
    instance = leases.instance("here")
    seen: list[str] = []
    child = nap_graph(instance, lambda node, config: seen.append(node))

    async def fan(state: Fan) -> dict[str, Any]:
        ctx = get_execution_context()
        kid = await ctx.spawn_child(
            "nap", {"log": [], "seconds": 60.0},
            placement=ChildPlacement.PARENT_INSTANCE, key="c0", graph=child,
        )  # fmt: skip
        results = await ctx.wait_children([kid], timeout=30, return_exceptions=True)
        return {"results": [type(r).__name__ if isinstance(r, BaseException) else r for r in results]}

    parent = one_step(instance, Fan, "fan", fan, name="fan")
    thread = unique("t")
    try:
        out = await instance.ainvoke(parent, {"results": []}, cfg(thread), tenant_id="a")
    except ExecutionSleeping:
        return  # the sleep stopped the tree: what the docs promise
    raise AssertionError(f"the parent ended with {out!r}; the child ran {seen} and never woke")

"""A run just taken over answers its own first read of its thread's latest checkpoint with
the read its taker made (``FencedCheckpointer.primed``): once, for that thread only, and
never in place of a read of another checkpoint."""

from __future__ import annotations

from typing import Any, TypedDict

from langgraph.graph import END, START, StateGraph

from langgraph_fence import fence_graph
from langgraph_fence.testing import Leases
from tests.support.databases import unique


class Count(TypedDict, total=False):
    n: int


async def test_the_primed_read_answers_the_first_read_of_the_latest_checkpoint_once(
    leases: Leases,
) -> None:
    a, b = leases.instance("A"), leases.instance("B")

    async def step(state: Count) -> dict[str, Any]:
        return {"n": state["n"] + 1}

    builder: StateGraph[Any] = StateGraph(Count)
    builder.add_node("step", step)
    builder.add_edge(START, "step")
    builder.add_edge("step", END)
    graph = fence_graph(builder).compile(checkpointer=a.checkpointer, name="count")
    thread, other = unique("t"), unique("t")
    for name in (thread, other):
        await a.ainvoke(graph, {"n": 0}, {"configurable": {"thread_id": name}}, tenant_id="acme")
    saver = a.checkpointer

    def of(name: str, **more: Any) -> Any:
        return {"configurable": {"thread_id": name, "tenant_id": "acme", **more}}

    stored = await saver.aget_tuple(of(thread))
    assert stored is not None
    assert stored.parent_config is not None
    reads: list[Any] = []
    inner_read = saver.inner.aget_tuple

    async def counted(config: Any) -> Any:
        reads.append(config)
        return await inner_read(config)

    saver.inner.aget_tuple = counted  # type: ignore[method-assign]
    try:
        with saver.primed(of(thread), stored):
            # Another thread, and a checkpoint named by id, are read as usual...
            assert await saver.aget_tuple(of(other)) is not None
            parent_id = stored.parent_config["configurable"]["checkpoint_id"]
            parent = await saver.aget_tuple(of(thread, checkpoint_id=parent_id))
            assert parent is not None
            assert parent.checkpoint["id"] == parent_id
            assert len(reads) == 2
            # ...and so is the same thread through another instance's saver...
            through_b = await b.checkpointer.aget_tuple(of(thread))
            assert through_b is not None
            assert through_b is not stored
            assert len(reads) == 3
            # ...the thread's latest is answered from the primed read, once.
            assert await saver.aget_tuple(of(thread)) is stored
            assert len(reads) == 3
            again = await saver.aget_tuple(of(thread))
            assert again is not None
            assert again.checkpoint["id"] == stored.checkpoint["id"]
            assert len(reads) == 4
        with saver.primed(of(thread), None):
            pass
        assert await saver.aget_tuple(of(thread)) is not None  # the block's end forgot it
    finally:
        del saver.inner.aget_tuple  # the instance attribute: back to the method

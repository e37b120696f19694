"""``Instance.open(url)`` offers the fenced store on the same database: a graph compiled with
``store=instance.store`` writes its memories under the run's token, keyed by its tenant."""

from __future__ import annotations

from typing import Any, TypedDict

from langgraph.config import get_store
from langgraph.graph import END, START, StateGraph

from langgraph_fence import FencedStore, Instance, fence_graph, get_execution_context
from langgraph_fence.database import schema_options
from tests.support.databases import Database, unique


class State(TypedDict, total=False):
    seen: Any


async def test_a_graph_writes_its_memories_through_instance_store(database: Database) -> None:
    tenant, other, thread = unique("tenant"), unique("tenant"), unique("thread")
    ns = ("memories", thread)

    async def remember(state: State) -> State:
        context = get_execution_context()
        store = get_store()
        before = await store.aget(ns, "summary")
        await store.aput(ns, "summary", {"by": context.tenant_id, "token": context.fence.token})
        after = await store.aget(ns, "summary")
        return {"seen": [None if i is None else i.value for i in (before, after)]}

    builder = StateGraph(State)
    builder.add_node("remember", remember)
    builder.add_edge(START, "remember")
    builder.add_edge("remember", END)
    async with Instance.open(
        database.url, engine_options=schema_options(database.schema)
    ) as instance:
        assert isinstance(instance.store, FencedStore)
        graph = fence_graph(builder).compile(
            checkpointer=instance.checkpointer, store=instance.store, name="memories"
        )
        config = {"configurable": {"thread_id": thread}}
        result = await instance.ainvoke(graph, {}, config, tenant_id=tenant)
        assert result["seen"] == [None, {"by": tenant, "token": 1}]
        # The same thread id of another tenant does not see the first tenant's memory.
        result = await instance.ainvoke(graph, {}, config, tenant_id=other)
        assert result["seen"] == [None, {"by": other, "token": 1}]
        # Outside a step (an admin script) the store is the default tenant's.
        assert await instance.store.aget(ns, "summary") is None

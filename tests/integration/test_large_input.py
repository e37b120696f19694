"""Issue 32, item 10: a large input is not stored again in every checkpoint row.

A 100 MB input was stored six times on SQLite: the execution record, LangGraph's input
checkpoint (its ``__start__`` blob) and the start task's write, and inline in every
checkpoint row after it (a text of any length was kept inline). Long texts are channel
blobs now, stored once per version. Both databases.
"""

from __future__ import annotations

from typing import Any, TypedDict

from langgraph.graph import END, START, StateGraph
from sqlalchemy import text

from langgraph_fence import fence_graph
from langgraph_fence.testing import Leases
from tests.support.databases import SQL_BACKENDS, unique

RUNS_ON = SQL_BACKENDS

SIZE = 1 << 20


class Big(TypedDict, total=False):
    big: str
    steps: int


async def count(state: Big) -> dict[str, Any]:
    return {"steps": state.get("steps", 0) + 1}


async def test_a_large_input_is_stored_once_per_version_not_per_checkpoint(db: Leases) -> None:
    instance = db.instance("A")
    builder = StateGraph(Big)
    for name in ("one", "two", "three"):  # three supersteps that leave the input as it is
        builder.add_node(name, count)
    builder.add_edge(START, "one")
    builder.add_edge("one", "two")
    builder.add_edge("two", "three")
    builder.add_edge("three", END)
    graph = fence_graph(builder).compile(checkpointer=instance.checkpointer, name="big")
    thread = unique("big")
    config: Any = {"configurable": {"thread_id": thread}}
    big = "x" * SIZE
    await instance.ainvoke(graph, {"big": big}, config, tenant_id="acme")
    state = await graph.aget_state({"configurable": {"thread_id": thread, "tenant_id": "acme"}})
    assert state.values == {"big": big, "steps": 3}  # read back whole
    async with db.engine.connect() as conn:
        stored = {}
        for table, column in (
            ("fence_checkpoints", "checkpoint"),
            ("fence_checkpoint_blobs", "blob"),
            ("fence_checkpoint_writes", "blob"),
        ):
            total = await conn.execute(
                text(
                    f"SELECT coalesce(sum(length({column})), 0) FROM {table} WHERE thread_id = :t"
                ),
                {"t": thread},
            )
            stored[table] = round(int(total.scalar_one()) / SIZE, 1)
    # Five checkpoints, none holding the input; its blob once (beside LangGraph's input
    # blob) and the start task's write once.
    assert stored == {
        "fence_checkpoints": 0.0,
        "fence_checkpoint_blobs": 2.0,
        "fence_checkpoint_writes": 1.0,
    }

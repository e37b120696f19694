"""Graphs for the children chaos test (``tests/chaos/test_children_processes.py``).

Factories for ``langgraph-fence worker --graphs tests.support.children_graphs:FUNCTION``:

* :func:`fan_graphs`: ``fan`` = fan_out -> END. ``fan_out`` spawns one ``ANY_INSTANCE``
  child per item (keys ``c0``, ``c1``, ...) and waits for their outputs.
* :func:`child_graphs`: ``tally`` = tally -> END. ``tally`` records that it started (one
  row in ``chaos_children``: execution id, token, pid), then holds until a row is in
  ``chaos_release`` (polling with a deadline), and returns its text upper-cased.
"""

from __future__ import annotations

import os
from typing import Any, TypedDict

from langgraph.graph import END, START, StateGraph
from sqlalchemy import text

from langgraph_fence import ChildPlacement, Instance, fence_graph, get_execution_context
from tests.support.polling import eventually

FAN = "fan"
TALLY = "tally"
HOLD_DEADLINE = 90.0

CREATE_TABLES = (
    "CREATE TABLE IF NOT EXISTS chaos_children (execution_id TEXT NOT NULL, "
    "token BIGINT NOT NULL, pid BIGINT NOT NULL)",
    "CREATE TABLE IF NOT EXISTS chaos_release (released BOOLEAN NOT NULL)",
)


class Fan(TypedDict, total=False):
    items: list[str]
    results: list[str]


class Job(TypedDict, total=False):
    text: str
    out: str


def fan_graphs(instance: Instance) -> dict[str, Any]:
    async def fan_out(state: Fan) -> dict[str, Any]:
        ctx = get_execution_context()
        children = [
            await ctx.spawn_child(
                TALLY, {"text": item}, placement=ChildPlacement.ANY_INSTANCE, key=f"c{i}"
            )
            for i, item in enumerate(state["items"])
        ]
        outputs = await ctx.wait_children(children, timeout=HOLD_DEADLINE)
        return {"results": [output["out"] for output in outputs]}

    builder = StateGraph(Fan)
    builder.add_node("fan_out", fan_out)
    builder.add_edge(START, "fan_out")
    builder.add_edge("fan_out", END)
    return {FAN: fence_graph(builder).compile(checkpointer=instance.checkpointer, name=FAN)}


def child_graphs(instance: Instance) -> dict[str, Any]:
    engine = instance._run_queue()._engine

    async def tally(state: Job) -> dict[str, Any]:
        fence = get_execution_context().fence
        async with engine.begin() as conn:
            await conn.execute(
                text("INSERT INTO chaos_children VALUES (:e, :t, :p)"),
                {"e": fence.lease_execution_id, "t": fence.token, "p": os.getpid()},
            )

        async def released() -> bool:
            async with engine.connect() as conn:
                return (await conn.execute(text("SELECT 1 FROM chaos_release"))).first() is not None

        await eventually(
            released, timeout=HOLD_DEADLINE, interval=0.05, what="the test to release the children"
        )
        fence.assert_held()
        return {"out": state["text"].upper()}

    builder = StateGraph(Job)
    builder.add_node("tally", tally)
    builder.add_edge(START, "tally")
    builder.add_edge("tally", END)
    return {TALLY: fence_graph(builder).compile(checkpointer=instance.checkpointer, name=TALLY)}

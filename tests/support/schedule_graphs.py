"""The graph a schedule's ticks run in the chaos test of schedules, for ``langgraph-fence
worker --graphs tests.support.schedule_graphs:graphs``.

``count`` = START -> count -> END: ``count`` writes one row per run to ``schedule_ticks``:
the schedule and tick its run was fired for (``config["metadata"]``), keyed by the task (a
re-run of the same step after a takeover writes nothing new, an ``IDEMPOTENT_WRITE``; a run
killed before its first checkpoint runs its input again under new task ids, and writes its
tick again). Whether a tick fired twice is told by the submitted runs, not by these rows.
"""

from __future__ import annotations

from typing import Any, TypedDict

from langchain_core.runnables import RunnableConfig
from langgraph.graph import END, START, StateGraph
from sqlalchemy import text

from langgraph_fence import Effect, fence_graph
from langgraph_fence.database import transaction
from langgraph_fence.instance import Instance

COUNT_GRAPH = "count"
CREATE_TICKS = (
    "CREATE TABLE IF NOT EXISTS schedule_ticks (task TEXT PRIMARY KEY, schedule_id TEXT "
    "NOT NULL, tick TEXT NOT NULL, pid INTEGER NOT NULL)"
)
_INSERT = text(
    "INSERT INTO schedule_ticks (task, schedule_id, tick, pid) VALUES (:task, :schedule, "
    ":tick, :pid) ON CONFLICT (task) DO NOTHING"
)


class Ticked(TypedDict, total=False):
    n: int


def graphs(instance: Instance) -> dict[str, Any]:
    """``--graphs`` factory: ``count``."""
    import os

    engine = instance.repository.engine  # type: ignore[attr-defined]

    async def count(state: Ticked, config: RunnableConfig) -> dict[str, Any]:
        metadata = config["metadata"]
        row = {
            "task": metadata["langgraph_checkpoint_ns"],
            "schedule": metadata["schedule_id"],
            "tick": metadata["scheduled_for"],
            "pid": os.getpid(),
        }
        async with transaction(engine) as conn:
            await conn.execute(_INSERT, row)
        return {"n": 1}

    builder: StateGraph[Any] = StateGraph(Ticked)
    builder.add_node("count", count)
    builder.add_edge(START, "count")
    builder.add_edge("count", END)
    fenced = fence_graph(builder, effects={"count": Effect.IDEMPOTENT_WRITE})
    return {COUNT_GRAPH: fenced.compile(checkpointer=instance.checkpointer, name=COUNT_GRAPH)}

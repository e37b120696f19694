"""Graphs for the durable-sleep chaos test, for ``langgraph-fence worker --graphs
tests.support.sleep_graphs:graphs``.

* ``nap`` = before -> nap -> after: ``nap`` sleeps ``seconds`` (its input) first thing.
* ``busy`` = work: takes ``seconds`` (its input), as a model call would.

Each node appends a JSON line to ``$LGF_CHAOS_MARK_DIR/marks.jsonl``: the node, the thread,
the worker's pid and ``time.time()`` (the machine's clock, the database's too).
"""

from __future__ import annotations

import asyncio
import json
import os
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any, TypedDict

from langchain_core.runnables import RunnableConfig
from langgraph.graph import END, START, StateGraph

from langgraph_fence import fence_graph, get_execution_context
from langgraph_fence.instance import Instance
from tests.support.processes import MARK_DIR_ENV


class Nap(TypedDict, total=False):
    seconds: float
    log: list[str]


def marks(directory: Path) -> list[dict[str, Any]]:
    """Every mark written so far, in order."""
    path = directory / "marks.jsonl"
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line]


def _mark(node: str, config: RunnableConfig) -> None:
    line = {
        "node": node,
        "thread": config["configurable"]["thread_id"],
        "pid": os.getpid(),
        "t": time.time(),
    }
    with (Path(os.environ[MARK_DIR_ENV]) / "marks.jsonl").open("a") as out:
        out.write(json.dumps(line) + "\n")


Mark = Callable[[str, RunnableConfig], None]


def nap_graph(instance: Instance, mark: Mark) -> Any:
    """before -> nap -> after, each node calling ``mark`` with its name (``nap``, then
    ``woke`` once its sleep of ``seconds`` is over)."""

    async def before(state: Nap, config: RunnableConfig) -> dict[str, Any]:
        mark("before", config)
        return {"log": ["before"]}

    async def nap(state: Nap, config: RunnableConfig) -> dict[str, Any]:
        mark("nap", config)
        await get_execution_context().sleep(state["seconds"])
        mark("woke", config)
        return {"log": [*state["log"], "nap"]}

    async def after(state: Nap, config: RunnableConfig) -> dict[str, Any]:
        mark("after", config)
        return {"log": [*state["log"], "after"]}

    napping: StateGraph[Any] = StateGraph(Nap)
    for name, node in (("before", before), ("nap", nap), ("after", after)):
        napping.add_node(name, node)
    napping.add_edge(START, "before")
    napping.add_edge("before", "nap")
    napping.add_edge("nap", "after")
    napping.add_edge("after", END)
    return fence_graph(napping).compile(checkpointer=instance.checkpointer, name="nap")


def graphs(instance: Instance) -> dict[str, Any]:
    """``--graphs`` factory: ``nap`` and ``busy``, marking to the mark directory."""

    async def work(state: Nap, config: RunnableConfig) -> dict[str, Any]:
        _mark("work", config)
        await asyncio.sleep(state["seconds"])
        _mark("worked", config)
        return {"log": ["work"]}

    busy: StateGraph[Any] = StateGraph(Nap)
    busy.add_node("work", work)
    busy.add_edge(START, "work")
    busy.add_edge("work", END)
    return {
        "nap": nap_graph(instance, _mark),
        "busy": fence_graph(busy).compile(checkpointer=instance.checkpointer, name="busy"),
    }

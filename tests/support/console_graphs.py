"""The graphs the console's browser test runs in worker processes.

``orders`` charges a card (a non-idempotent write); ``packing`` packs a parcel (an
idempotent one). Each step leaves a mark file ``<thread>.<step>`` in ``LGF_CONSOLE_MARKS``
when it is inside, and, in a worker started with ``LGF_CONSOLE_HOLD=1``, stays inside until
the worker is killed: a kill mid-write.
"""

from __future__ import annotations

import asyncio
import hashlib
import operator
import os
from pathlib import Path
from typing import Annotated, Any, TypedDict

from langgraph.graph import END, START, StateGraph

from langgraph_fence import Effect, fence_graph, get_execution_context
from langgraph_fence.instance import Instance


class Parcel(TypedDict, total=False):
    log: Annotated[list[str], operator.add]


def _step(name: str) -> Any:
    async def step(state: Parcel) -> dict[str, Any]:
        context = get_execution_context()
        marks = Path(os.environ["LGF_CONSOLE_MARKS"])
        # The thread id may hold any text (the test's holds markup): the mark is by its hash.
        digest = hashlib.sha1(context.thread_id.encode()).hexdigest()[:16]
        (marks / f"{digest}.{name}").write_text(context.thread_id)
        if os.environ.get("LGF_CONSOLE_HOLD") == "1":
            await asyncio.sleep(3600)  # killed in here
        return {"log": [f"{name} at token {context.fence.token}"]}

    return step


def _graph(instance: Instance, node: str, effect: Effect, name: str) -> Any:
    builder = StateGraph(Parcel)
    builder.add_node(node, _step(node))
    builder.add_edge(START, node)
    builder.add_edge(node, END)
    return fence_graph(builder, effects={node: effect}).compile(
        checkpointer=instance.checkpointer, name=name
    )


def graphs(instance: Instance) -> dict[str, Any]:
    return {
        "orders": _graph(instance, "charge", Effect.NON_IDEMPOTENT_WRITE, "orders"),
        "packing": _graph(instance, "pack", Effect.IDEMPOTENT_WRITE, "packing"),
    }

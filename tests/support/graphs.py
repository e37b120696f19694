"""Small graphs a test builds around the step it is about."""

from __future__ import annotations

from typing import Any

from langgraph.graph import END, START, StateGraph

from langgraph_fence import fence_graph
from langgraph_fence.instance import Instance


def one_step(instance: Instance, state: type[Any], node: str, step: Any, *, name: str) -> Any:
    """START -> ``node`` (running ``step``) -> END on ``state``, fenced and compiled with
    ``instance``'s checkpointer under the graph name ``name``."""
    builder: StateGraph[Any] = StateGraph(state)
    builder.add_node(node, step)
    builder.add_edge(START, node)
    builder.add_edge(node, END)
    return fence_graph(builder).compile(checkpointer=instance.checkpointer, name=name)

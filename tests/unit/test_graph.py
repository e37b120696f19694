"""``fence_graph`` fences the same things in both forms: a builder, or a compiled graph.

On the first versions ``fence_graph(builder)`` left a ``ToolNode``'s tools unfenced (the run
was then refused, telling the user to call ``fence_graph(builder, effects=...)``: the call
just made), refused ``effects=`` naming a tool, had no ``stamp_at_effect``, and refused one
problem at a time.
"""

from __future__ import annotations

import operator
from typing import Annotated, Any, TypedDict

import pytest
from langchain_core.tools import tool
from langgraph.graph import END, START, StateGraph
from langgraph.graph.message import add_messages
from langgraph.prebuilt import ToolNode

from langgraph_fence import Effect, fence_graph, fence_tools, fenced
from langgraph_fence.effects import EFFECT_ATTRIBUTE
from langgraph_fence.execution.fail_closed import refuse_unfenced, unfenced_parts
from langgraph_fence.steps.tools import STAMP_ATTRIBUTE


class Messages(TypedDict):
    messages: Annotated[list[Any], add_messages]


class Log(TypedDict):
    log: Annotated[list[str], operator.add]


@tool
def send_email(to: str) -> str:
    """Send an e-mail."""
    return "sent"


@tool
async def refund(order: str) -> str:
    """Refund an order."""
    return "refunded"


@tool
def lookup(order: str) -> str:
    """Look an order up."""
    return "found"


def _builder() -> StateGraph[Any]:
    async def agent(state: Messages) -> dict[str, Any]:
        return {}

    builder: StateGraph[Any] = StateGraph(Messages)
    builder.add_node("agent", agent)
    builder.add_node("tools", ToolNode([send_email, refund, lookup]))
    builder.add_edge(START, "agent")
    builder.add_edge("agent", "tools")
    builder.add_edge("tools", END)
    return builder


def _tools(graph: Any) -> dict[str, Any]:
    return dict(graph.nodes["tools"].bound.tools_by_name)


@pytest.mark.parametrize("form", ["builder", "compiled"])
def test_both_forms_fence_the_tools_of_a_tool_node(form: str) -> None:
    effects = {"lookup": "read_only", "agent": "read_only"}
    if form == "builder":
        graph = fence_graph(_builder(), effects=effects, stamp_at_effect=["refund"]).compile()
    else:
        graph = fence_graph(_builder().compile(), effects=effects, stamp_at_effect=["refund"])
    assert unfenced_parts(graph) == ([], [])
    refuse_unfenced(graph)  # nothing to refuse
    tools = _tools(graph)
    assert getattr(type(tools["send_email"]), EFFECT_ATTRIBUTE) is Effect.NON_IDEMPOTENT_WRITE
    assert getattr(type(tools["lookup"]), EFFECT_ATTRIBUTE) is Effect.READ_ONLY
    assert getattr(type(tools["refund"]), STAMP_ATTRIBUTE) == "effect"
    assert getattr(type(tools["send_email"]), STAMP_ATTRIBUTE) == "body"


@pytest.mark.parametrize("form", ["builder", "compiled"])
def test_a_refusal_names_every_problem_at_once_and_changes_nothing(form: str) -> None:
    @fenced(effect=Effect.READ_ONLY)
    async def agent(state: Messages) -> dict[str, Any]:
        return {}

    builder: StateGraph[Any] = StateGraph(Messages)
    builder.add_node("agent", agent)
    builder.add_node(
        "tools", ToolNode(fence_tools([send_email], effects={"send_email": "idempotent_write"}))
    )
    builder.add_edge(START, "agent")
    builder.add_edge("agent", "tools")
    graph: Any = builder if form == "builder" else builder.compile()
    with pytest.raises(ValueError, match="refused the graph") as refused:
        fence_graph(
            graph,
            effects={
                "agent": "non_idempotent_write",
                "send_email": "read_only",
                "nope": "read_only",
            },
            stamp_at_effect=["also_nope"],
        )
    message = str(refused.value)
    assert "['also_nope', 'nope']" in message
    assert "node 'agent' is fenced already" in message
    assert "tool 'send_email' is fenced already" in message
    compiled = graph if form == "compiled" else graph.compile()
    assert unfenced_parts(compiled) == (["tools"], [])  # as it was: nothing changed
    tools = _tools(compiled)
    assert getattr(type(tools["send_email"]), EFFECT_ATTRIBUTE) is Effect.IDEMPOTENT_WRITE


def test_stamp_at_effect_refuses_a_read_only_or_sync_node() -> None:
    def sync_write(state: Log) -> dict[str, Any]:
        return {}

    async def reader(state: Log) -> dict[str, Any]:
        return {}

    builder: StateGraph[Any] = StateGraph(Log)
    builder.add_node("sync_write", sync_write)
    builder.add_node("reader", reader)
    builder.add_edge(START, "sync_write")
    builder.add_edge("sync_write", "reader")
    with pytest.raises(ValueError, match="refused the graph") as refused:
        fence_graph(
            builder,
            effects={"sync_write": "non_idempotent_write"},
            stamp_at_effect=["sync_write", "reader"],
        )
    assert "node 'sync_write', which is sync" in str(refused.value)
    assert "node 'reader', which is read_only" in str(refused.value)


def test_a_tool_added_after_fence_graph_is_refused_with_the_call_that_fences_it() -> None:
    graph = fence_graph(_builder()).compile()
    graph.nodes["tools"].bound.tools_by_name["late"] = lookup  # not through fence_tools
    with pytest.raises(ValueError, match=r"fence_tools\(tools") as refused:
        refuse_unfenced(graph)
    assert "fence_graph(builder" not in str(refused.value)  # not the call just made

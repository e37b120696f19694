"""Fail closed (issue 12): a graph run through an instance in which a node or a ToolNode's
tool is not fenced is refused before its first step, naming what to fence; a prebuilt agent
is fenced in one line, its tools included, and its write tool is stamped.
"""

from __future__ import annotations

import uuid
import warnings
from collections.abc import AsyncIterator, Callable
from typing import Any, TypedDict

import pytest
from langchain_core.messages import AIMessage, HumanMessage
from langchain_core.runnables import RunnableConfig
from langchain_core.tools import tool
from langgraph.graph import START, MessagesState, StateGraph
from langgraph.prebuilt import ToolNode

from langgraph_fence import (
    Effect,
    Instance,
    LeaseKey,
    LeaseStatus,
    fence_graph,
    get_execution_context,
)
from tests.support.agents import ScriptedModel
from tests.support.databases import Database, pg_engine_options


class State(TypedDict, total=False):
    n: int


sent: list[str] = []
stamps_seen: list[list[str]] = []


@tool
async def send_email(to: str) -> str:
    """Send an e-mail."""
    frame = get_execution_context()
    lease = await frame.fence._require_active().repository.get(  # the stamp, as stored
        LeaseKey(frame.fence.tenant_id, frame.fence.lease_execution_id)
    )
    assert lease is not None
    stamps_seen.append([e.node for e in lease.pending_effects])
    sent.append(to)
    return f"sent to {to}"


@tool
def lookup(order: str) -> str:
    """Look an order up."""
    return f"order {order}: paid"


@pytest.fixture
async def instance(database: Database) -> AsyncIterator[Instance]:
    options = pg_engine_options(database.schema) if database.schema else {}
    async with Instance.open(database.url, engine_options=options) as opened:
        yield opened


def thread() -> RunnableConfig:
    return {"configurable": {"thread_id": f"agent-{uuid.uuid4().hex}"}}


async def nothing_written(instance: Instance, graph: Any, config: RunnableConfig) -> bool:
    """No lease taken, no checkpoint written."""
    key = LeaseKey("default", config["configurable"]["thread_id"])
    state = await graph.aget_state(config)
    return await instance.repository.get(key) is None and state.created_at is None


def script() -> ScriptedModel:
    return ScriptedModel(
        turns=[
            AIMessage(
                "",
                tool_calls=[
                    {"name": "lookup", "args": {"order": "42"}, "id": "c1"},
                    {"name": "send_email", "args": {"to": "ann@example.com"}, "id": "c2"},
                ],
            ),
            AIMessage("done"),
        ]
    )


def react_agent(instance: Instance) -> Any:
    from langgraph.prebuilt import create_react_agent

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # moved to langchain.agents; still shipped
        return create_react_agent(
            script(), [lookup, send_email], checkpointer=instance.checkpointer, name="support"
        )


def langchain_agent(instance: Instance) -> Any:
    from langchain.agents import create_agent

    return create_agent(
        script(), [lookup, send_email], checkpointer=instance.checkpointer, name="support"
    )


AGENTS = {"create_react_agent": react_agent, "create_agent": langchain_agent}


async def test_an_unfenced_node_is_refused_before_its_first_step(instance: Instance) -> None:
    ran: list[str] = []

    async def plain(state: State) -> State:
        ran.append("plain")
        return {"n": 1}

    builder = StateGraph(State)
    builder.add_node("plain", plain)
    builder.add_edge(START, "plain")
    graph = builder.compile(checkpointer=instance.checkpointer, name="plain")
    config = thread()
    with pytest.raises(ValueError, match=r"nodes \['plain'\] are not fenced.*fence_graph"):
        await graph.ainvoke({"n": 0}, config)
    with pytest.raises(ValueError, match=r"\['plain'\]"):
        await instance.ainvoke(graph, {"n": 0}, config, tenant_id="default")
    assert ran == []
    assert await nothing_written(instance, graph, config)


async def test_an_unfenced_graph_called_inside_a_fenced_node_is_refused_before_it_runs(
    instance: Instance,
) -> None:
    """A subgraph a node calls runs under the run's token: its unfenced nodes would run with
    no frame and no stamp. Refused at its call, before its first step, naming them."""
    ran: list[str] = []

    async def inner(state: State) -> State:
        ran.append("inner")
        return {"n": 2}

    sub_builder = StateGraph(State)
    sub_builder.add_node("inner", inner)
    sub_builder.add_edge(START, "inner")
    sub = sub_builder.compile(name="sub")

    async def outer(state: State) -> State:
        ran.append("outer")
        return await sub.ainvoke(state)

    builder = StateGraph(State)
    builder.add_node("outer", outer)
    builder.add_edge(START, "outer")
    graph = fence_graph(builder).compile(checkpointer=instance.checkpointer, name="outer")
    with pytest.raises(ValueError, match=r"nodes \['inner'\] are not fenced"):
        await graph.ainvoke({"n": 0}, thread())
    assert ran == ["outer"]  # the fenced node ran; the unfenced one never did


async def test_fence_graph_on_a_builder_fences_the_tools_of_its_tool_node(
    instance: Instance,
) -> None:
    """The builder form fences what the compiled form does: a ToolNode's tools too (the
    first versions left them out, and the run was refused telling the user to make the call
    just made)."""
    model = script()

    async def agent(state: MessagesState) -> dict[str, Any]:
        return {"messages": [await model.ainvoke(state["messages"])]}

    builder = StateGraph(MessagesState)
    builder.add_node("agent", agent)
    builder.add_node("tools", ToolNode([lookup, send_email]))
    builder.add_edge(START, "agent")
    builder.add_edge("agent", "tools")
    graph = fence_graph(builder, effects={"lookup": "read_only"}).compile(
        checkpointer=instance.checkpointer, name="tools"
    )
    config = thread()
    sent.clear()
    stamps_seen.clear()
    await graph.ainvoke({"messages": [HumanMessage("mail ann")]}, config)
    assert sent == ["ann@example.com"]
    assert stamps_seen == [["tools:send_email"]]  # lookup is read-only: no stamp


async def test_every_problem_of_a_graph_is_refused_at_once(instance: Instance) -> None:
    """Unfenced nodes and LangGraph's default name (no serve() could take the run over):
    one refusal says both."""

    async def plain(state: State) -> State:
        return {"n": 1}

    builder = StateGraph(State)
    builder.add_node("plain", plain)
    builder.add_edge(START, "plain")
    graph = builder.compile(checkpointer=instance.checkpointer)  # no name=
    config = thread()
    with pytest.raises(ValueError, match=r"nodes \['plain'\] are not fenced") as refused:
        await instance.ainvoke(graph, {"n": 0}, config, tenant_id="default")
    assert "default name 'LangGraph'" in str(refused.value)
    assert await nothing_written(instance, graph, config)


@pytest.mark.parametrize("make", AGENTS.values(), ids=AGENTS.keys())
async def test_an_unfenced_prebuilt_agent_is_refused(
    instance: Instance, make: Callable[[Instance], Any]
) -> None:
    agent = make(instance)
    config = thread()
    sent.clear()
    with pytest.raises(ValueError, match=r"lookup.*send_email.*fence_graph\(graph"):
        await agent.ainvoke({"messages": [HumanMessage("mail ann")]}, config)
    assert sent == []
    assert await nothing_written(instance, agent, config)


@pytest.mark.parametrize("make", AGENTS.values(), ids=AGENTS.keys())
async def test_a_fenced_agent_stamps_its_write_tool(
    instance: Instance, make: Callable[[Instance], Any]
) -> None:
    agent = fence_graph(make(instance), effects={"lookup": "read_only"})  # the one line
    config = thread()
    sent.clear()
    stamps_seen.clear()
    result = await agent.ainvoke({"messages": [HumanMessage("mail ann")]}, config)
    assert result["messages"][-1].content == "done"
    assert sent == ["ann@example.com"]
    # The write tool (undeclared: NON_IDEMPOTENT_WRITE) ran under its own stamp entry.
    assert stamps_seen == [["tools:send_email"]]
    lease = await instance.repository.get(LeaseKey("default", config["configurable"]["thread_id"]))
    assert lease is not None
    assert lease.status is LeaseStatus.DONE
    assert not lease.pending_effects


def test_fence_graph_on_a_compiled_graph_refuses_names_it_does_not_have() -> None:
    builder = StateGraph(State)
    builder.add_node("a", lambda s: s)
    builder.add_edge(START, "a")
    with pytest.raises(ValueError, match=r"\['nope'\]"):
        fence_graph(builder.compile(), effects={"nope": Effect.READ_ONLY})

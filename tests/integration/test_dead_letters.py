"""A dead letter no wrapper can swallow.

A non-idempotent write that failed may have happened: the run is dead-lettered, and nothing
the user wraps around the call changes that. LangChain's ``ToolRetryMiddleware`` (its
defaults retry every exception and hand the model a "failed" message), a
``ToolNode(awrap_tool_call=...)`` retry loop written the same way, and a ``try/except
Exception`` in a node around a fenced tool call: each caught the dead letter on the first
version, retried the tool (3 runs of one charge) and ended the run ``done``. Now the dead
letter is recorded on the run: the tool body never runs again, no later step of the run
runs (the model never sees the failure), and the run ends ``dead_lettered``.
"""

from __future__ import annotations

import operator
from typing import Annotated, Any, TypedDict

import pytest
from langchain_core.messages import AIMessage, AnyMessage, ToolMessage
from langchain_core.tools import tool
from langgraph.graph import END, START, StateGraph
from langgraph.graph.message import add_messages
from langgraph.prebuilt import ToolNode

from langgraph_fence import (
    ExecutionDeadLetteredError,
    Instance,
    LeaseKey,
    LeaseStatus,
    fence_graph,
    fence_tools,
)
from tests.support.agents import ScriptedModel
from tests.support.databases import Database, engine_options, unique

TENANT = "acme"


def call(name: str, args: dict[str, Any], call_id: str = "call-1") -> AIMessage:
    return AIMessage("", tool_calls=[{"name": name, "args": args, "id": call_id}])


class Charges:
    """A card processor that fails after taking the money (the write happened)."""

    def __init__(self, *, fail_times: int) -> None:
        self.runs = 0
        self.fail_times = fail_times

    def tool(self) -> Any:
        @tool
        async def charge_card(order: str) -> str:
            """Charge the card of an order."""
            self.runs += 1
            if self.runs <= self.fail_times:
                raise ConnectionError("the processor hung up after charging")
            return "charged"

        return charge_card


async def run_dead(instance: Instance, graph: Any, state: Any) -> tuple[str, Any]:
    thread = unique("thread")
    with pytest.raises(ExecutionDeadLetteredError) as raised:
        await instance.ainvoke(
            graph, state, {"configurable": {"thread_id": thread}}, tenant_id=TENANT
        )
    lease = await instance.repository.get(LeaseKey(TENANT, thread))
    assert lease is not None, lease
    assert lease.status is LeaseStatus.DEAD_LETTERED, lease
    assert lease.reason is not None, lease.reason
    assert "charge_card" in lease.reason, lease.reason
    return thread, raised.value


@pytest.mark.parametrize("fail_times", [1, 99])
async def test_tool_retry_middleware_cannot_repeat_a_dead_lettered_charge(
    database: Database, fail_times: int
) -> None:
    from langchain.agents import create_agent
    from langchain.agents.middleware import ToolRetryMiddleware

    charges = Charges(fail_times=fail_times)
    model = ScriptedModel(
        turns=[call("charge_card", {"order": "o1"}), AIMessage("the charge failed, sorry")]
    )
    async with Instance.open(
        database.url, engine_options=engine_options(database.url, database.schema)
    ) as instance:
        agent = create_agent(
            model,
            fence_tools([charges.tool()]),
            middleware=[
                ToolRetryMiddleware(
                    retry_on=(Exception,), max_retries=2, on_failure="continue", initial_delay=0
                )
            ],
        )
        graph = fence_graph(agent.builder).compile(checkpointer=instance.checkpointer, name="agent")
        thread, _ = await run_dead(instance, graph, {"messages": [("user", "charge o1")]})
        assert charges.runs == 1  # the retries never reached the processor again
        state = await graph.aget_state({"configurable": {"thread_id": thread}})
        # The model never saw a "failed after 3 attempts" message it could act on.
        assert not [m for m in state.values.get("messages", []) if isinstance(m, ToolMessage)]
        assert not any("sorry" in str(m.content) for m in state.values.get("messages", []))


class Messages(TypedDict):
    messages: Annotated[list[AnyMessage], add_messages]


async def test_a_tool_node_retry_wrapper_cannot_repeat_a_dead_lettered_charge(
    database: Database,
) -> None:
    charges = Charges(fail_times=99)
    attempts: list[int] = []

    async def retry(request: Any, execute: Any) -> Any:
        # Written like ToolRetryMiddleware's defaults: every exception, twice more.
        for attempt in range(3):
            attempts.append(attempt)
            try:
                return await execute(request)
            except Exception as exc:
                last = exc
        return ToolMessage(
            f"failed after 3 attempts: {last}",
            tool_call_id=request.tool_call["id"],
            status="error",
        )

    async with Instance.open(
        database.url, engine_options=engine_options(database.url, database.schema)
    ) as instance:
        builder = StateGraph(Messages)
        builder.add_node("tools", ToolNode(fence_tools([charges.tool()]), awrap_tool_call=retry))
        builder.add_edge(START, "tools")
        builder.add_edge("tools", END)
        graph = fence_graph(builder).compile(checkpointer=instance.checkpointer, name="tools")
        await run_dead(instance, graph, {"messages": [call("charge_card", {"order": "o1"})]})
    assert charges.runs == 1
    assert attempts == [0, 1, 2]  # the wrapper did try; nothing ran past the first


class Log(TypedDict):
    log: Annotated[list[str], operator.add]


async def test_a_try_except_in_a_node_cannot_swallow_a_dead_letter(database: Database) -> None:
    charges = Charges(fail_times=99)
    [charge_card] = fence_tools([charges.tool()])
    after: list[str] = []

    async def pay(state: Log) -> dict[str, list[str]]:
        try:
            await charge_card.ainvoke({"order": "o1"})
        except Exception:
            # "retry once, then give up quietly": the user's own try/except is what is tested.
            try:  # noqa: SIM105
                await charge_card.ainvoke({"order": "o1"})
            except Exception:
                pass
        return {"log": ["paid?"]}

    async def ship(state: Log) -> dict[str, list[str]]:
        after.append("ship")
        return {"log": ["shipped"]}

    async with Instance.open(
        database.url, engine_options=engine_options(database.url, database.schema)
    ) as instance:
        builder = StateGraph(Log)
        builder.add_node("pay", pay)
        builder.add_node("ship", ship)
        builder.add_edge(START, "pay")
        builder.add_edge("pay", "ship")
        builder.add_edge("ship", END)
        graph = fence_graph(builder).compile(checkpointer=instance.checkpointer, name="order")
        await run_dead(instance, graph, {"log": []})
    assert charges.runs == 1
    assert after == []  # no later step of the dead run ran

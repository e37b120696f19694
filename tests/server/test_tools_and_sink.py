"""A ``ToolNode`` of ``fence_tools`` tools, ``confirm_now()`` and the exactly-once sink inside
a run of the real Agent Server, with the same meaning as under an ``Instance``: the write
tool is stamped before its body, the fence is confirmed live, and the refund row is written
once through ``fenced_write`` under the run's token. SQLite and PostgreSQL."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
from langgraph_sdk import get_client

from tests.support.agent_server import agent_server, rows
from tests.support.write_steps import Database

pytestmark = pytest.mark.processes

AGENT = """
import os

from langchain_core.messages import AIMessage
from langchain_core.tools import tool
from langgraph.graph import END, START, MessagesState, StateGraph
from langgraph.prebuilt import ToolNode
from sqlalchemy import text

from langgraph_fence import fence_graph, fence_tools, get_execution_context
from langgraph_fence.database import create_engine, transaction
from langgraph_fence.sinks import fenced_write, setup_sink

_engine = None


async def _sink():
    global _engine
    if _engine is None:
        _engine = create_engine(
            os.environ["LANGGRAPH_FENCE_URL"], schema=os.environ.get("LANGGRAPH_FENCE_SCHEMA")
        )
        await setup_sink(_engine)
        async with transaction(_engine) as conn:
            await conn.execute(
                text("CREATE TABLE IF NOT EXISTS refunds (order_id TEXT, token BIGINT)")
            )
    return _engine


@tool
async def refund(order: str) -> str:
    \"\"\"Refund an order.\"\"\"
    fence = get_execution_context().fence
    await fence.confirm_now()  # the lease is live, confirmed by the store, right now
    async with transaction(await _sink()) as conn:
        async with fenced_write(conn, fence, f"refund:{order}") as write:
            if not write.applied:
                await conn.execute(
                    text("INSERT INTO refunds VALUES (:o, :t)"), {"o": order, "t": fence.token}
                )
                write.record(f"refunded {order}")
    return f"refunded {order} under token {fence.token}"


async def plan(state: MessagesState) -> dict:
    call = {"name": "refund", "args": {"order": "42"}, "id": "call-1"}
    return {"messages": [AIMessage(content="", tool_calls=[call])]}


builder = StateGraph(MessagesState)
builder.add_node("plan", plan)
builder.add_node("tools", ToolNode(fence_tools([refund])))
builder.add_edge(START, "plan")
builder.add_edge("plan", "tools")
builder.add_edge("tools", END)
graph = fence_graph(builder).compile()
"""


@pytest.fixture
def server(database: Database, tmp_path: Path) -> Iterator[str]:
    with agent_server(database, tmp_path, {"agent.py": AGENT}, {"refunds": "./agent.py:graph"}) as (
        url,
        _,
    ):
        yield url


async def test_a_fenced_tool_writes_once_through_the_sink_in_a_server_run(
    server: str, database: Database
) -> None:
    client = get_client(url=server)
    thread = (await client.threads.create())["thread_id"]
    done = await client.runs.wait(thread, "refunds", input={"messages": [("user", "refund 42")]})
    assert done["messages"][-1]["content"] == "refunded 42 under token 1"
    assert rows(database, "SELECT order_id, token FROM refunds") == [("42", 1)]
    scope = f"default:{thread}"
    assert rows(database, "SELECT token FROM fence_high_water WHERE scope_key = :s", s=scope) == [
        (1,)
    ]
    applied = "SELECT idempotency_key, token FROM fence_applied WHERE scope_key = :s"
    assert rows(database, applied, s=scope) == [("refund:42", 1)]
    # The stamp set is empty once the run is done: the tool's entry cleared with its writes.
    assert rows(
        database,
        "SELECT status, pending_effects FROM fence_leases WHERE execution_id = :t",
        t=thread,
    ) in ([("done", "{}")], [("done", {})])

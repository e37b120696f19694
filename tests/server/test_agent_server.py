"""Fenced runs on the real Agent Server: ``langgraph dev`` (langgraph-cli[inmem]) started as a
user starts it, in a project folder whose ``langgraph.json`` names
``langgraph_fence.server.checkpointer``, driven through its HTTP API with ``langgraph_sdk``,
on SQLite and on PostgreSQL. What is asserted is read from the database the factory writes:
the thread's lease and the fence token on each stored checkpoint.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
from langgraph_sdk import get_client

from langgraph_fence.server import check_api_version, settings_from_env
from tests.support.agent_server import agent_server, rows
from tests.support.write_steps import Database

#: `langgraph dev` is a process of its own (CI's lowest run leaves it to the newest).
pytestmark = pytest.mark.processes

AGENT = """
from typing import TypedDict

from langgraph.graph import END, START, StateGraph
from langgraph.types import interrupt

from langgraph_fence import fence_graph, get_execution_context


class State(TypedDict, total=False):
    n: int
    tokens: list[int]
    answer: str


async def work(state: State) -> dict:
    # The fence this step runs under: the token of the thread's lease the server run holds.
    token = get_execution_context().fence.token
    return {"tokens": [*state.get("tokens", []), token]}


async def remember(state: State) -> dict:
    # A store write inside a fenced step of a server run: made under the run's token.
    from langgraph.config import get_store

    token = get_execution_context().fence.token
    await get_store().aput(("notes",), "last", {"token": token})
    return {"tokens": [*state.get("tokens", []), token]}


async def ask(state: State) -> dict:
    return {"answer": interrupt("approve?")}


builder = StateGraph(State)
builder.add_node("work", work)
builder.add_edge(START, "work")
builder.add_edge("work", END)
graph = fence_graph(builder).compile()

asking = StateGraph(State)
asking.add_node("work", work)
asking.add_node("ask", ask)
asking.add_edge(START, "work")
asking.add_edge("work", "ask")
asking.add_edge("ask", END)
approval = fence_graph(asking).compile()

memory = StateGraph(State)
memory.add_node("remember", remember)
memory.add_edge(START, "remember")
memory.add_edge("remember", END)
memorize = fence_graph(memory).compile()
"""


@pytest.fixture
def server(database: Database, tmp_path: Path) -> Iterator[str]:
    """``langgraph dev`` serving the two graphs of :data:`AGENT`; its URL."""
    graphs = {
        "agent": "./agent.py:graph",
        "approval": "./agent.py:approval",
        "memorize": "./agent.py:memorize",
    }
    store = {"store": {"path": "langgraph_fence.server.store"}}
    with agent_server(database, tmp_path, {"agent.py": AGENT}, graphs, config=store) as (url, _):
        yield url


async def test_each_server_run_of_a_thread_holds_its_lease_and_writes_under_its_token(
    server: str, database: Database
) -> None:
    client = get_client(url=server)
    thread = (await client.threads.create())["thread_id"]
    first = await client.runs.wait(thread, "agent", input={"n": 1})
    assert first["tokens"] == [1]  # the step ran under the run's fence
    second = await client.runs.wait(thread, "agent", input={"n": 2})
    assert second["tokens"] == [1, 2]  # the next run of the thread: the next token

    leases = rows(
        database,
        "SELECT tenant_id, execution_id, holder, epoch, status FROM fence_leases",
    )
    assert leases == [("default", thread, None, 2, "done")]
    tokens = rows(
        database,
        "SELECT fence_token FROM fence_checkpoints WHERE thread_id = :t ORDER BY checkpoint_id",
        t=thread,
    )
    assert [r[0] for r in tokens] == [1, 1, 1, 2, 2, 2]  # no checkpoint stored unfenced
    state = await client.threads.get_state(thread)
    assert state["values"]["tokens"] == [1, 2]


async def test_an_interrupt_is_resumed_by_the_next_run_under_the_next_token(
    server: str, database: Database
) -> None:
    client = get_client(url=server)
    thread = (await client.threads.create())["thread_id"]
    paused = await client.runs.wait(thread, "approval", input={"n": 1})
    assert paused["tokens"] == [1]
    state = await client.threads.get_state(thread)
    assert state["next"] == ["ask"]
    resumed = await client.runs.wait(thread, "approval", command={"resume": "yes"})
    assert resumed["answer"] == "yes"
    leases = rows(database, "SELECT epoch, status FROM fence_leases")
    assert leases == [(2, "done")]


async def test_a_store_write_of_a_server_run_is_made_under_its_token(
    server: str, database: Database
) -> None:
    client = get_client(url=server)
    thread = (await client.threads.create())["thread_id"]
    await client.runs.wait(thread, "memorize", input={})
    await client.runs.wait(thread, "memorize", input={})
    item = await client.store.get_item(["notes"], "last")
    assert item is not None
    assert item["value"] == {"token": 2}
    written = rows(
        database,
        "SELECT fence_token, fence_execution FROM fence_store_items WHERE key = 'last'",
    )
    assert written == [(2, thread)]  # checked against the lease in the write's statement
    # The server's /store endpoints write from outside any run: passed through, unfenced.
    await client.store.put_item(["admin"], "note", {"by": "operator"})
    assert (await client.store.get_item(["admin"], "note"))["value"] == {"by": "operator"}


def test_the_factory_is_refused_on_a_langgraph_api_release_it_was_not_tested_with() -> None:
    with pytest.raises(RuntimeError, match=r"langgraph-api 0\.17\.0 is not supported.*0\.16\.x"):
        check_api_version("0.17.0")
    assert check_api_version("0.16.7") == "0.16.7"


def test_the_factory_names_the_variable_it_misses() -> None:
    with pytest.raises(ValueError, match="LANGGRAPH_FENCE_URL is not set"):
        settings_from_env({})
    with pytest.raises(ValueError, match="LANGGRAPH_FENCE_LEASE_TTL must be a number"):
        settings_from_env(
            {"LANGGRAPH_FENCE_URL": "sqlite+aiosqlite:///x.db", "LANGGRAPH_FENCE_LEASE_TTL": "soon"}
        )
    url, options = settings_from_env(
        {"LANGGRAPH_FENCE_URL": "sqlite+aiosqlite:///x.db", "LANGGRAPH_FENCE_LEASE_TTL": "20"}
    )
    assert (url, options) == ("sqlite+aiosqlite:///x.db", {"lease_ttl": 20.0})

"""Fenced runs on the real Agent Server: ``langgraph dev`` (langgraph-cli[inmem]) started as a
user starts it, in a project folder whose ``langgraph.json`` names
``langgraph_fence.server.checkpointer``, driven through its HTTP API with ``langgraph_sdk``,
on SQLite and on PostgreSQL. What is asserted is read from the database the factory writes:
the thread's lease and the fence token on each stored checkpoint.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import sqlalchemy as sa
from langgraph_sdk import get_client

from langgraph_fence.server import check_api_version, settings_from_env
from tests.support.databases import sync_engine_for
from tests.support.polling import eventually_sync
from tests.support.write_steps import Database

#: `langgraph dev` is a process of its own (CI's lowest run leaves it to the newest).
pytestmark = pytest.mark.processes

LANGGRAPH = str(Path(sys.executable).with_name("langgraph"))

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
"""


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def _url(database: Database) -> str:
    url = database.url
    return (
        url
        if url.startswith("sqlite")
        else url.replace("postgresql://", "postgresql+asyncpg://", 1)
    )


@pytest.fixture
def server(database: Database, tmp_path: Path) -> Iterator[str]:
    """``langgraph dev`` on a free port, in a project folder of the test's own; its URL."""
    project = tmp_path / "project"
    project.mkdir()
    (project / "agent.py").write_text(AGENT)
    (project / "langgraph.json").write_text(
        json.dumps(
            {
                "dependencies": ["."],
                "graphs": {"agent": "./agent.py:graph", "approval": "./agent.py:approval"},
                "checkpointer": {"path": "langgraph_fence.server.checkpointer"},
            }
        )
    )
    port = _free_port()
    env = {**os.environ, "LANGGRAPH_FENCE_URL": _url(database)}
    env.pop("PYTHONPATH", None)
    if database.schema:
        env["LANGGRAPH_FENCE_SCHEMA"] = database.schema
    log = tmp_path / "server.log"
    with log.open("wb") as out:
        proc = subprocess.Popen(
            [LANGGRAPH, "dev", "--no-browser", "--no-reload", "--port", str(port)],
            cwd=project,
            env=env,
            stdout=out,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
    try:

        def up() -> bool:
            assert proc.poll() is None, log.read_text()
            try:
                socket.create_connection(("127.0.0.1", port), timeout=1).close()
            except OSError:
                return False
            return "Using custom checkpointer: FencedCheckpointer" in log.read_text()

        eventually_sync(up, timeout=120.0, interval=0.2, what=log.read_text)
        yield f"http://127.0.0.1:{port}"
    finally:
        os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()


def _rows(database: Database, sql: str, **params: Any) -> list[Any]:
    engine = sync_engine_for(
        "sqlite" if database.url.startswith("sqlite") else "postgresql",
        database.url.split("///", 1)[-1] if database.url.startswith("sqlite") else database.url,
        database.schema,
    )
    try:
        with engine.connect() as conn:
            return list(conn.execute(sa.text(sql), params))
    finally:
        engine.dispose()


async def test_each_server_run_of_a_thread_holds_its_lease_and_writes_under_its_token(
    server: str, database: Database
) -> None:
    client = get_client(url=server)
    thread = (await client.threads.create())["thread_id"]
    first = await client.runs.wait(thread, "agent", input={"n": 1})
    assert first["tokens"] == [1]  # the step ran under the run's fence
    second = await client.runs.wait(thread, "agent", input={"n": 2})
    assert second["tokens"] == [1, 2]  # the next run of the thread: the next token

    leases = _rows(
        database,
        "SELECT tenant_id, execution_id, holder, epoch, status FROM fence_leases",
    )
    assert [tuple(r) for r in leases] == [("default", thread, None, 2, "done")]
    tokens = _rows(
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
    leases = _rows(database, "SELECT epoch, status FROM fence_leases")
    assert [tuple(r) for r in leases] == [(2, "done")]


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

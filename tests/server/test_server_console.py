"""The operator's console mounted in the Agent Server, as docs/console.md says to: a custom
app named in ``langgraph.json`` (``http.app``) mounting ``create_app`` under ``/fence``, on
the database the server's fenced checkpointer writes. A run of the server appears on the
console's pages, and ``/fence/metrics`` parses."""

from __future__ import annotations

import asyncio
import re
from pathlib import Path

import httpx
import pytest
from langgraph_sdk import get_client
from prometheus_client.parser import text_string_to_metric_families

from tests.support.agent_server import agent_server
from tests.support.polling import eventually
from tests.support.write_steps import Database

pytestmark = pytest.mark.processes

AGENT = """
from typing import TypedDict

from langgraph.graph import END, START, StateGraph

from langgraph_fence import fence_graph


class State(TypedDict, total=False):
    n: int


builder = StateGraph(State)
builder.add_node("add", lambda state: {"n": state.get("n", 0) + 1})
builder.add_edge(START, "add")
builder.add_edge("add", END)
graph = fence_graph(builder).compile()
"""

CONSOLE_APP = """
import os

from starlette.applications import Starlette
from starlette.routing import Mount

from langgraph_fence.console import create_app

console = create_app(
    os.environ["LANGGRAPH_FENCE_URL"], schema=os.environ.get("LANGGRAPH_FENCE_SCHEMA") or None
)
app = Starlette(routes=[Mount("/fence", app=console)])
"""


async def test_the_console_mounted_in_the_agent_server_shows_its_runs(
    database: Database, tmp_path: Path
) -> None:
    files = {"agent.py": AGENT, "console_app.py": CONSOLE_APP}
    config = {"http": {"app": "./console_app.py:app"}}
    with agent_server(database, tmp_path, files, {"agent": "./agent.py:graph"}, config=config) as (
        url,
        log,
    ):
        client = get_client(url=url)
        thread = await asyncio.wait_for(client.threads.create(), 60)
        done = await asyncio.wait_for(
            client.runs.wait(thread["thread_id"], "agent", input={"n": 1}), 120
        )
        assert done["n"] == 2
        async with httpx.AsyncClient(base_url=url, timeout=60) as http:
            listing = await http.get("/fence/executions")
            assert listing.status_code == 200, log.read_text()[-3000:]
            assert thread["thread_id"] in listing.text
            link = re.search(r'href="(/fence/executions/[^"?]+)"', listing.text)
            assert link is not None

            async def journaled() -> bool:  # written off the run's path, a moment after
                page = await http.get(link.group(1))
                assert page.status_code == 200
                return "took the lease" in page.text

            await eventually(journaled, timeout=30, what="the run's take on its timeline")
            metrics = await http.get("/fence/metrics")
            assert metrics.status_code == 200
            names = {f.name for f in text_string_to_metric_families(metrics.text)}
            assert "langgraph_fence_executions" in names

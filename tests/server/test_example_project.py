"""``examples/agent-server`` as a user runs it: the folder copied as it is, ``langgraph dev``
started in it (its ``.env`` names the database), the graph run as its README runs it."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
from langgraph_sdk import get_client

from tests.support.agent_server import rows, serving
from tests.support.write_steps import Database

pytestmark = pytest.mark.processes

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "agent-server"


async def test_the_example_project_runs_fenced_as_it_is(tmp_path: Path) -> None:
    project = tmp_path / "agent-server"
    shutil.copytree(EXAMPLE, project, ignore=shutil.ignore_patterns("fence.db*", "__pycache__"))
    with serving(project, tmp_path / "server.log", {}) as url:
        client = get_client(url=url)
        thread = await client.threads.create()
        done = await client.runs.wait(
            thread["thread_id"], "payments", input={"order": "42", "amount_cents": 1999}
        )
    assert done["receipt"] == "order 42: 1999 cents charged"
    assert done["charged_under_token"] == 1
    # Where its .env says: a file beside langgraph.json, the thread's lease ended there.
    database = Database(f"sqlite+aiosqlite:///{project / 'fence.db'}", "")
    assert rows(database, "SELECT execution_id, epoch, status FROM fence_leases") == [
        (thread["thread_id"], 1, "done")
    ]

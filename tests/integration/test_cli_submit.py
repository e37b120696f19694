"""``langgraph-fence submit`` and ``langgraph-fence runs``, run as a user runs them: each in a
process of its own, with a ``langgraph-fence worker`` process serving the graph."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path
from typing import Any, TypedDict

import pytest
from langgraph.graph import END, START, StateGraph

from langgraph_fence import Instance, fence_graph
from tests.polling import eventually_sync
from tests.processes import worker_args

#: The CLI or Python run in processes of their own (CI's lowest run leaves them to the newest).
pytestmark = pytest.mark.processes

ROOT = Path(__file__).parents[2]
ENV = {**os.environ, "PYTHONPATH": str(ROOT), "COLUMNS": "200"}


class State(TypedDict, total=False):
    text: str
    out: str


def shout_graphs(instance: Instance) -> dict[str, Any]:
    """The worker's ``--graphs`` factory: ``shout`` upper-cases its input."""

    async def shout(state: State) -> dict[str, Any]:
        return {"out": state["text"].upper()}

    builder = StateGraph(State)
    builder.add_node("shout", shout)
    builder.add_edge(START, "shout")
    builder.add_edge("shout", END)
    graph = fence_graph(builder).compile(checkpointer=instance.checkpointer, name="shout")
    return {"shout": graph}


def cli(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "langgraph_fence.cli", *args],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=ROOT,
        env=ENV,
    )


def runs(db: str) -> list[dict[str, Any]]:
    done = cli("runs", "--db", db, "--json")
    assert done.returncode == 0, done.stderr
    listed: list[dict[str, Any]] = json.loads(done.stdout)
    return listed


def test_submit_runs_and_a_worker_on_the_command_line(tmp_path: Path) -> None:
    db = f"sqlite+aiosqlite:///{tmp_path}/cli.db"
    first = cli(
        "submit", "--db", db, "--graph", "shout", "--thread", "t1", "--input", '{"text": "hi"}'
    )
    assert first.returncode == 0, first.stderr
    assert "pending" in first.stdout
    assert "default:t1" in first.stdout
    # No worker yet: the run is listed, unserved, under its graph's name.
    [listed] = runs(db)
    assert listed["graph"] == "shout"
    assert listed["status"] == "pending"
    assert listed["unserved"] is True
    assert listed["submitted"] is True
    busy = cli(
        "submit", "--db", db, "--graph", "shout", "--thread", "t1", "--input", '{"text": "no"}'
    )
    assert busy.returncode == 3
    assert busy.stderr.count("\n") == 1, busy.stderr
    assert busy.stderr.startswith("refused:"), busy.stderr
    queued = cli(
        "submit", "--db", db, "--graph", "shout", "--thread", "t1", "--input",
        '{"text": "next"}', "--on-busy", "enqueue",
    )  # fmt: skip
    assert queued.returncode == 0, queued.stderr
    assert "queued" in queued.stdout
    assert [entry["status"] for entry in runs(db)] == ["pending", "queued"]
    bad = cli("submit", "--db", db, "--graph", "shout", "--thread", "t1", "--input", "{oops")
    assert bad.returncode == 2
    assert "--input must be JSON" in bad.stderr

    log = (tmp_path / "worker.log").open("wb")
    graphs = "tests.integration.test_cli_submit:shout_graphs"
    args = worker_args(db, "", graphs, ttl=30, poll=0.1, instance_id="cli-worker")
    worker = subprocess.Popen(
        [sys.executable, *args],
        stdout=log,
        stderr=log,
        cwd=ROOT,
        env=ENV,
    )
    try:
        waited = cli(
            "submit", "--db", db, "--graph", "shout", "--thread", "t2", "--input",
            '{"text": "there"}', "--wait", "60",
        )  # fmt: skip
        assert waited.returncode == 0, waited.stderr
        assert json.loads(waited.stdout) == {"text": "there", "out": "THERE"}
        # A run of a graph the live worker does not serve stays listed as unserved.
        other = cli("submit", "--db", db, "--graph", "other", "--thread", "t3", "--input", "{}")
        assert other.returncode == 0, other.stderr

        def t1_ran() -> dict[str, Any] | None:
            listed_now = {entry["thread_id"]: entry for entry in runs(db)}
            return None if "t1" in listed_now else listed_now  # t1 was claimed and ran

        listed_now = eventually_sync(t1_ran, timeout=30, interval=0.1, what="t1 to be run")
        assert listed_now["t3"]["unserved"] is True
        assert listed_now["t3"]["graph"] == "other"
    finally:
        worker.send_signal(signal.SIGTERM)
        worker.wait(timeout=30)
        log.close()
    assert worker.returncode == 0, (tmp_path / "worker.log").read_text()

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
from tests.support.databases import Database
from tests.support.polling import eventually_sync
from tests.support.processes import worker_args

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
    late = cli(
        "submit", "--db", db, "--graph", "shout", "--thread", "t2", "--input", "{}",
        "--not-before", "tomorrow",
    )  # fmt: skip
    assert late.returncode == 2
    assert "--not-before must be a delay in seconds" in late.stderr

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
        # A delayed run of a served graph waits for its time, listed as scheduled.
        delayed = cli(
            "submit", "--db", db, "--graph", "shout", "--thread", "t4", "--input",
            '{"text": "later"}', "--not-before", "3600",
        )  # fmt: skip
        assert delayed.returncode == 0, delayed.stderr
        assert "scheduled for 20" in delayed.stdout

        def t1_ran() -> dict[str, Any] | None:
            listed_now = {entry["thread_id"]: entry for entry in runs(db)}
            return None if "t1" in listed_now else listed_now  # t1 was claimed and ran

        listed_now = eventually_sync(t1_ran, timeout=30, interval=0.1, what="t1 to be run")
        assert listed_now["t3"]["unserved"] is True
        assert listed_now["t3"]["graph"] == "other"
        assert listed_now["t4"]["status"] == "scheduled"
        assert listed_now["t4"]["not_before"].endswith("+00:00")
    finally:
        worker.send_signal(signal.SIGTERM)
        worker.wait(timeout=30)
        log.close()
    assert worker.returncode == 0, (tmp_path / "worker.log").read_text()


def orders_and_chat_graphs(instance: Instance) -> dict[str, Any]:
    """A worker's ``--graphs`` factory: the ``orders`` of docs/getting-started.md's quickstart
    (its module, ``orders.py``, written by the test into the worker's folder) and ``chat``,
    whose state is LangChain messages."""
    import orders  # type: ignore[import-not-found]  # the quickstart, written by the test
    from langchain_core.messages import AIMessage
    from langgraph.graph import MessagesState

    async def reply(state: MessagesState) -> dict[str, Any]:
        return {"messages": [AIMessage(content=f"you said {state['messages'][-1].content}")]}

    builder = StateGraph(MessagesState)
    builder.add_node("reply", reply)
    builder.add_edge(START, "reply")
    builder.add_edge("reply", END)
    chat = fence_graph(builder).compile(checkpointer=instance.checkpointer, name="chat")
    return {**orders.graphs(instance), "chat": chat}


def test_submit_gives_the_quickstart_orders_graph_its_config_and_context_and_prints_json(
    database: Database, tmp_path: Path
) -> None:
    """The quickstart's own ``orders`` graph reads ``configurable["user_id"]`` and the context:
    submitted from the command line with them, a worker runs it as ``ainvoke`` would, and
    ``--wait`` prints JSON (messages as dicts, never Python reprs)."""
    from tests.support.quickstart import quickstart

    (tmp_path / "orders.py").write_text(quickstart())
    db, schema = database.url, database.schema
    where = ["--db", db, *(["--schema", schema] if schema else [])]
    env = {
        **ENV,
        "PYTHONPATH": os.pathsep.join([str(tmp_path), str(ROOT)]),
        "PLAN_SECONDS": "0",
    }
    log_path = tmp_path / "worker.log"
    graphs = "tests.integration.test_cli_submit:orders_and_chat_graphs"
    args = worker_args(db, schema, graphs, ttl=30, poll=0.1, instance_id="cli-worker")
    with log_path.open("wb") as log:
        worker = subprocess.Popen(
            [sys.executable, *args], stdout=log, stderr=log, cwd=tmp_path, env=env
        )
    try:
        ordered = cli(
            "submit", *where, "--graph", "orders", "--thread", "order-42", "--tenant", "acme",
            "--input", '{"order": "42"}',
            "--config", '{"tags": ["checkout"], "recursion_limit": 10}',
            "--configurable", "user_id=u-7",
            "--context", '{"currency": "EUR"}',
            "--wait", "120",
        )  # fmt: skip
        assert ordered.returncode == 0, ordered.stdout + ordered.stderr + log_path.read_text()
        assert json.loads(ordered.stdout) == {
            "order": "42",
            "plan": "charge the card",
            "receipt": "order 42 charged to u-7",
        }
        charged = (
            "charging order 42 for u-7 in EUR at token 1 (tags ['checkout'], recursion limit 10)"
        )
        assert charged in log_path.read_text()

        chatted = cli(
            "submit", *where, "--graph", "chat", "--thread", "chat-1",
            "--input", '{"messages": [{"role": "user", "content": "hi"}]}', "--wait", "120",
        )  # fmt: skip
        assert chatted.returncode == 0, chatted.stdout + chatted.stderr
        human, ai = json.loads(chatted.stdout)["messages"]
        assert human["type"] == "human"
        assert human["data"]["content"] == "hi"
        assert ai["type"] == "ai"
        assert ai["data"]["content"] == "you said hi"
        # What message_to_dict makes, messages_from_dict reads back.
        from langchain_core.messages import messages_from_dict

        assert [m.content for m in messages_from_dict([human, ai])] == ["hi", "you said hi"]
    finally:
        worker.send_signal(signal.SIGTERM)
        worker.wait(timeout=60)
    assert worker.returncode == 0, log_path.read_text()


@pytest.mark.parametrize(
    ("options", "expected"),
    [
        (["--config", "{oops"], "--config must be JSON, e.g."),
        (["--config", "[1]"], "--config must be a JSON object"),
        (["--config", '{"configurable": 3}'], '"configurable" must be a JSON object'),
        (["--configurable", "user_id"], "--configurable must be KEY=VALUE (e.g."),
        (["--configurable", "=u-7"], "--configurable must be KEY=VALUE (e.g."),
        (["--context", "{bad"], "--context must be JSON, e.g."),
        (["--config", '{"configurable": {"thread_id": "t2"}}'], "name the thread once"),
    ],
)
def test_bad_config_or_context_is_one_line_naming_the_option(
    options: list[str], expected: str, tmp_path: Path
) -> None:
    db = f"sqlite+aiosqlite:///{tmp_path}/cli.db"
    done = cli("submit", "--db", db, "--graph", "g", "--thread", "t1", "--input", "{}", *options)
    assert done.returncode == 2, done.stdout + done.stderr
    assert "Traceback" not in done.stderr
    [line] = done.stderr.splitlines()
    assert expected in line, line
    assert done.stdout == ""
    assert not (tmp_path / "cli.db").exists()  # refused before the database was opened

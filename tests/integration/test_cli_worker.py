"""``langgraph-fence worker`` started as an operator starts it: in the folder of their graph
module (as ``uvicorn app:app``), logging at INFO what it serves, on SQLite and PostgreSQL."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import urllib.error
import urllib.request
from pathlib import Path

import pytest
from prometheus_client.parser import text_string_to_metric_families

from tests.support.databases import Database
from tests.support.polling import eventually_sync
from tests.support.processes import free_port

#: The CLI or Python run in processes of their own (CI's lowest run leaves them to the newest).
pytestmark = pytest.mark.processes

SCRIPT = str(Path(sys.executable).with_name("langgraph-fence"))

GRAPHS_MODULE = """
from langgraph.graph import END, START, StateGraph
from typing_extensions import TypedDict

from langgraph_fence import fence_graph


class State(TypedDict):
    n: int


def graphs(instance):
    builder = StateGraph(State)
    builder.add_node("step", lambda state: {"n": state["n"] + 1})
    builder.add_edge(START, "step")
    builder.add_edge("step", END)
    return {"counter": fence_graph(builder).compile(checkpointer=instance.checkpointer)}
"""


def serve_until_ready(folder: Path, *args: str) -> tuple[str, str]:
    """Start ``langgraph-fence worker *args`` in ``folder``, wait (with a deadline) until it
    says it serves, SIGTERM it; its stdout and stderr, once it exited 0."""
    out, err = folder / "worker.out", folder / "worker.err"
    # PYTHONPATH left out: a module is found because the worker runs in its folder.
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    with out.open("wb") as out_file, err.open("wb") as err_file:
        proc = subprocess.Popen(
            [SCRIPT, "worker", *args], stdout=out_file, stderr=err_file, cwd=folder, env=env
        )
    try:

        def serves() -> bool:
            assert proc.poll() is None, out.read_text() + err.read_text()
            return "serves" in out.read_text()

        eventually_sync(
            serves, timeout=90.0, interval=0.1, what=lambda: out.read_text() + err.read_text()
        )
    finally:
        proc.send_signal(signal.SIGTERM)
        code = proc.wait(timeout=60)
    assert code == 0, out.read_text() + err.read_text()
    return out.read_text(), err.read_text()


def test_the_worker_imports_a_module_from_its_folder_and_logs_at_info(
    database: Database, tmp_path: Path
) -> None:
    (tmp_path / "my_graphs.py").write_text(GRAPHS_MODULE)
    schema = ["--schema", database.schema] if database.schema else []
    said, logged = serve_until_ready(
        tmp_path, "--db", database.url, *schema, "--graphs", "my_graphs:graphs"
    )
    assert "serves ['counter']" in said
    assert "concurrency 4, polls every 1.0 s, lease TTL 30.0 s" in said
    assert " INFO langgraph_fence.serve: instance " in logged, logged
    assert "stopped serving" in logged


def test_a_quiet_worker_logs_no_info(tmp_path: Path) -> None:
    (tmp_path / "my_graphs.py").write_text(GRAPHS_MODULE)
    db = f"sqlite+aiosqlite:///{tmp_path}/w.db"
    said, logged = serve_until_ready(tmp_path, "-q", "--db", db, "--graphs", "my_graphs:graphs")
    assert "serves ['counter']" in said
    assert " INFO " not in logged, logged


def test_a_module_missing_from_the_folder_is_one_line_saying_where_it_looked(
    tmp_path: Path,
) -> None:
    done = subprocess.run(
        [SCRIPT, "worker", "--db", f"sqlite+aiosqlite:///{tmp_path}/w.db", "--graphs", "nope:f"],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=tmp_path,
    )
    assert done.returncode == 2, done.stderr
    assert done.stderr.splitlines() == [
        f"error: --graphs: no module 'nope' in the current folder ({tmp_path}) or on "
        "sys.path: start the worker in the folder that holds it, or fix MODULE"
    ]


ONE_AT_A_TIME_MODULE = """
import os
import time

from langgraph.graph import END, START, StateGraph
from typing_extensions import TypedDict

from langgraph_fence import fence_graph


class State(TypedDict):
    n: int


def step(state):
    with open(os.environ["STEPS_LOG"], "a") as log:
        log.write("start\\n")
    time.sleep(0.2)  # the step's work: long enough for a second run to start beside it
    with open(os.environ["STEPS_LOG"], "a") as log:
        log.write("end\\n")
    return {"n": state["n"] + 1}


def graphs(instance):
    builder = StateGraph(State)
    builder.add_node("step", step)
    builder.add_edge(START, "step")
    builder.add_edge("step", END)
    return {"counter": fence_graph(builder).compile(checkpointer=instance.checkpointer)}
"""


def test_a_worker_with_max_held_1_runs_one_execution_at_a_time(tmp_path: Path) -> None:
    """``--max-held`` bounds what the worker holds, whatever ``--concurrency`` allows: three
    runs waiting, concurrency 4, max-held 1: their steps never overlap."""
    import asyncio

    from langgraph_fence import Instance

    (tmp_path / "my_graphs.py").write_text(ONE_AT_A_TIME_MODULE)
    db = f"sqlite+aiosqlite:///{tmp_path}/w.db"
    log = tmp_path / "steps.log"

    async def submit_three() -> None:
        async with Instance.open(db) as client:
            for n in range(3):
                cfg = {"configurable": {"thread_id": f"t{n}"}}
                await client.submit("counter", {"n": 0}, cfg, tenant_id="a")

    asyncio.run(submit_three())
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    env["STEPS_LOG"] = str(log)
    args = ["worker", "--db", db, "--graphs", "my_graphs:graphs", "--concurrency", "4"]
    out = tmp_path / "worker.out"
    with out.open("wb") as out_file:
        proc = subprocess.Popen(
            [SCRIPT, *args, "--max-held", "1", "--poll-interval", "0.05"],
            stdout=out_file,
            stderr=subprocess.STDOUT,
            cwd=tmp_path,
            env=env,
        )
    try:

        def all_ran() -> bool:
            assert proc.poll() is None, out.read_text()
            return log.exists() and log.read_text().count("end") == 3

        eventually_sync(all_ran, timeout=90.0, interval=0.05, what=lambda: out.read_text())
    finally:
        proc.send_signal(signal.SIGTERM)
        code = proc.wait(timeout=60)
    assert code == 0, out.read_text()
    assert "holds at most 1," in out.read_text()
    assert log.read_text().split() == ["start", "end"] * 3


def test_max_held_must_be_a_positive_number(tmp_path: Path) -> None:
    db = f"sqlite+aiosqlite:///{tmp_path}/w.db"
    done = subprocess.run(
        [SCRIPT, "worker", "--db", db, "--graphs", "m:f", "--max-held", "0"],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=tmp_path,
    )
    assert done.returncode == 2, done.stderr
    assert "--max-held" in done.stderr


def test_a_worker_serves_its_metrics_while_it_works_and_stops_with_it(tmp_path: Path) -> None:
    """``--metrics-port``: Prometheus scrapes the worker itself (its own instance's figures
    beside the database's), and SIGTERM still stops it cleanly."""
    (tmp_path / "my_graphs.py").write_text(GRAPHS_MODULE)
    port = free_port()
    out, err = tmp_path / "worker.out", tmp_path / "worker.err"
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    args = ["--db", f"sqlite+aiosqlite:///{tmp_path}/w.db", "--graphs", "my_graphs:graphs"]
    args += ["--instance-id", "w-metrics", "--max-held", "7", "--metrics-port", str(port)]
    with out.open("wb") as out_file, err.open("wb") as err_file:
        proc = subprocess.Popen(
            [SCRIPT, "worker", *args], stdout=out_file, stderr=err_file, cwd=tmp_path, env=env
        )
    try:

        def scraped() -> str | None:
            assert proc.poll() is None, out.read_text() + err.read_text()
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as r:
                    return str(r.read().decode())
            except OSError:
                return None

        exposition = eventually_sync(scraped, timeout=90.0, interval=0.2, what="/metrics")
        # /metrics alone: no page of the console (executions, recorded input) on this port.
        with pytest.raises(urllib.error.HTTPError) as refused:
            urllib.request.urlopen(f"http://127.0.0.1:{port}/executions", timeout=5)
        assert refused.value.code == 404
    finally:
        proc.send_signal(signal.SIGTERM)
        code = proc.wait(timeout=60)
    assert code == 0, out.read_text() + err.read_text()
    samples = {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for family in text_string_to_metric_families(exposition)
        for s in family.samples
    }
    assert samples[("langgraph_fence_max_held", (("instance", "w-metrics"),))] == 7.0
    assert ("langgraph_fence_held_leases", (("instance", "w-metrics"),)) in samples
    dropped = ("langgraph_fence_journal_entries_dropped_total", (("instance", "w-metrics"),))
    assert samples[dropped] == 0.0


def test_a_metrics_port_in_use_is_one_line_naming_the_option(tmp_path: Path) -> None:
    (tmp_path / "my_graphs.py").write_text(GRAPHS_MODULE)
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen(1)
        port = taken.getsockname()[1]
        done = subprocess.run(
            [
                SCRIPT,
                "worker",
                "--db",
                f"sqlite+aiosqlite:///{tmp_path}/w.db",
                "--graphs",
                "my_graphs:graphs",
                "--metrics-port",
                str(port),
            ],
            capture_output=True,
            text=True,
            timeout=120,
            cwd=tmp_path,
        )
    assert done.returncode == 2, done.stderr
    assert done.stderr.splitlines()[-1].startswith(
        f"error: --metrics-port: cannot listen on 127.0.0.1:{port}"
    ), done.stderr

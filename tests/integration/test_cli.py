"""The ``langgraph-fence`` command, run as a user runs it: in a process of its own."""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys

import pytest

from langgraph_fence import LeaseKey, SqlLeaseRepository
from langgraph_fence.database import create_engine
from tests.support.cli import cli

#: The CLI or Python run in processes of their own (CI's lowest run leaves them to the newest).
pytestmark = pytest.mark.processes


@pytest.mark.parametrize("command", ["executions", "dead-letters"])
def test_listing_commands_read_the_lease_table(command: str, tmp_path: object) -> None:
    db = f"sqlite+aiosqlite:///{tmp_path}/cli.db"
    migrated = subprocess.run(
        [sys.executable, "-m", "langgraph_fence.cli", "migrate", "--db", db],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert migrated.returncode == 0, migrated.stderr
    listed = subprocess.run(
        [sys.executable, "-m", "langgraph_fence.cli", command, "--db", db],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert listed.returncode == 0, listed.stderr
    assert "scope key" in listed.stdout


async def _take(db: str, keys: list[LeaseKey]) -> None:
    engine = create_engine(db)
    try:
        store = SqlLeaseRepository(engine)
        await store.setup()
        for key in keys:
            assert await store.acquire(key, "worker-1", 30.0) is not None
    finally:
        await engine.dispose()


def test_executions_filter_by_tenant_and_show_it(tmp_path: object) -> None:
    db = f"sqlite+aiosqlite:///{tmp_path}/cli.db"
    asyncio.run(_take(db, [LeaseKey("acme", "chat-1"), LeaseKey("globex", "chat-1")]))

    def listed(*args: str) -> str:
        done = subprocess.run(
            [sys.executable, "-m", "langgraph_fence.cli", "executions", "--db", db, *args],
            capture_output=True,
            text=True,
            timeout=60,
            env={**os.environ, "COLUMNS": "200"},
        )
        assert done.returncode == 0, done.stderr
        return done.stdout

    both = listed()
    assert "acme:chat-1" in both
    assert "globex:chat-1" in both
    only_acme = listed("--tenant", "acme")
    assert "acme:chat-1" in only_acme
    assert "globex" not in only_acme


async def _run_and_hold(db: str, tenant: str, thread: str) -> None:
    """A finished run of ``thread`` (its input recorded), and a live lease of another."""
    from langgraph.graph import END, START, StateGraph
    from typing_extensions import TypedDict

    from langgraph_fence import fence_graph
    from langgraph_fence.instance import Instance

    class State(TypedDict):
        card: str

    builder = StateGraph(State)
    builder.add_node("step", lambda state: {"card": state["card"]})
    builder.add_edge(START, "step")
    builder.add_edge("step", END)
    async with Instance.open(db, instance_id="worker-1") as instance:
        graph = fence_graph(builder).compile(checkpointer=instance.checkpointer, name="graph")
        config = {"configurable": {"thread_id": thread}}
        await instance.ainvoke(graph, {"card": "4111111111111111"}, config, tenant_id=tenant)
        await instance.repository.acquire(LeaseKey(tenant, "busy"), "worker-1", 300.0)


def test_erase_removes_a_thread_and_refuses_a_running_one(tmp_path: object) -> None:
    db = f"sqlite+aiosqlite:///{tmp_path}/cli.db"
    asyncio.run(_run_and_hold(db, "acme", "order-1"))

    refused = cli("erase", "--db", db, "--tenant", "acme", "--thread", "busy")
    assert refused.returncode == 3, refused.stdout + refused.stderr
    assert "worker-1" in refused.stderr
    assert "busy" in refused.stderr

    erased = cli("erase", "--db", db, "--tenant", "acme", "--thread", "order-1")
    assert erased.returncode == 0, erased.stdout + erased.stderr
    # What it erased, rows per table: the run's checkpoints, its record, its binding.
    said = {
        line.split()[1]: int(line.split()[-2])
        for line in erased.stdout.splitlines()
        if line.split()[1:2] and line.split()[1].startswith("fence_")
    }
    assert said["fence_checkpoints"] >= 2, erased.stdout
    assert said["fence_executions"] == 1, erased.stdout
    assert said["fence_thread_bindings"] == 1, erased.stdout
    path = f"{tmp_path}/cli.db"
    import sqlite3

    with sqlite3.connect(path) as conn:
        for table in ("fence_checkpoints", "fence_checkpoint_blobs", "fence_executions"):
            count = conn.execute(f"SELECT count(*) FROM {table} WHERE tenant_id = 'acme'")
            assert count.fetchone() == (0,), table
        status = conn.execute(
            "SELECT status, reason FROM fence_leases WHERE execution_id = 'order-1'"
        ).fetchone()
    assert status == ("done", None)

    missing = cli("erase", "--db", db, "--tenant", "", "--thread", "order-1")
    assert missing.returncode == 2
    assert "--tenant" in missing.stderr

    # Nothing there (another tenant's thread, a thread that never was): said, exit 1.
    for tenant, thread in (("globex", "order-1"), ("acme", "never-was")):
        nothing = cli("erase", "--db", db, "--tenant", tenant, "--thread", thread)
        assert nothing.returncode == 1, nothing.stdout + nothing.stderr
        assert "nothing erased" in nothing.stderr
        assert f"tenant {tenant!r} has no thread {thread!r}" in nothing.stderr

"""langgraph#8796 with real processes on real PostgreSQL: a frozen worker cannot fork the chain.

Worker A (a process of its own, ``fork_worker.py``) takes the lease with a 1.5 s TTL and runs
n1 -> n2 -> n3 with ``durability="sync"``. Inside n2 it signals; the test freezes it with
SIGSTOP. Worker B (this test) waits until the lease has expired on PostgreSQL's clock, takes
it (epoch + 1), resumes the thread and finishes it. Then A is continued: its n2 returns and
its writes must all be refused (it exits with ExecutionFencedError), and the checkpoint
chain must not fork: every checkpoint has at most one child and the head is B's, under B's
token. Without the fence, A would land a second child of n1's checkpoint.

``plain``: the same scenario with nothing but LangGraph's own calls on both sides: A and B
each open an ``Instance`` and call ``graph.ainvoke`` on a graph compiled with its
checkpointer (issue 12); B's call is refused while A's lease lives, then takes it.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import time
from pathlib import Path
from typing import Any

import pytest
from sqlalchemy import text

from checkpointers import SqlCheckpointer
from langgraph_fence import (
    ExecutionLeaseHeldError,
    FencedCheckpointer,
    Instance,
    LeaseKey,
    LeaseStatus,
    SqlLeaseRepository,
)
from langgraph_fence.fence import RunHandle
from tests.support.databases import unique
from tests.support.fork_worker import EXIT_FENCED, build_graph, engine_for
from tests.support.polling import eventually
from tests.support.processes import start_process, stop_process, wait_ready

pytestmark = [pytest.mark.chaos, pytest.mark.postgres]

WORKER = Path(__file__).parents[1] / "support" / "fork_worker.py"
TTL_A = 1.5
DEADLINE = 25.0


def read_signal(path: Path) -> str | None:
    return path.read_text() if path.exists() else None


async def resume_as_b_plain(url: str, schema: str, config: Any, deadline: float) -> Any:
    """B the LangGraph way: ``graph.ainvoke(None, config)`` until A's lease has expired."""
    options = {"connect_args": {"server_settings": {"search_path": schema}}}
    async with Instance.open(url, engine_options=options, instance_id="worker-B") as b:
        graph = build_graph(b.checkpointer, fenced=True)

        async def resumed() -> Any:
            try:
                return await graph.ainvoke(None, config)
            except ExecutionLeaseHeldError:
                return None  # A's lease has not expired yet on PostgreSQL's clock

        return await eventually(resumed, deadline=deadline, what="A's lease to expire")


@pytest.mark.parametrize("mode", ["handle", "plain"])
async def test_a_frozen_worker_cannot_fork_the_chain(
    pg_schema: tuple[str, str], tmp_path: Path, mode: str
) -> None:
    url, schema = pg_schema
    tenant, thread = unique("tenant"), unique("thread")
    key = LeaseKey(tenant, thread)
    inside_n2 = tmp_path / "inside-n2"
    started = time.monotonic()
    deadline = started + DEADLINE

    engine = engine_for(url, schema)
    repo = SqlLeaseRepository(engine)
    saver = SqlCheckpointer(engine)
    await saver.setup()
    args = [str(WORKER), url, schema, tenant, thread, str(TTL_A), str(inside_n2)]
    if mode == "plain":
        args.append("plain")
    worker_a = await start_process(args, tmp_path, "a", stdin=True)
    try:
        entered = await wait_ready(
            worker_a, lambda: read_signal(inside_n2), deadline=deadline, what="A to reach n2"
        )
        token_a = int(entered)
        os.kill(worker_a.pid, signal.SIGSTOP)

        config: Any = {"configurable": {"thread_id": thread, "tenant_id": tenant}}
        if mode == "plain":
            resumed = await resume_as_b_plain(url, schema, config, deadline)
            lease_b = await repo.get(key)
            assert lease_b is not None
            assert lease_b.status is LeaseStatus.DONE
        else:
            lease_b = await eventually(
                lambda: repo.acquire(key, "worker-B", 30),
                deadline=deadline,
                what="A's lease to expire",
            )
            handle_b = RunHandle(repo, lease_b, 30)
            graph = build_graph(FencedCheckpointer(saver))
            resumed = await graph.ainvoke(
                None, {"configurable": {**config["configurable"], "__fence": handle_b}}
            )
        assert lease_b.epoch == token_a + 1
        assert resumed == {"log": ["n1", "n2", "n3"]}

        os.kill(worker_a.pid, signal.SIGCONT)
        assert worker_a.proc.stdin is not None
        worker_a.proc.stdin.write(b"go\n")
        await worker_a.proc.stdin.drain()
        await asyncio.wait_for(worker_a.wait(), timeout=max(0.1, deadline - time.monotonic()))
        assert worker_a.returncode == EXIT_FENCED, worker_a.said()
        report = json.loads(worker_a.out.read_text().strip().splitlines()[-1])
        assert report == {
            "result": "fenced",
            "token_held": token_a,
            "token_seen": lease_b.epoch,
            "recorded": True,
        }

        async with engine.connect() as conn:
            chain = (
                await conn.execute(
                    text(
                        "SELECT checkpoint_id, parent_checkpoint_id, fence_token"
                        " FROM fence_checkpoints WHERE thread_id = :t AND checkpoint_ns = ''"
                        " ORDER BY checkpoint_id"
                    ),
                    {"t": thread},
                )
            ).all()
            stale_writes = (
                await conn.execute(
                    text(
                        "SELECT w.task_id FROM fence_checkpoint_writes w"
                        " JOIN fence_checkpoints c ON c.thread_id = w.thread_id"
                        " AND c.checkpoint_ns = w.checkpoint_ns"
                        " AND c.checkpoint_id = w.checkpoint_id"
                        " WHERE w.thread_id = :t AND w.fence_token = :a AND c.fence_token = :b"
                    ),
                    {"t": thread, "a": token_a, "b": lease_b.epoch},
                )
            ).all()
        children: dict[str | None, int] = {}
        for _, parent, _ in chain:
            children[parent] = children.get(parent, 0) + 1
        assert all(count == 1 for count in children.values()), f"the chain forked: {chain}"
        assert [row[2] for row in chain] == [token_a] * 3 + [lease_b.epoch] * 2, chain
        assert stale_writes == [], "A wrote under its old token onto B's checkpoints"
        head = await saver.aget_tuple(config)
        assert head is not None
        assert head.checkpoint["id"] == chain[-1][0]
        assert head.checkpoint["channel_values"]["log"] == ["n1", "n2", "n3"]
    finally:
        await stop_process(worker_a, grace=1.0)
        await engine.dispose()
    assert time.monotonic() - started < 30

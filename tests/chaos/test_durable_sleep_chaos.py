"""Durable sleep across worker processes (issue 37): a tree sleeps 5 s; meanwhile both
workers (each holding one execution at most) run other work, so the sleeping tree holds no
slot and no lease; the worker that ran it is SIGKILLed during the sleep; the other one
resumes it at its time, not before, at the next token.

On real PostgreSQL (a schema of the test's own); marks written by the graphs
(``tests/support/sleep_graphs.py``) say which process ran which node when."""

from __future__ import annotations

import os
import signal
from pathlib import Path

import pytest

from langgraph_fence import LeaseStatus, RunState
from langgraph_fence.instance import Instance
from tests.support.databases import pg_engine_options, unique
from tests.support.polling import eventually
from tests.support.processes import MARK_DIR_ENV, start_worker, stop_process
from tests.support.sleep_graphs import marks

pytestmark = [pytest.mark.chaos, pytest.mark.postgres]

GRAPHS = "tests.support.sleep_graphs:graphs"
NAP = 5.0
DEADLINE = 60.0


def config(thread: str) -> dict[str, dict[str, str]]:
    return {"configurable": {"thread_id": thread}}


async def test_a_sleeping_tree_survives_its_workers_kill_and_wakes_on_time(
    own_schema: tuple[str, str], tmp_path: Path
) -> None:
    url, schema = own_schema
    env = {MARK_DIR_ENV: str(tmp_path)}
    one = ["--max-held", "1", "--concurrency", "1"]
    workers = [
        await start_worker(
            tmp_path, name, url, schema, GRAPHS, ttl=3.0, poll=0.1, extra=one, env=env
        )
        for name in ("a", "b")
    ]
    try:
        async with Instance.open(url, engine_options=pg_engine_options(schema)) as client:
            tree = unique("tree")
            run = await client.submit("nap", {"seconds": NAP}, config(tree), tenant_id="t")

            def slept() -> dict[str, object] | None:
                return next((m for m in marks(tmp_path) if m["node"] == "nap"), None)

            nap = await eventually(slept, timeout=DEADLINE, what="the tree to sleep")

            async def handed_back() -> RunState | None:
                state = await run.state()
                return state if state.status is LeaseStatus.PENDING else None

            state = await eventually(handed_back, timeout=DEADLINE, what="its lease back")
            assert state.holder is None
            assert state.not_before is not None
            wake_at = state.not_before
            # Both workers, one execution each at most, run other work while it sleeps.
            others = [
                await client.submit("busy", {"seconds": 1.0}, config(unique("b")), tenant_id="t")
                for _ in range(2)
            ]
            for other in others:
                await other.result(timeout=DEADLINE)
            sleeper = next(w for w in workers if w.pid == nap["pid"])
            os.kill(sleeper.pid, signal.SIGKILL)
            await sleeper.wait()
            assert (await run.result(timeout=DEADLINE))["log"] == ["before", "nap", "after"]
            token = (await run.state()).epoch
    finally:
        for worker in workers:
            await stop_process(worker, grace=20)
    seen = marks(tmp_path)
    work = [m for m in seen if m["node"] == "work"]
    assert {m["pid"] for m in work} == {w.pid for w in workers}, "each worker ran other work"
    assert all(m["t"] < wake_at for m in work), "the other work ran while the tree slept"
    resumed = [m for m in seen if m["thread"] == tree and m["node"] in ("woke", "after")]
    survivor = next(w for w in workers if w is not sleeper)
    assert [m["node"] for m in resumed] == ["woke", "after"]
    assert {m["pid"] for m in resumed} == {survivor.pid}
    assert min(m["t"] for m in resumed) >= wake_at, "it woke before its time"
    assert [m["node"] for m in seen if m["thread"] == tree].count("before") == 1
    assert token == 2  # taken again at the next token

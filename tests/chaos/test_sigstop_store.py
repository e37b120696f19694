"""langgraph#8796 for the store: a frozen worker's memory write never replaces the new
holder's, with real processes on SQLite and PostgreSQL.

Worker A (``store_worker.py``, a process of its own) runs the ``memory`` graph through
``Instance.ainvoke`` with a 2 s lease, compiled with ``store=instance.store``. Inside
``remember``, just before its store write, it blocks and the test SIGSTOPs it. Worker B, the
product's ``langgraph-fence worker``, takes the expired execution over (token + 1), runs
``remember`` and writes its own summary. Then A is continued and makes its write at once:
A's run ends fenced and B's summary stands, its row carrying B's token. With A's renewals
held (its timer never fires: the pause came right after a renewal) the write itself is what
meets the take-over, and the store's guard refuses it (the error names the store put); with
them running, A's overdue renewal races the write, and whichever is first fences the run.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import sys
import time
from pathlib import Path
from typing import Any

import pytest
from sqlalchemy import text

from checkpointers import SqlStore
from langgraph_fence import LeaseKey, LeaseStatus, SqlLeaseRepository
from langgraph_fence.database import create_engine, schema_options
from tests.chaos.chaos_graphs import EXIT_FENCED
from tests.chaos.conftest import poll
from tests.chaos.store_worker import MEMORY_GRAPH, memory_namespace
from tests.chaos.test_sigstop_worker import stop_process, tail
from tests.chaos.write_steps import Database
from tests.conftest import unique

pytestmark = [pytest.mark.chaos]

ROOT = Path(__file__).parents[2]
TTL = 2.0
RENEW = 0.5
POLL = 0.2
DEADLINE = 60.0


@pytest.mark.parametrize("renewals", ["held", "running"])
async def test_a_sigstopped_worker_s_memory_write_is_refused_and_b_s_stands(
    database: Database, tmp_path: Path, renewals: str
) -> None:
    tenant, thread = unique("tenant"), unique("thread")
    key = LeaseKey(tenant, thread)
    ns = memory_namespace(thread)
    inside = tmp_path / "inside-remember.json"
    deadline = time.monotonic() + DEADLINE
    engine = create_engine(database.url, **schema_options(database.schema))
    repo = SqlLeaseRepository(engine)
    await repo.setup()
    store = SqlStore(engine, tenant_id=tenant)  # an admin's view of the tenant's items
    await store.setup()
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    schema_args = ["--schema", database.schema] if database.schema else []
    a_out, a_err = tmp_path / "a.out", tmp_path / "a.err"
    b_out, b_err = tmp_path / "b.out", tmp_path / "b.err"
    procs: list[asyncio.subprocess.Process] = []

    async def summary() -> tuple[Any, Any]:
        item = await store.aget(ns, "summary")
        async with engine.connect() as conn:
            token = (
                await conn.execute(
                    text(
                        "SELECT fence_token FROM fence_store_items"
                        " WHERE tenant_id = :t AND prefix = :p AND key = 'summary'"
                    ),
                    {"t": tenant, "p": ".".join(ns)},
                )
            ).scalar_one_or_none()
        return (None if item is None else item.value), token

    try:
        with a_out.open("wb") as out, a_err.open("wb") as err:
            worker_a = await asyncio.create_subprocess_exec(
                sys.executable,
                "-m",
                "tests.chaos.store_worker",
                database.url,
                database.schema,
                tenant,
                thread,
                str(TTL),
                str(RENEW),
                str(inside),
                renewals,
                stdin=asyncio.subprocess.PIPE,
                stdout=out,
                stderr=err,
                cwd=ROOT,
                env=env,
            )
        procs.append(worker_a)

        async def a_is_inside() -> dict[str, Any] | None:
            if worker_a.returncode is not None:
                pytest.fail(f"worker A exited early ({worker_a.returncode}): {tail(a_err)}")
            return json.loads(inside.read_text()) if inside.exists() else None

        token_a = int((await poll(a_is_inside, deadline, "worker A to enter remember"))["token"])
        os.kill(worker_a.pid, signal.SIGSTOP)
        assert await summary() == (None, None)  # A has not written

        with b_out.open("wb") as out, b_err.open("wb") as err:
            worker_b = await asyncio.create_subprocess_exec(
                sys.executable,
                "-m",
                "langgraph_fence.cli",
                "worker",
                "--db",
                database.url,
                *schema_args,
                "--graphs",
                "tests.chaos.store_worker:memory_graphs",
                "--lease-ttl",
                str(TTL),
                "--poll-interval",
                str(POLL),
                "--instance-id",
                "worker-B",
                stdout=out,
                stderr=err,
                cwd=ROOT,
                env=env,
            )
        procs.append(worker_b)

        async def b_finished() -> Any:
            if worker_b.returncode is not None:
                pytest.fail(f"worker B exited ({worker_b.returncode}): {tail(b_err)}")
            lease = await repo.get(key)
            return lease if lease is not None and lease.status is LeaseStatus.DONE else None

        lease_b = await poll(b_finished, deadline, "worker B to take over and finish")
        token_b = lease_b.epoch
        assert token_b == token_a + 1, lease_b
        value_b, row_token = await summary()
        assert value_b is not None
        assert value_b["by"] == token_b
        assert row_token == token_b

        assert worker_a.stdin is not None
        worker_a.stdin.write(b"go\n")
        await worker_a.stdin.drain()
        os.kill(worker_a.pid, signal.SIGCONT)
        try:
            await asyncio.wait_for(worker_a.wait(), 30.0)
        except TimeoutError:
            pytest.fail(f"worker A did not stop after SIGCONT: {tail(a_out)} {tail(a_err)}")
        lines = a_out.read_text().strip().splitlines()
        assert lines, f"worker A printed nothing: {tail(a_err)}"
        report = json.loads(lines[-1])
        assert worker_a.returncode == EXIT_FENCED, (report, tail(a_err))
        assert report["raised"] == "ExecutionFencedError", report
        assert report["token_held"] == token_a, report
        assert report["token_seen"] == token_b, report
        if renewals == "held":
            assert "store put" in report["message"], report  # the write itself was refused

        assert await summary() == (value_b, token_b), "A's stale summary landed"
        assert MEMORY_GRAPH in b_out.read_text()
        print(f"\nrenewals {renewals}: A fenced by {report['message'].split(' refused')[0]!r}")
    finally:
        for proc in procs:
            await stop_process(proc, grace=10.0)
        await engine.dispose()

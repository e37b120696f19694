"""langgraph#8796 for the store: a frozen worker's memory write never replaces the new
holder's, with real processes on SQLite and PostgreSQL.

Worker A (``store_worker.py``, a process of its own) runs the ``memory`` graph through
``Instance.ainvoke`` with a 3 s lease, compiled with ``store=instance.store``. Inside
``remember``, just before its store write, it blocks and the test SIGSTOPs it. Worker B, the
product's ``langgraph-fence worker``, takes the expired execution over (token + 1), runs
``remember`` and writes its own summary. Then A is continued and makes its write at once:
A's run ends fenced and B's summary stands, its row carrying B's token. With A's renewals
held (they run until ``remember`` blocks, and never after: a timer overdue after the pause
does not fire) the write itself is what meets the take-over, and the store's guard refuses
it (the error names the store put); with them running, A's overdue renewal races the write,
and whichever is first fences the run.
"""

from __future__ import annotations

import os
import signal
import sqlite3
import time
from pathlib import Path
from typing import Any

import pytest
from sqlalchemy import text
from sqlalchemy.exc import DBAPIError

from checkpointers import SqlStore
from langgraph_fence import Lease, LeaseKey, LeaseStatus, SqlLeaseRepository
from langgraph_fence.database import create_engine, schema_options
from tests.support.chaos_graphs import EXIT_FENCED
from tests.support.databases import Database, unique
from tests.support.polling import eventually
from tests.support.processes import (
    Started,
    continued_report,
    read_json,
    start_process,
    start_worker,
    stop_process,
    tail,
    wait_ready,
)
from tests.support.store_worker import MEMORY_GRAPH, memory_namespace

pytestmark = [pytest.mark.chaos]

#: 3 s: A's renewals, on a loop two busy cores slow, must keep its lease on the way to
#: ``remember`` (held, they stop there).
TTL = 3.0
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
    procs: list[Started] = []

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

    async def takes_a_write() -> bool:
        """Whether the database takes a write on A's lease row now, without waiting: no
        statement of A holds its lock (SQLite: the file's; PostgreSQL: the row's)."""
        if engine.dialect.name == "sqlite":
            path = engine.url.database or ""
            probe = sqlite3.connect(path, timeout=0)
            try:
                probe.execute("BEGIN IMMEDIATE")
                probe.execute("ROLLBACK")
                return True
            except sqlite3.OperationalError:
                return False
            finally:
                probe.close()
        try:
            async with engine.begin() as conn:
                await conn.execute(
                    text(
                        "SELECT 1 FROM fence_leases WHERE tenant_id = :t AND execution_id = :e"
                        " FOR UPDATE NOWAIT"
                    ),
                    {"t": tenant, "e": thread},
                )
            return True
        except DBAPIError:
            return False

    async def stop_between_writes(pid: int) -> None:
        """SIGSTOP ``pid`` at an instant none of its statements holds a lock. Its loop is
        blocked before its write, but a statement it sent before (a renewal) may still be
        running on its driver's thread; stopped there, it would hold the lock B needs for
        as long as it is stopped. Such a stop is continued until the statement ends."""
        while True:
            os.kill(pid, signal.SIGSTOP)
            if await takes_a_write():
                return
            os.kill(pid, signal.SIGCONT)
            await eventually(takes_a_write, deadline=deadline, what="A's statement to end")

    try:
        args = [database.url, database.schema, tenant, thread, str(TTL), str(RENEW), str(inside)]
        worker_a = await start_process(
            ["-m", "tests.support.store_worker", *args, renewals], tmp_path, "a", stdin=True
        )
        procs.append(worker_a)
        entered = await wait_ready(
            worker_a, lambda: read_json(inside), deadline=deadline, what="A to enter remember"
        )
        token_a = int(entered["token"])
        await stop_between_writes(worker_a.pid)
        assert await summary() == (None, None)  # A has not written

        worker_b = await start_worker(
            tmp_path,
            "b",
            database.url,
            database.schema,
            "tests.support.store_worker:memory_graphs",
            ttl=TTL,
            poll=POLL,
            instance_id="worker-B",
            wait=False,
        )
        procs.append(worker_b)

        async def b_finished() -> Lease | None:
            lease = await repo.get(key)
            return lease if lease is not None and lease.status is LeaseStatus.DONE else None

        lease_b = await wait_ready(
            worker_b, b_finished, deadline=deadline, what="worker B to take over and finish"
        )
        token_b = lease_b.epoch
        assert token_b == token_a + 1, lease_b
        value_b, row_token = await summary()
        assert value_b is not None
        assert value_b["by"] == token_b
        assert row_token == token_b

        assert worker_a.proc.stdin is not None
        worker_a.proc.stdin.write(b"go\n")
        await worker_a.proc.stdin.drain()
        report = await continued_report(worker_a, 30.0)
        assert worker_a.returncode == EXIT_FENCED, (report, tail(worker_a.err))
        assert report["raised"] == "ExecutionFencedError", report
        assert report["token_held"] == token_a, report
        assert report["token_seen"] == token_b, report
        if renewals == "held":
            assert "store put" in report["message"], report  # the write itself was refused

        assert await summary() == (value_b, token_b), "A's stale summary landed"
        assert MEMORY_GRAPH in worker_b.out.read_text()
        print(f"\nrenewals {renewals}: A fenced by {report['message'].split(' refused')[0]!r}")
    finally:
        for proc in procs:
            await stop_process(proc, grace=10.0)
        await engine.dispose()

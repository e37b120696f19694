"""A worker frozen past its lease (SIGSTOP) stops within one renew interval once continued.

Worker A (``chaos_graphs.py hold``, a process of its own) runs ``fence_hold`` through
``Instance.ainvoke`` with a 2 s lease renewed every 0.5 s, and signals once inside ``work``
(a long model call). The test freezes it with SIGSTOP. Worker B is the product's own
``langgraph-fence worker`` process: once A's lease has expired on PostgreSQL's clock it
takes the execution over (epoch + 1) and resumes it to ``done``. Then A is continued: its
``ainvoke`` must raise ``ExecutionFencedError`` (exit code 3) within one renew interval plus
a small slack, and A must write nothing more: the thread's checkpoint and write rows are the
same after A's exit as they were when B finished, and no row carries A's token on top of B's.
"""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path

import pytest

from checkpointers import SqlCheckpointer
from langgraph_fence import Lease, LeaseKey, LeaseStatus, SqlLeaseRepository
from langgraph_fence.database import create_engine
from langgraph_fence.lease.records import SqlExecutionRecords
from tests.support.chaos_graphs import EXIT_FENCED, HOLD_GRAPH, spawn_hold
from tests.support.chaos_serve import rows_of
from tests.support.databases import pg_engine_options, setup_all, unique
from tests.support.processes import (
    Started,
    continued_report,
    read_json,
    start_worker,
    stop_process,
    tail,
    wait_ready,
)

pytestmark = [pytest.mark.chaos, pytest.mark.postgres]

TTL = 2.0
RENEW = 0.5
POLL = 0.2
#: Room for the event loop to wake and one round trip to PostgreSQL, on a busy 2-core box.
SLACK = 0.75
DEADLINE = 40.0


async def test_a_sigstopped_worker_is_fenced_within_one_renew_interval(
    own_schema: tuple[str, str], tmp_path: Path
) -> None:
    url, schema = own_schema
    tenant, thread = unique("tenant"), unique("thread")
    key = LeaseKey(tenant, thread)
    inside_work = tmp_path / "inside-work.json"
    started = time.monotonic()
    deadline = started + DEADLINE

    engine = create_engine(url, **pg_engine_options(schema))
    await setup_all(engine)
    repo = SqlLeaseRepository(engine)
    saver = SqlCheckpointer(engine)
    await saver.setup()  # on this loop
    procs: list[Started] = []
    try:
        worker_a = await spawn_hold(url, schema, tenant, thread, TTL, RENEW, inside_work, tmp_path)
        procs.append(worker_a)
        worker_b = await start_worker(
            tmp_path,
            "b",
            url,
            schema,
            "tests.support.chaos_graphs:hold_graphs",
            ttl=TTL,
            poll=POLL,
            instance_id="worker-B",
            verbose=True,
            wait=False,
        )
        procs.append(worker_b)
        inside = await wait_ready(
            worker_a, lambda: read_json(inside_work), deadline=deadline, what="A to enter work"
        )
        token_a = int(inside["token"])
        os.kill(worker_a.pid, signal.SIGSTOP)

        async def b_finished() -> Lease | None:
            lease = await repo.get(key)
            return lease if lease is not None and lease.status is LeaseStatus.DONE else None

        lease_b = await wait_ready(
            worker_b, b_finished, deadline=deadline, what="worker B to take over and finish"
        )
        assert lease_b.epoch == token_a + 1, lease_b
        state = await saver.aget_tuple(
            {"configurable": {"thread_id": thread, "checkpoint_ns": "", "tenant_id": tenant}}
        )
        assert state is not None
        token_b = lease_b.epoch
        assert state.checkpoint["channel_values"]["log"] == [
            f"start@{token_a}",
            f"work@{token_b}",
            f"end@{token_b}",
        ]
        checkpoints_before, writes_before = await rows_of(engine, thread)
        assert any(row[-1] == token_a for row in checkpoints_before)  # A's own, before the stop
        assert any(row[-1] == token_b for row in checkpoints_before)  # B's, after the take

        continued_at = time.monotonic()
        report = await continued_report(worker_a, RENEW + SLACK + 5.0)
        exited_after = time.monotonic() - continued_at
        assert worker_a.returncode == EXIT_FENCED, (report, tail(worker_a.err))
        assert report["raised"] == "ExecutionFencedError", report
        assert report["token_held"] == token_a, report
        assert report["token_seen"] == token_b, report
        fenced_after = report["at"] - continued_at  # time.monotonic is one clock per machine
        assert fenced_after <= RENEW + SLACK, (
            f"worker A went on for {fenced_after:.3f} s after SIGCONT: more than one renew "
            f"interval ({RENEW} s) + {SLACK} s"
        )

        checkpoints_after, writes_after = await rows_of(engine, thread)
        assert checkpoints_after == checkpoints_before, "A landed a checkpoint after SIGCONT"
        assert writes_after == writes_before, "A landed a write after SIGCONT"
        b_checkpoints = {row[1] for row in checkpoints_after if row[-1] == token_b}
        stale_on_b = [row for row in writes_after if row[1] in b_checkpoints and row[-1] != token_b]
        assert stale_on_b == [], f"writes under another token on B's checkpoints: {stale_on_b}"
        lease = await repo.get(key)
        assert lease is not None
        assert lease.status is LeaseStatus.DONE
        assert lease.epoch == token_b
        assert (await SqlExecutionRecords(engine).get(key)) is not None
        print(
            f"\nA fenced {fenced_after * 1000:.0f} ms after SIGCONT (exit after "
            f"{exited_after * 1000:.0f} ms); B took over at token {token_b} and finished"
        )
    finally:
        for proc in procs:
            await stop_process(proc, grace=10.0)
        await engine.dispose()
    assert worker_b.returncode == 0, f"worker B did not stop cleanly: {tail(worker_b.err)}"
    assert HOLD_GRAPH in worker_b.out.read_text()
    assert time.monotonic() - started < DEADLINE + 15

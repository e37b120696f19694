"""A replay after a stale worker: the frozen worker of the first run is fenced, the replay intact.

Worker A (``chaos_graphs.py hold``, a process of its own) runs ``fence_hold`` (start -> work
-> end) through ``Instance.ainvoke`` with a 2 s lease and stops inside ``work``; the test
freezes it with SIGSTOP. Once A's lease has expired on PostgreSQL's clock, this process (an
instance of its own) time-travels: ``ainvoke(None, config)`` with the checkpoint before
``start`` (from ``aget_state_history``), which replays the whole graph at the next token to
``done``. Then A is continued: its run must raise ``ExecutionFencedError`` (exit 3) and land
nothing; the replayed branch is the thread's latest state, every row of it under the
replay's token, and no row of A's token came after the replay began.
"""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path
from typing import Any

import pytest

from langgraph_fence import Instance, LeaseKey, LeaseStatus
from tests.support.chaos_graphs import EXIT_FENCED, build_hold_graph, spawn_hold
from tests.support.chaos_serve import rows_of
from tests.support.databases import pg_engine_options, unique
from tests.support.polling import eventually
from tests.support.processes import continued_report, read_json, stop_process, tail, wait_ready

pytestmark = [pytest.mark.chaos, pytest.mark.postgres]

TTL = 2.0
RENEW = 0.5
DEADLINE = 40.0


async def test_a_replay_is_never_resumed_by_the_stale_worker_of_the_first_run(
    own_schema: tuple[str, str], tmp_path: Path
) -> None:
    url, schema = own_schema
    tenant, thread = unique("tenant"), unique("thread")
    key = LeaseKey(tenant, thread)
    config: dict[str, Any] = {"configurable": {"thread_id": thread, "tenant_id": tenant}}
    inside_work = tmp_path / "inside-work.json"
    deadline = time.monotonic() + DEADLINE
    async with Instance.open(
        url, engine_options=pg_engine_options(schema), instance_id="replayer", lease_ttl=TTL
    ) as b:
        engine = b.repository.engine  # type: ignore[attr-defined]
        worker_a = await spawn_hold(url, schema, tenant, thread, TTL, RENEW, inside_work, tmp_path)
        try:
            entered = await wait_ready(
                worker_a, lambda: read_json(inside_work), deadline=deadline, what="A to enter work"
            )
            token_a = int(entered["token"])
            os.kill(worker_a.pid, signal.SIGSTOP)

            async def a_expired() -> bool | None:
                lease = await b.repository.get(key)
                assert lease is not None, lease
                assert lease.epoch == token_a, lease
                assert lease.expires_at is not None
                return True if lease.expires_at <= await b.repository.now() else None

            await eventually(a_expired, deadline=deadline, what="A's lease to expire on its clock")
            graph = build_hold_graph(b)
            history = [s async for s in graph.aget_state_history(config)]
            before_start = next(s for s in history if s.next == ("start",))
            replay_began = {row for rows in await rows_of(engine, thread) for row in rows}
            out = await b.ainvoke(graph, None, before_start.config, tenant_id=tenant)
            token_b = token_a + 1
            assert out["log"] == [f"start@{token_b}", f"work@{token_b}", f"end@{token_b}"]
            lease = await b.repository.get(key)
            assert lease is not None
            assert lease.status is LeaseStatus.DONE
            assert lease.epoch == token_b
            checkpoints_before, writes_before = await rows_of(engine, thread)

            continued_at = time.monotonic()
            report = await continued_report(worker_a, RENEW + 10.0)
            assert worker_a.returncode == EXIT_FENCED, (report, tail(worker_a.err))
            assert report["token_held"] == token_a, report
            assert report["token_seen"] == token_b, report

            # A's writes were refused: nothing landed after SIGCONT ...
            checkpoints_after, writes_after = await rows_of(engine, thread)
            assert checkpoints_after == checkpoints_before, "A landed a checkpoint"
            assert writes_after == writes_before, "A landed a write"
            # ... nor under A's token since the replay began: every new row is the replay's.
            new = set(checkpoints_after) | set(writes_after)
            assert {row[-1] for row in new - replay_began} == {token_b}
            # The replayed branch is intact, and it is the thread's latest state.
            latest = await graph.aget_state(config)
            assert latest.values["log"] == out["log"]
            assert latest.next == ()
            assert await b.repository.get(key) == lease
            print(f"\nA fenced {time.monotonic() - continued_at:.2f} s after SIGCONT")
        finally:
            await stop_process(worker_a, grace=10.0)

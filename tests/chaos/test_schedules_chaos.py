"""Schedules under chaos (issue 37): three ``langgraph-fence worker`` processes fire 100
schedules ticking every second, one worker is SIGKILLed and the database restarted in the
middle; every tick fired exactly once (one submitted run each in ``fence_runs``, none
twice) and none lost (every run ran and counted its tick in ``schedule_ticks``,
``tests/support/schedule_graphs.py``, each second from the first tick to the last).

On the session's private cluster (``cluster_schema``: restarted here, never the shared
server). ``LGF_SCHEDULE_SECONDS`` sets how long the schedules tick (default 120: the issue's
two minutes); ``LGF_SCHEDULES`` how many there are (default 100).
"""

from __future__ import annotations

import asyncio
import os
import signal
import time
from collections import Counter, defaultdict
from datetime import datetime
from pathlib import Path

import pytest
from sqlalchemy import text

from langgraph_fence.database import schema_options
from langgraph_fence.instance import Instance
from tests.support.pg_cluster import PgCluster
from tests.support.polling import eventually
from tests.support.processes import start_worker, stop_process
from tests.support.schedule_graphs import COUNT_GRAPH, CREATE_TICKS

pytestmark = [pytest.mark.chaos, pytest.mark.postgres]

GRAPHS = "tests.support.schedule_graphs:graphs"
SECONDS = float(os.environ.get("LGF_SCHEDULE_SECONDS", "120"))
SCHEDULES = int(os.environ.get("LGF_SCHEDULES", "100"))
TENANT = "ticks"
TTL = 3.0
DRAIN_DEADLINE = 300.0


async def test_every_tick_fires_once_through_a_kill_and_a_database_restart(
    cluster_schema: tuple[PgCluster, str], tmp_path: Path
) -> None:
    cluster, schema = cluster_schema
    url = cluster.url
    workers = []
    async with Instance.open(url, engine_options=schema_options(schema)) as client:
        engine = client._run_queue()._engine
        async with engine.begin() as conn:
            await conn.execute(text(CREATE_TICKS))
        try:
            for n in range(3):
                extra = ["--concurrency", "20"]
                worker = await start_worker(
                    tmp_path, f"w{n}", url, schema, GRAPHS, ttl=TTL, poll=0.25, extra=extra
                )
                workers.append(worker)
            ids = [f"s{n:03d}" for n in range(SCHEDULES)]
            for sid in ids:
                await client.schedules.create(
                    sid, COUNT_GRAPH, {"n": 0}, {"configurable": {"thread_id": sid}},
                    tenant_id=TENANT, cron="* * * * * *", overlap="enqueue", grace=600,
                    durability="exit",
                )  # fmt: skip
            began = time.monotonic()
            await asyncio.sleep(SECONDS / 3)  # the schedules tick (the test's length, no wait)
            os.kill(workers[0].pid, signal.SIGKILL)  # mid-firing, mid-run, whatever it was
            await workers[0].wait()
            await asyncio.sleep(SECONDS / 3)
            down = await asyncio.to_thread(cluster.restart, 3.0)
            await asyncio.sleep(max(0.0, SECONDS - (time.monotonic() - began)))
            for sid in ids:
                assert await client.schedules.pause(sid, tenant_id=TENANT)

            async def drained() -> bool:
                async with engine.connect() as conn:
                    busy = await conn.execute(
                        text(
                            "SELECT (SELECT count(*) FROM fence_leases WHERE tenant_id = :t "
                            "AND status IN ('pending', 'running')) + (SELECT count(*) FROM "
                            "fence_runs WHERE tenant_id = :t AND status = 'queued')"
                        ),
                        {"t": TENANT},
                    )
                    return busy.scalar_one() == 0

            await eventually(drained, timeout=DRAIN_DEADLINE, interval=1.0, what="the runs")
            for worker in workers[1:]:
                assert worker.returncode is None, worker.post_mortem()
        finally:
            for worker in workers:
                await stop_process(worker, grace=20)

        async with engine.connect() as conn:
            counted = list(await conn.execute(text("SELECT schedule_id, tick FROM schedule_ticks")))
            statuses = Counter(
                row.status
                for row in await conn.execute(
                    text("SELECT status FROM fence_leases WHERE tenant_id = :t"), {"t": TENANT}
                )
            )
            # Each firing submits one run: its own row of fence_runs, its tick in its config.
            serde = client._run_queue().serde
            submitted = Counter(
                (
                    row.thread_id,
                    serde.loads_typed((row.run_type, bytes(row.run)))["config"]["metadata"][
                        "scheduled_for"
                    ],
                )
                for row in await conn.execute(
                    text("SELECT thread_id, run_type, run FROM fence_runs WHERE tenant_id = :t"),
                    {"t": TENANT},
                )
            )
        schedules = {s.schedule_id: s for s in await client.schedules.list(tenant_id=TENANT)}

    twice = [tick for tick, n in submitted.items() if n > 1]
    assert twice == [], f"ticks fired more than once: {twice[:10]}"
    # Every fired run ran (a run killed before its checkpoint runs its input again, under
    # another task id: at least once, so the ticks the runs counted are a set).
    ran = {(row.schedule_id, row.tick) for row in counted}
    assert ran == set(submitted), sorted(ran ^ set(submitted))[:10]
    assert statuses == {"done": SCHEDULES}, statuses
    ticks: dict[str, list[float]] = defaultdict(list)
    for schedule_id, tick in ran:
        ticks[schedule_id].append(datetime.fromisoformat(tick).timestamp())
    for sid, schedule in schedules.items():
        fired = sorted(ticks[sid])
        assert schedule.skipped == 0, (sid, schedule)
        assert schedule.fired == len(fired), (sid, schedule.fired, len(fired))
        # None lost: every second from the first tick to the last fired one.
        assert fired == [fired[0] + n for n in range(len(fired))], sid
        assert schedule.last_tick == fired[-1], sid
        assert len(fired) >= SECONDS - 10, (sid, len(fired))  # it ticked all along
    print(
        f"{len(submitted)} ticks of {SCHEDULES} schedules over {SECONDS:.0f}s, each once; "
        f"database down {down:.1f}s"
    )

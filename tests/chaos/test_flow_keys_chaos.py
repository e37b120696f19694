"""Flow keys across worker processes (issue 37): three ``langgraph-fence worker`` processes
take 50 runs of a key limited to 2 running, sampled from the database every 10 ms: never
more than 2 running at once; then 30 runs of a key limited to 5 starts a second: no window
of one second holds more than 5 starts (the starts as the database recorded them).

On real PostgreSQL (a schema of the test's own)."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest
from sqlalchemy import text

from langgraph_fence import LeaseStatus
from langgraph_fence.instance import Instance
from langgraph_fence.queue import Flow
from tests.support.databases import pg_engine_options, unique
from tests.support.processes import MARK_DIR_ENV, start_worker, stop_process

pytestmark = [pytest.mark.chaos, pytest.mark.postgres]

GRAPHS = "tests.support.sleep_graphs:graphs"
DEADLINE = 120.0
_RUNNING = text(
    "SELECT count(*) FROM fence_runs r JOIN fence_leases l ON l.tenant_id = r.tenant_id AND "
    "l.execution_id = r.execution_id WHERE r.flow_key = :k AND r.status = 'current' AND "
    "l.status = 'running'"
)
_STARTS = text(
    "SELECT e.started_at FROM fence_runs r JOIN fence_executions e ON e.tenant_id = "
    "r.tenant_id AND e.execution_id = r.execution_id WHERE r.flow_key = :k"
)


async def test_three_workers_keep_a_keys_concurrency_and_rate(
    own_schema: tuple[str, str], tmp_path: Path
) -> None:
    url, schema = own_schema
    env = {MARK_DIR_ENV: str(tmp_path)}
    extra = ["--concurrency", "10"]
    workers = [
        await start_worker(
            tmp_path, f"w{n}", url, schema, GRAPHS, ttl=5.0, poll=0.05, extra=extra, env=env
        )
        for n in range(3)
    ]
    try:
        async with Instance.open(url, engine_options=pg_engine_options(schema)) as client:
            engine = client._run_queue()._engine

            async def submit(seconds: float, flow: Flow) -> object:
                config = {"configurable": {"thread_id": unique("run")}}
                return await client.submit(
                    "busy", {"seconds": seconds}, config, tenant_id="t", flow=flow
                )

            limited = [await submit(0.1, Flow("limited", max_running=2)) for _ in range(50)]
            samples: list[int] = []

            async def sample() -> None:
                async with engine.connect() as conn:
                    while True:
                        found = await conn.execute(_RUNNING, {"k": "limited"})
                        samples.append(int(found.scalar_one()))
                        await asyncio.sleep(0.01)  # the sampling period

            sampler = asyncio.create_task(sample())
            try:
                for run in limited:
                    await run.result(timeout=DEADLINE)  # type: ignore[attr-defined]
            finally:
                sampler.cancel()
            assert max(samples) == 2, f"max running {max(samples)} over {len(samples)} samples"

            rated = [await submit(0.05, Flow("rated", max_starts=5, per=1.0)) for _ in range(30)]
            for run in rated:
                await run.result(timeout=DEADLINE)  # type: ignore[attr-defined]
            async with engine.connect() as conn:
                starts = sorted(float(r[0]) for r in await conn.execute(_STARTS, {"k": "rated"}))
            for run in [*limited, *rated]:
                state = await run.state()  # type: ignore[attr-defined]
                assert state.status is LeaseStatus.DONE
    finally:
        for worker in workers:
            await stop_process(worker, grace=20)
    assert len(starts) == 30
    busiest = max(sum(1 for t in starts if s <= t < s + 1.0) for s in starts)
    assert busiest <= 5, f"{busiest} starts in one second: {starts}"
    assert starts[-1] - starts[0] >= 5.0  # 30 starts at 5 a second take 5 s at least
    assert len(samples) > 100

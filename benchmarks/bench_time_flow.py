"""What schedules, flow keys and callbacks add to every worker's look, and what firing
ticks costs.

    python benchmarks/bench_time_flow.py [--finished 100000] [--schedules 100]
        [--waiting 10000]

On the shared PostgreSQL (a schema of its own, dropped at the end), beside ``--finished``
finished submitted runs (their ``fence_runs`` and ``fence_leases`` rows):

* ``fire_due``, ``flows.admit`` and ``callbacks.due`` with nothing due and nothing held
  back: what each look of every ``serve()`` pays for the three features, used or not
  (median and p99 of 200); ``callbacks.due`` again beside ``--waiting`` running runs each
  with a webhook held until its end, and the sweep each worker makes every 10 s of the
  callbacks of runs that ended without their worker saying so;
* ``fire``: ``--schedules`` schedules due at once, fired in one look (one transaction each:
  the row locked, the tick's run submitted, the schedule moved on), per tick.
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import sys
import time
import uuid
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from sqlalchemy import text

from langgraph_fence import Instance
from langgraph_fence.database import schema_options
from tests.support.databases import pg_admin

URL = "postgresql://postgres@127.0.0.1:5432/test"
_RUNS = text(
    "INSERT INTO fence_runs (run_id, tenant_id, execution_id, seq, status, graph, thread_id, "
    "input_type, input, run_type, run, submitted_at) SELECT md5(g::text), 't', 'e' || g, 1, "
    "'current', 'g', 'e' || g, 'msgpack', '\\x00', 'msgpack', '\\x00', 0 "
    "FROM generate_series(1, :n) g"
)
_LEASES = text(
    "INSERT INTO fence_leases (tenant_id, execution_id, scope_key, epoch, holder, expires_at, "
    "status, pending_effects, updated_at) SELECT 't', 'e' || g, 't:e' || g, 1, NULL, NULL, "
    "'done', '{}', 0 FROM generate_series(1, :n) g"
)


_WAITING_RUNS = text(
    "INSERT INTO fence_runs (run_id, tenant_id, execution_id, seq, status, graph, thread_id, "
    "input_type, input, run_type, run, submitted_at) SELECT md5('w' || g::text), 't', "
    "'w' || g, 1, 'current', 'g', 'w' || g, 'msgpack', '\\x00', 'msgpack', '\\x00', 0 "
    "FROM generate_series(1, :n) g"
)
_WAITING_LEASES = text(
    "INSERT INTO fence_leases (tenant_id, execution_id, scope_key, epoch, holder, expires_at, "
    "status, pending_effects, updated_at) SELECT 't', 'w' || g, 't:w' || g, 1, 'worker', 1e12, "
    "'running', '{}', 0 FROM generate_series(1, :n) g"
)
_WAITING_CALLBACKS = text(
    "INSERT INTO fence_callbacks (run_id, target, tenant_id, execution_id, status, attempts, "
    "due) SELECT md5('w' || g::text), 'webhook:https://example.com/h', 't', 'w' || g, "
    "'pending', 0, 1e15 FROM generate_series(1, :n) g"
)


async def _time_looks(looks: list[tuple[str, Any]]) -> None:
    for name, look in looks:
        for _ in range(20):
            await look()
        took = []
        for _ in range(200):
            began = time.perf_counter()
            await look()
            took.append(time.perf_counter() - began)
        took.sort()
        print(f"| {name} | {statistics.median(took) * 1e3:.2f} | {took[197] * 1e3:.2f} |")


async def main(finished: int, schedules: int, waiting: int) -> None:
    schema = "lgf_bench_" + uuid.uuid4().hex[:8]
    pg_admin(URL, f'CREATE SCHEMA "{schema}"')
    try:
        async with Instance.open(URL, engine_options=schema_options(schema)) as instance:
            queue = instance._run_queue()
            engine = queue._engine
            async with engine.begin() as conn:
                await conn.execute(_RUNS, {"n": finished})
                await conn.execute(_LEASES, {"n": finished})
                await conn.execute(text("ANALYZE"))
            print(f"| each look ({finished} finished runs) | median (ms) | p99 (ms) |")
            print("|---|--:|--:|")

            async def due() -> None:
                await queue.callbacks.due([], 8)

            looks = [
                ("fire_due", queue.schedules.fire_due),
                ("flows.admit", queue.flows.admit),
                ("callbacks.due", due),
            ]
            await _time_looks(looks)
            async with engine.begin() as conn:
                await conn.execute(_WAITING_RUNS, {"n": waiting})
                await conn.execute(_WAITING_LEASES, {"n": waiting})
                await conn.execute(_WAITING_CALLBACKS, {"n": waiting})
                await conn.execute(text("ANALYZE"))
            await _time_looks(
                [
                    (f"callbacks.due, {waiting} running runs with a webhook", due),
                    (f"callbacks.sweep (every 10 s), {waiting} of them", queue.callbacks.sweep),
                ]
            )
            for n in range(schedules):
                await instance.schedules.create(
                    f"s{n}", "g", {"n": n}, {"configurable": {"thread_id": f"s{n}"}},
                    tenant_id="t", cron="0 0 1 1 *", grace=1e8,
                )  # fmt: skip
            async with engine.begin() as conn:
                await conn.execute(text("UPDATE fence_schedules SET next_tick = next_tick - 4e7"))
            began = time.perf_counter()
            fired = await queue.schedules.fire_due(limit=schedules)
            spent = time.perf_counter() - began
            print(
                f"\nfired {fired} ticks of {schedules} schedules in one look: "
                f"{spent * 1e3 / max(fired, 1):.2f} ms a tick"
            )
    finally:
        pg_admin(URL, f'DROP SCHEMA "{schema}" CASCADE')


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--finished", type=int, default=100_000)
    parser.add_argument("--schedules", type=int, default=100)
    parser.add_argument("--waiting", type=int, default=10_000)
    options = parser.parse_args()
    asyncio.run(main(options.finished, options.schedules, options.waiting))

"""What one worker's look pays to read its window of takeover candidates, by queue shape.

    python benchmarks/bench_window.py [--reads 200] [--limit 32]

On the shared PostgreSQL (a schema of its own per shape, dropped at the end), each shape's
rows are inserted and analysed, then ``takeover_candidates(limit)`` is read ``--reads``
times after 20 warm-up reads, through the lease store (so the figure includes its Python
and the decoding of the window's rows): the mean per read. Shapes: runs queued (pending,
no holder) for one tenant or spread over many, runs held by a live lease (not due), runs a
flow key holds back (not due), and mixes of them. To compare two trees, run a copy of it
from each checkout's ``benchmarks/`` (it imports the checkout it is in).
"""

from __future__ import annotations

import argparse
import asyncio
import sys
import time
import uuid
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from sqlalchemy import text

from langgraph_fence import SqlLeaseRepository
from langgraph_fence.database import create_engine, schema_options
from langgraph_fence.lease.schema import HELD_BACK
from tests.support.databases import pg_admin

URL = "postgresql://postgres@127.0.0.1:5432/test"
_QUEUED = text(
    "INSERT INTO fence_leases (tenant_id, execution_id, scope_key, epoch, status, "
    "pending_effects, updated_at) SELECT 'q' || (g % :tenants), 'e' || g, 'e' || g, 0, "
    "'pending', '{}', extract(epoch FROM now()) - :n + g * 1e-3 FROM generate_series(1, :n) g"
)
_HELD = text(
    "INSERT INTO fence_leases (tenant_id, execution_id, scope_key, epoch, holder, expires_at, "
    "status, pending_effects, updated_at) SELECT 'h' || (g % :tenants), 'r' || g, 'r' || g, 1, "
    "'worker', extract(epoch FROM now()) + 300, 'running', '{}', extract(epoch FROM now()) "
    "FROM generate_series(1, :n) g"
)
_HELD_BACK = text(
    "INSERT INTO fence_leases (tenant_id, execution_id, scope_key, epoch, status, expires_at, "
    "pending_effects, updated_at) SELECT 'b', 'b' || g, 'b' || g, 0, 'pending', :held_back, "
    "'{}', extract(epoch FROM now()) FROM generate_series(1, :n) g"
)
#: (queued runs, their tenants, held runs, their tenants, runs a flow key holds back)
SHAPES = [
    (100, 1, 0, 1, 0),
    (3_000, 1, 300, 1, 0),
    (3_000, 300, 300, 300, 0),
    (30_000, 1, 0, 1, 0),
    (0, 1, 10_000, 10_000, 0),
    (800, 40, 0, 1, 25_000),
]


async def one(shape: tuple[int, int, int, int, int], reads: int, limit: int) -> float:
    queued, queued_tenants, held, held_tenants, held_back = shape
    schema = f"bench_window_{uuid.uuid4().hex[:8]}"
    pg_admin(URL, f'CREATE SCHEMA "{schema}"')
    engine = create_engine(URL, **schema_options(schema))
    try:
        store = SqlLeaseRepository(engine)
        await store.setup()
        async with engine.begin() as conn:
            if queued:
                await conn.execute(_QUEUED, {"n": queued, "tenants": queued_tenants})
            if held:
                await conn.execute(_HELD, {"n": held, "tenants": held_tenants})
            if held_back:
                await conn.execute(_HELD_BACK, {"n": held_back, "held_back": HELD_BACK})
            await conn.execute(text("ANALYZE fence_leases"))
        for _ in range(20):
            await store.takeover_candidates(limit)
        started = time.perf_counter()
        for _ in range(reads):
            await store.takeover_candidates(limit)
        return (time.perf_counter() - started) / reads
    finally:
        await engine.dispose()
        pg_admin(URL, f'DROP SCHEMA IF EXISTS "{schema}" CASCADE')


async def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--reads", type=int, default=200)
    parser.add_argument("--limit", type=int, default=32)
    args = parser.parse_args()
    print("| queued (tenants) | held (tenants) | held back | ms per read |")
    print("|---|---|--:|--:|")
    for shape in SHAPES:
        seconds = await one(shape, args.reads, args.limit)
        queued, held = f"{shape[0]:,} ({shape[1]:,})", f"{shape[2]:,} ({shape[3]:,})"
        print(f"| {queued} | {held} | {shape[4]:,} | {seconds * 1e3:.2f} |")


if __name__ == "__main__":
    asyncio.run(main())

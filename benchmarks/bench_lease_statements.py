"""Median latency of each lease statement on PostgreSQL, in a schema of its own.

    python benchmarks/bench_lease_statements.py [--db URL] [--keys 1500]

Measured, not asserted. For each of ``--keys`` executions: acquire, renew, stamp (an
idempotent entry, with the renewal), release as pending, take over (with the takeover
budget's arguments when the code has them), each one ``SqlLeaseRepository`` call, timed
around the await. Prints the median of each (the first 50 keys are warm-up). To compare
two versions, run it alternately with ``PYTHONPATH`` at each checkout.
"""

from __future__ import annotations

import argparse
import asyncio
import inspect
import statistics
import time
import uuid
from collections.abc import Awaitable
from typing import Any, TypeVar

import asyncpg

from langgraph_fence import (
    Effect,
    LeaseKey,
    LeaseStatus,
    PendingEffect,
    SqlLeaseRepository,
)
from langgraph_fence.database import create_engine

T = TypeVar("T")
DEFAULT_URL = "postgresql://postgres@127.0.0.1:5432/test"
OPS = ("acquire", "renew", "stamp", "release", "take_over")


async def bench(url: str, keys: int) -> dict[str, float]:
    schema = f"lgf_bench_{uuid.uuid4().hex[:8]}"
    admin = await asyncpg.connect(url)
    await admin.execute(f'CREATE SCHEMA "{schema}"')
    try:
        engine = create_engine(url, connect_args={"server_settings": {"search_path": schema}})
        repo = SqlLeaseRepository(engine)
        await repo.setup()
        budget: dict[str, Any] = {}
        if "max_takeovers" in inspect.signature(repo.take_over).parameters:
            budget = {"progress_mark": "checkpoint-1", "max_takeovers": 3}
        times: dict[str, list[float]] = {op: [] for op in OPS}

        async def timed(op: str, call: Awaitable[T]) -> T:
            began = time.perf_counter()
            result = await call
            times[op].append(time.perf_counter() - began)
            return result

        for i in range(keys):
            lease = await timed("acquire", repo.acquire(LeaseKey("bench", f"e{i}"), "A", 30.0))
            assert lease is not None
            lease = await timed("renew", repo.renew(lease, 30.0))
            entry = PendingEffect(Effect.IDEMPOTENT_WRITE, "n", "task-1", lease.epoch)
            lease = await timed("stamp", repo.mark_pending_effect(lease, entry, 30.0))
            lease = await timed("release", repo.release(lease, LeaseStatus.PENDING))
            await timed("take_over", repo.take_over(lease, "B", 30.0, **budget))
        await engine.dispose()
        return {op: statistics.median(samples[50:]) * 1e6 for op, samples in times.items()}
    finally:
        await admin.execute(f'DROP SCHEMA "{schema}" CASCADE')
        await admin.close()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--db", default=DEFAULT_URL, help="a PostgreSQL URL")
    parser.add_argument("--keys", type=int, default=1500)
    args = parser.parse_args()
    medians = asyncio.run(bench(args.db.replace("+asyncpg", ""), args.keys))
    print("  ".join(f"{op} {medians[op]:.0f} us" for op in OPS))


if __name__ == "__main__":
    main()

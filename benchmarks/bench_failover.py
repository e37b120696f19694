"""What a failover's quarantine holds a worker, and what synchronous replication costs a take.

    python benchmarks/bench_failover.py [--in-flight 100,1000,10000] [--finished 50000]

Each cell builds a primary and a streaming standby of its own on loopback
(``tests/support/pg_replica.py``: ``initdb``, ``pg_basebackup -R``), fills ``fence_leases``
with ``--in-flight`` executions in flight (running, pending) beside ``--finished`` done
ones, lets the standby catch up, kills the primary and promotes the standby. Then a worker
connects through the multi-host URL and takes a new execution:

* ``held``: from the take's call to its lease, on the promoted server: the refused take,
  the check, the classification (one statement: the ledger and every dead letter), and the
  take again. What the quarantine holds a worker (under ``"trust"`` a take waits for
  nothing), beside
* ``take``: the next take, the failover settled (the same statement, nothing to classify);
* ``classify``: the classification alone, its check and its statement
  (``FailoverReport.seconds``; under ``"trust"`` the watch's, which moves the ledger on).

``"trust"`` is the same failover, classifying nothing. The last table: a take and its
release, median of 200, on the asynchronous pair and on a synchronous one (every commit
waits for the standby's flush), no failover.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from sqlalchemy import text

from langgraph_fence import LeaseKey, LeaseStatus, SqlLeaseRepository
from langgraph_fence.database import create_engine
from tests.support.pg_cluster import find_bindir
from tests.support.pg_replica import ReplicatedPair

_FILL = text(
    "INSERT INTO fence_leases (tenant_id, execution_id, scope_key, epoch, holder, expires_at, "
    "status, pending_effects, updated_at) SELECT 'bench', :prefix || g, 'bench:' || :prefix "
    "|| g, 1, CASE WHEN :status = 'running' THEN 'w' END, CASE WHEN :status = 'running' "
    "THEN extract(epoch FROM now()) + 600 END, :status, '{}', extract(epoch FROM now()) "
    "FROM generate_series(1, :n) AS g"
)


async def fill(url: str, in_flight: int, finished: int) -> None:
    engine = create_engine(url)
    try:
        await SqlLeaseRepository(engine).setup()
        async with engine.connect() as conn:
            for prefix, status, n in (
                ("run-", "running", in_flight - in_flight // 4),
                ("pend-", "pending", in_flight // 4),
                ("done-", "done", finished),
            ):
                if n:
                    await conn.execute(_FILL, {"prefix": prefix, "status": status, "n": n})
    finally:
        await engine.dispose()


async def one_failover(bindir: Path, in_flight: int, finished: int, mode: str) -> tuple[float, ...]:
    pair = await asyncio.to_thread(ReplicatedPair.create, bindir)
    try:
        await fill(pair.url, in_flight, finished)
        await asyncio.to_thread(pair.caught_up)
        await asyncio.to_thread(pair.fail_over)
        engine = create_engine(pair.url)
        store = SqlLeaseRepository(engine, on_failover=mode)  # type: ignore[arg-type]
        try:
            await store.now()  # the connection made, not timed
            began = time.perf_counter()
            first = await store.acquire(LeaseKey("bench", "after-1"), "bench", 60.0)
            held = time.perf_counter() - began
            began = time.perf_counter()
            second = await store.acquire(LeaseKey("bench", "after-2"), "bench", 60.0)
            take = time.perf_counter() - began
            assert first is not None
            assert second is not None
            if mode == "trust":
                # Nothing waits for it: the instance's watch moves the ledger on.
                assert not store.failovers
                assert await store.settle_failover() is not None
            [report] = store.failovers
            expected = in_flight if mode == "quarantine" else 0
            assert len(report.quarantined) == expected, (len(report.quarantined), expected)
            return held, take, report.seconds
        finally:
            await store.aclose()
            await engine.dispose()
    finally:
        await asyncio.to_thread(pair.remove)


async def takes(bindir: Path, *, synchronous: bool, n: int = 200) -> float:
    pair = await asyncio.to_thread(ReplicatedPair.create, bindir, synchronous=synchronous)
    try:
        engine = create_engine(pair.url)
        store = SqlLeaseRepository(engine)
        await store.setup()
        times = []
        try:
            for i in range(n + 20):
                began = time.perf_counter()
                lease = await store.acquire(LeaseKey("bench", f"k{i}"), "bench", 60.0)
                assert lease is not None
                await store.release(lease, LeaseStatus.DONE)
                if i >= 20:
                    times.append(time.perf_counter() - began)
        finally:
            await store.aclose()
            await engine.dispose()
        return statistics.median(times)
    finally:
        await asyncio.to_thread(pair.remove)


async def main() -> None:
    logging.getLogger("langgraph_fence").setLevel(logging.ERROR)  # the failover's warning
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--in-flight", default="100,1000,10000")
    parser.add_argument("--finished", type=int, default=50_000)
    args = parser.parse_args()
    bindir = find_bindir()
    if bindir is None:
        raise SystemExit("needs the PostgreSQL server binaries under /usr/lib/postgresql/*/bin")
    print(f"{args.finished} finished executions beside the ones in flight")
    print("| on_failover | in flight | held (ms) | take after (ms) | classify (ms) |")
    print("|---|--:|--:|--:|--:|")
    for in_flight in (int(n) for n in args.in_flight.split(",")):
        for mode in ("quarantine", "trust"):
            held, take, classify = await one_failover(bindir, in_flight, args.finished, mode)
            print(
                f"| {mode} | {in_flight} | {held * 1000:.1f} | {take * 1000:.1f} | "
                f"{classify * 1000:.1f} |",
                flush=True,
            )
    print()
    print("| replication | take + release, median of 200 (ms) |")
    print("|---|--:|")
    for synchronous in (False, True):
        median = await takes(bindir, synchronous=synchronous)
        name = "synchronous" if synchronous else "asynchronous"
        print(f"| {name} | {median * 1000:.2f} |", flush=True)


if __name__ == "__main__":
    asyncio.run(main())

"""The console's pages with 100 000 executions in the database (issue 36: under 200 ms).

Fills a fresh database (a PostgreSQL schema of its own, or a SQLite file) with N executions
(leases and records) across tenants, graphs, statuses and holders, a journal of three
entries each, and one thread's checkpoints; then requests every page (and ``/metrics``)
in process through the ASGI app, rotating the order, and reports each page's median and
95th percentile, and the same with the database empty, side by side.

    python benchmarks/bench_console.py --executions 100000 --rounds 30 \
        [--pg postgresql://postgres@127.0.0.1:5432/test] [--sqlite]

Not a test: figures for benchmarks/README.md.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import random
import statistics
import sys
import tempfile
import time
import uuid
from pathlib import Path
from typing import Any
from urllib.parse import quote

import httpx
from sqlalchemy import insert, text
from sqlalchemy.ext.asyncio import AsyncEngine

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from langgraph_fence.checkpointers import SqlCheckpointer
from langgraph_fence.console import create_app
from langgraph_fence.database import create_engine
from langgraph_fence.lease.journal import JOURNAL
from langgraph_fence.lease.records import SqlExecutionRecords
from langgraph_fence.lease.schema import LEASES
from langgraph_fence.lease.scope import scope_key
from langgraph_fence.lease.sql import SqlLeaseRepository

STATUSES = (
    ["done"] * 90
    + ["running"] * 4
    + ["pending"] * 2
    + ["failed"] * 2
    + [
        "dead_lettered",
        "waiting",
    ]
)
GRAPHS = ["orders", "support", "billing", "triage"]
TENANTS = [f"tenant-{n}" for n in range(20)]
HOLDERS = [f"worker-{n}" for n in range(8)]
STAMP = {"t1": {"effect": "non_idempotent_write", "node": "charge", "task_id": "t1", "token": 1}}


async def fill(engine: AsyncEngine, n: int) -> str:
    """N executions; returns the scope key of one with a timeline to show."""
    await SqlLeaseRepository(engine).setup()
    await SqlCheckpointer(engine).setup()
    await SqlExecutionRecords(engine).setup()
    rng = random.Random(7)
    now = time.time()
    batch = 5_000
    shown = ""
    for start in range(0, n, batch):
        leases, records, journal = [], [], []
        for i in range(start, min(start + batch, n)):
            tenant, execution = TENANTS[i % len(TENANTS)], f"thread-{i:07d}"
            status = rng.choice(STATUSES)
            held = status == "running"
            leases.append(
                {
                    "tenant_id": tenant,
                    "execution_id": execution,
                    "scope_key": scope_key(tenant, execution),
                    "epoch": 2,
                    "holder": rng.choice(HOLDERS) if held or status == "waiting" else None,
                    "expires_at": now + 30 if held else None,
                    "status": status,
                    "pending_effects": STAMP if status == "dead_lettered" else {},
                    "reason": "crashed" if status in ("failed", "dead_lettered") else None,
                    "updated_at": now - (n - i),
                    "takeovers": 0,
                }
            )
            records.append(
                {
                    "tenant_id": tenant,
                    "execution_id": execution,
                    "graph": GRAPHS[i % len(GRAPHS)],
                    "thread_id": execution,
                    "input_type": "json",
                    "input": b'{"n": 1}',
                    "recorded_at": now - (n - i),
                    "submitted_at": now - (n - i) if status == "pending" else None,
                }
            )
            for kind, epoch in (("acquired", 1), ("taken_over", 2), ("fenced", 1)):
                journal.append(
                    {
                        "tenant_id": tenant,
                        "execution_id": execution,
                        "at": now - (n - i),
                        "kind": kind,
                        "epoch": epoch,
                        "holder": HOLDERS[epoch],
                        "detail": None,
                        "actor": None,
                    }
                )
            shown = scope_key(tenant, execution)
        async with engine.begin() as conn:
            await conn.execute(insert(LEASES), leases)
            await conn.execute(
                text(
                    "INSERT INTO fence_executions (tenant_id, execution_id, graph, thread_id, "
                    "input_type, input, recorded_at, submitted_at) VALUES (:tenant_id, "
                    ":execution_id, :graph, :thread_id, :input_type, :input, :recorded_at, "
                    ":submitted_at)"
                ),
                records,
            )
            await conn.execute(insert(JOURNAL), journal)
    async with engine.begin() as conn:
        await conn.execute(text("ANALYZE"))
    return shown


def pages(shown: str) -> dict[str, str]:
    return {
        "executions": "/executions",
        "executions, page 2": "",  # filled from page 1's next link
        "running": "/executions?status=running",
        "dead letters": "/dead-letters",
        "one graph": "/executions?graph=billing",
        "one tenant": "/executions?tenant=tenant-3",
        "one holder's running": "/executions?status=running&holder=worker-2",
        "one holder, any status": "/executions?holder=worker-2",
        "one execution": "/executions/" + quote(shown, safe=""),
        "queue": "/queue",
        "instances": "/instances",
        "/metrics": "/metrics",
    }


async def measure(engine: AsyncEngine, shown: str, rounds: int) -> dict[str, list[float]]:
    app = create_app(engine, metrics_max_age=0)  # /metrics read afresh at every request
    times: dict[str, list[float]] = {}
    async with httpx.AsyncClient(
        transport=httpx.ASGITransport(app=app), base_url="http://console"
    ) as http:
        first = await http.get("/executions")
        following = first.text.split('rel="next" href="', 1)
        wanted = pages(shown)
        wanted["executions, page 2"] = (
            following[1].split('"', 1)[0].replace("&amp;", "&") if len(following) > 1 else ""
        )
        wanted = {k: v for k, v in wanted.items() if v}
        for path in wanted.values():  # warm: connections, statement caches
            assert (await http.get(path)).status_code == 200, path
        names = list(wanted)
        for r in range(rounds):
            for name in names[r % len(names) :] + names[: r % len(names)]:
                began = time.perf_counter()
                answer = await http.get(wanted[name])
                times.setdefault(name, []).append(time.perf_counter() - began)
                assert answer.status_code == 200, (name, answer.status_code)
    return times


def figure(values: list[float] | None) -> str:
    """``median / p95`` in milliseconds, or nothing."""
    if values is None:
        return ""
    return f"{statistics.median(values) * 1e3:.1f} / {p95(values) * 1e3:.1f}"


def p95(values: list[float]) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(0.95 * len(ordered)))]


async def one(label: str, url_for: Any, schema: str | None, n: int, rounds: int) -> None:
    results = {}
    for size in (0, n):
        url = url_for(size)
        engine = create_engine(url, schema=schema) if schema else create_engine(url)
        try:
            if schema:
                async with engine.begin() as conn:
                    await conn.execute(text(f'DROP SCHEMA IF EXISTS "{schema}" CASCADE'))
                    await conn.execute(text(f'CREATE SCHEMA "{schema}"'))
            began = time.perf_counter()
            shown = await fill(engine, size) if size else await fill(engine, 1)
            filled = time.perf_counter() - began
            results[size] = await measure(engine, shown, rounds)
            print(f"{label}: {size} executions filled in {filled:.1f} s", file=sys.stderr)
        finally:
            if schema:
                async with engine.begin() as conn:
                    await conn.execute(text(f'DROP SCHEMA IF EXISTS "{schema}" CASCADE'))
            await engine.dispose()
    print(f"\n{label}: ms per request, median / p95 ({rounds} rounds, rotating order)\n")
    print(f"| page | 1 execution | {n:,} executions |")
    print("|---|--:|--:|")
    for name in results[n]:
        empty, full = results[0].get(name), results[n][name]
        left = (
            ""
            if empty is None
            else f"{statistics.median(empty) * 1e3:.1f} / {p95(empty) * 1e3:.1f}"
        )
        print(f"| {name} | {left} | {statistics.median(full) * 1e3:.1f} / {p95(full) * 1e3:.1f} |")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--executions", type=int, default=100_000)
    parser.add_argument("--rounds", type=int, default=30)
    parser.add_argument("--pg", default=os.environ.get("LANGGRAPH_FENCE_PG_URL"))
    parser.add_argument("--sqlite", action="store_true", help="also on a SQLite file")
    args = parser.parse_args()
    if args.pg:
        url = args.pg.replace("postgresql://", "postgresql+asyncpg://", 1)
        schema = f"bench_console_{uuid.uuid4().hex[:8]}"
        asyncio.run(one("PostgreSQL", lambda _: url, schema, args.executions, args.rounds))
    if args.sqlite or not args.pg:
        with tempfile.TemporaryDirectory() as folder:

            def sqlite_url(size: int) -> str:
                return f"sqlite+aiosqlite:///{folder}/console-{size}.db"

            asyncio.run(one("SQLite", sqlite_url, None, args.executions, args.rounds))


if __name__ == "__main__":
    main()

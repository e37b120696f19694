"""Takeover latency: from a worker's SIGKILL to the first node of the resumed run elsewhere.

    python benchmarks/bench_takeover.py [--db URL] [--ttls 1 5 30] [--reps 3]
                                        [--poll-interval 0.25]

Measured, not asserted. On PostgreSQL (``--db``, default ``$LANGGRAPH_FENCE_PG_URL`` or
``postgresql://postgres@127.0.0.1:5432/test``), in a schema of its own dropped at the end:

* worker B is the product's ``langgraph-fence worker`` (``serve()``), polling every
  ``--poll-interval`` seconds, serving ``fence_hold`` (start -> work -> end, from
  ``tests/support/chaos_graphs.py``); it writes when it enters ``work``;
* for each TTL and repetition, worker A (``chaos_graphs.py hold``, its own process) starts
  an execution through ``Instance.ainvoke`` with that lease TTL (renewed every TTL / 3) and
  stops inside ``work``; after a random part of one renew interval the benchmark reads how
  long A's lease has left on PostgreSQL's clock and SIGKILLs A;
* the latency is from the SIGKILL to the moment B enters ``work`` of the resumed run
  (``time.monotonic()``: one clock for every process of the machine).

Target: at most TTL + one poll interval. The lease left at the kill (between 2/3 TTL and
TTL, by where the kill falls between renewals) is a floor no worker can beat; the rest is
detection (the poll) and resuming (the take, the checkpoint read, the step's stamp).
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
from dataclasses import dataclass
from functools import partial
from pathlib import Path

from rich.console import Console
from rich.table import Table
from sqlalchemy import text

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from langgraph_fence.database import create_engine  # noqa: E402
from tests.support.chaos_graphs import spawn_hold  # noqa: E402
from tests.support.databases import setup_all  # noqa: E402
from tests.support.processes import (  # noqa: E402
    MARK_DIR_ENV,
    Started,
    read_json,
    start_worker,
    stop_process,
    wait_ready,
)

DEFAULT_URL = "postgresql://postgres@127.0.0.1:5432/test"


@dataclass(frozen=True, slots=True)
class Sample:
    ttl: float
    rep: int
    lease_left: float
    latency: float
    token: int


async def measure(
    url: str, ttls: list[float], reps: int, poll: float, console: Console
) -> list[Sample]:
    schema = f"lgf_bench_{uuid.uuid4().hex[:10]}"
    admin = create_engine(url)
    async with admin.connect() as conn:
        await conn.execute(text(f'CREATE SCHEMA "{schema}"'))
    engine = create_engine(url, connect_args={"server_settings": {"search_path": schema}})
    samples: list[Sample] = []
    procs: list[Started] = []
    try:
        await setup_all(engine)
        with tempfile.TemporaryDirectory(prefix="lgf-bench-") as tmp:
            work = Path(tmp)
            marks = work / "marks"
            marks.mkdir()
            worker_b = await start_worker(
                work,
                "b",
                url,
                schema,
                "tests.support.chaos_graphs:hold_graphs",
                ttl=30,
                poll=poll,
                instance_id="worker-B",
                env={MARK_DIR_ENV: str(marks)},
                merge_output=True,
                wait=False,
            )
            procs.append(worker_b)
            await wait_ready(worker_b, "serves", timeout=60, what="worker B to serve")
            tenant = f"bench-{uuid.uuid4().hex[:8]}"
            for ttl in ttls:
                for rep in range(reps):
                    thread = f"ttl{ttl:g}-rep{rep}"
                    signal_file = work / f"{thread}.inside"
                    worker_a = await spawn_hold(
                        url, schema, tenant, thread, ttl, ttl / 3, signal_file, work, f"{thread}.a"
                    )
                    procs.append(worker_a)
                    await wait_ready(
                        worker_a,
                        partial(read_json, signal_file),
                        timeout=60,
                        interval=0.005,
                        what=f"A to enter work ({thread})",
                    )
                    # Kill at a random point between two renewals, as a crash would.
                    waited = random.uniform(0, ttl / 3)
                    await asyncio.sleep(waited)
                    async with engine.connect() as conn:
                        left = float(
                            (
                                await conn.execute(
                                    text(
                                        "SELECT expires_at - extract(epoch FROM now())"
                                        " FROM fence_leases"
                                        " WHERE tenant_id = :t AND execution_id = :e"
                                    ),
                                    {"t": tenant, "e": thread},
                                )
                            ).scalar_one()
                        )
                    killed_at = time.monotonic()
                    worker_a.proc.kill()
                    await worker_a.wait()
                    mark_file = marks / f"{thread}.json"
                    mark = await wait_ready(
                        worker_b,
                        partial(read_json, mark_file),
                        deadline=killed_at + ttl + 60,
                        interval=0.005,
                        what=f"B to resume {thread}",
                    )
                    sample = Sample(ttl, rep, left, mark["at"] - killed_at, int(mark["token"]))
                    samples.append(sample)
                    console.print(
                        f"TTL {ttl:g} s rep {rep}: killed {waited:.2f} s into work, "
                        f"lease left {left:.3f} s, "
                        f"resumed after {sample.latency:.3f} s at token {sample.token}"
                    )
    finally:
        for proc in procs:
            await stop_process(proc, grace=10)
        await engine.dispose()
        async with admin.connect() as conn:
            await conn.execute(text(f'DROP SCHEMA IF EXISTS "{schema}" CASCADE'))
        await admin.dispose()
    return samples


def report(samples: list[Sample], poll: float, console: Console) -> None:
    table = Table(title=f"takeover latency: SIGKILL -> first node resumed (poll {poll:g} s)")
    for column in (
        "TTL s",
        "runs",
        "lease left at kill s",
        "latency min / median / max s",
        "after expiry max s",
        "target TTL+poll s",
        "within",
    ):
        table.add_column(column, justify="right")
    for ttl in sorted({s.ttl for s in samples}):
        mine = [s for s in samples if s.ttl == ttl]
        lat = [s.latency for s in mine]
        left = [s.lease_left for s in mine]
        target = ttl + poll
        table.add_row(
            f"{ttl:g}",
            str(len(mine)),
            f"{min(left):.2f} - {max(left):.2f}",
            f"{min(lat):.2f} / {statistics.median(lat):.2f} / {max(lat):.2f}",
            f"{max(s.latency - s.lease_left for s in mine):.3f}",
            f"{target:.2f}",
            "yes" if max(lat) <= target else "NO",
        )
    console.print(table)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--db", default=os.environ.get("LANGGRAPH_FENCE_PG_URL", DEFAULT_URL))
    parser.add_argument("--ttls", type=float, nargs="+", default=[1.0, 5.0, 30.0])
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--poll-interval", type=float, default=0.25)
    args = parser.parse_args()
    if args.reps < 1 or any(t <= 0 for t in args.ttls) or args.poll_interval <= 0:
        parser.error("--reps must be >= 1; TTLs and the poll interval must be > 0")
    console = Console(width=None if sys.stdout.isatty() else 120)
    samples = asyncio.run(measure(args.db, args.ttls, args.reps, args.poll_interval, console))
    report(samples, args.poll_interval, console)
    return 0


if __name__ == "__main__":
    sys.exit(main())

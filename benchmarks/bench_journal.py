"""What the journal costs a run: fenced runs with and without ``fence_journal``.

    python benchmarks/bench_journal.py [--runs 40] [--pg URL] [--only DB]

``fenced`` is ``bench_runs.py``'s (an ``Instance`` on ``SqlCheckpointer``, no journal);
``journaled`` the same with the journal ``Instance.open`` adds (a listener that writes each
turn of a lease, here one ``acquired`` per run, in the background through a pool of its
own). Linear 10 nodes and fan-out 8, durability sync and async, rotating order, medians,
side by side in one run; with the CPU time of this process per run.
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from bench_runs import SHAPES, Target, postgres_targets, sqlite_targets
from bench_savers import DEFAULT_PG, DURABILITIES, NODES_PER_RUN, WARM_UP

from langgraph_fence.instance import Instance
from langgraph_fence.lease.journal import Journal


async def compare(backend: str, engine: Any, targets: list[Target], runs: int) -> None:
    fenced = next(t for t in targets if t.name == "fenced")
    assert fenced.instance is not None
    plain = fenced.instance
    journaled_instance = Instance(
        plain.repository, plain.checkpointer, records=plain.records, lease_ttl=600
    )
    journal = Journal(engine, own_pool=True)
    journaled_instance.add_listener(journal)
    pair = [fenced, Target("journaled", fenced.saver, journaled_instance)]
    try:
        for shape in SHAPES:
            for durability in DURABILITIES:
                graphs = [t.graph(shape) for t in pair]
                wall: dict[str, list[float]] = {t.name: [] for t in pair}
                cpu: dict[str, list[float]] = {t.name: [] for t in pair}
                for i in range(runs + WARM_UP):
                    for k in (0, 1) if i % 2 == 0 else (1, 0):
                        began, cpu_began = time.perf_counter(), time.process_time()
                        await pair[k].run(graphs[k], durability)
                        if i >= WARM_UP:
                            wall[pair[k].name].append(time.perf_counter() - began)
                            cpu[pair[k].name].append(time.process_time() - cpu_began)
                rate = {n: NODES_PER_RUN / statistics.median(v) for n, v in wall.items()}
                ms = {n: 1000 * statistics.median(v) for n, v in cpu.items()}
                print(
                    f"| {backend} | {shape} | {durability} | {rate['fenced']:.0f} | "
                    f"{rate['journaled']:.0f} | {rate['journaled'] / rate['fenced']:.2f} | "
                    f"{ms['fenced']:.1f} / {ms['journaled']:.1f} |",
                    flush=True,
                )
    finally:
        await journal.aclose()


async def main() -> None:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--runs", type=int, default=40)
    parser.add_argument("--pg", default=DEFAULT_PG)
    parser.add_argument("--only", choices=["sqlite", "postgresql"])
    args = parser.parse_args()
    print("| backend | graph | durability | fenced (nodes/s) | journaled | ratio | CPU ms/run |")
    print("|---|---|---|--:|--:|--:|--:|")
    if args.only != "postgresql":
        with tempfile.TemporaryDirectory() as directory:
            async with sqlite_targets(Path(directory)) as (engine, targets):
                await compare("SQLite", engine, targets, args.runs)
    if args.only != "sqlite":
        async with postgres_targets(args.pg) as (engine, targets):
            await compare("PostgreSQL", engine, targets, args.runs)


if __name__ == "__main__":
    asyncio.run(main())

"""What recording a submitted run's stream costs the run, on SQLite and PostgreSQL.

    python benchmarks/bench_streams.py [--runs 60] [--pg URL] [--only sqlite|postgresql]

One ``serve()`` loop in this process (``Server.poll_once``, no wall clock between looks)
runs ``--runs`` submitted runs of a linear graph of 10 steps (each step a ``custom`` event
and an update), one at a time, in rotation: submitted without ``stream_mode``, with
``["updates"]``, and with ``["values", "updates", "custom"]``. Reported: each variant's
median time from the take to the run's end, and the ratio to the unrecorded one; then the
time to read a whole recorded stream from another instance (``astream`` after the end).
Measured, not asserted.
"""

from __future__ import annotations

import argparse
import asyncio
import operator
import statistics
import sys
import tempfile
import time
import uuid
from pathlib import Path
from typing import Annotated, Any, TypedDict

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from langgraph.config import get_stream_writer
from langgraph.graph import END, START, StateGraph

from langgraph_fence import Instance, fence_graph
from langgraph_fence.database import schema_options
from langgraph_fence.execution.serve import Server
from tests.support.databases import pg_admin

DEFAULT_PG = "postgresql://postgres@127.0.0.1:5432/test"
STEPS = 10
VARIANTS: dict[str, list[str] | None] = {
    "not recorded": None,
    "updates": ["updates"],
    "values, updates, custom": ["values", "updates", "custom"],
}


class State(TypedDict, total=False):
    log: Annotated[list[int], operator.add]


def linear(instance: Instance) -> Any:
    builder: StateGraph[Any] = StateGraph(State)

    def step(n: int) -> Any:
        async def node(state: State) -> dict[str, Any]:
            get_stream_writer()({"step": n})
            return {"log": [n]}

        return node

    for n in range(STEPS):
        builder.add_node(f"s{n}", step(n))
        builder.add_edge(START if n == 0 else f"s{n - 1}", f"s{n}")
    builder.add_edge(f"s{STEPS - 1}", END)
    return fence_graph(builder).compile(checkpointer=instance.checkpointer, name="linear")


async def measure(url: str, options: dict[str, Any], runs: int) -> None:
    async with (
        Instance.open(url, engine_options=options) as client,
        Instance.open(url, engine_options=options) as worker,
    ):
        loop = Server(
            worker.host,
            {"linear": linear(worker)},
            concurrency=1,
            poll_interval=1.0,
            max_takeovers=3,
            kwargs={},
        )
        took: dict[str, list[float]] = {name: [] for name in VARIANTS}
        recorded = None
        for n in range(runs):
            for name, modes in VARIANTS.items():
                config = {"configurable": {"thread_id": f"t-{uuid.uuid4().hex}"}}
                run = await client.submit(
                    "linear", {"log": []}, config, tenant_id="b", stream_mode=modes
                )
                began = time.perf_counter()
                await loop.poll_once()
                await asyncio.gather(*loop.running)
                if n:  # the first round warms up
                    took[name].append(time.perf_counter() - began)
                if modes is not None and len(modes) == 3:
                    recorded = run
        base = statistics.median(took["not recorded"])
        print("| stream_mode | median run (ms) | / not recorded |")
        print("|---|--:|--:|")
        for name, samples in took.items():
            median = statistics.median(samples)
            print(f"| {name} | {median * 1e3:.1f} | {base / median:.2f} |")
        assert recorded is not None
        handle = client.get_run(recorded.key.execution_id, tenant_id="b", run_id=recorded.run_id)
        began = time.perf_counter()
        events = [e async for e in handle.astream()]
        print(
            f"\nreading a whole recorded stream ({len(events)} events) from another "
            f"instance: {(time.perf_counter() - began) * 1e3:.1f} ms"
        )


async def main(args: argparse.Namespace) -> None:
    if args.only in (None, "sqlite"):
        with tempfile.TemporaryDirectory() as folder:
            print(f"\n## SQLite, {args.runs} runs of each\n")
            await measure(f"sqlite+aiosqlite:///{folder}/bench.db", {}, args.runs)
    if args.only in (None, "postgresql"):
        schema = "lgf_bench_" + uuid.uuid4().hex[:8]
        pg_admin(args.pg, f'CREATE SCHEMA "{schema}"')
        try:
            print(f"\n## PostgreSQL, {args.runs} runs of each\n")
            await measure(args.pg, schema_options(schema), args.runs)
        finally:
            pg_admin(args.pg, f'DROP SCHEMA "{schema}" CASCADE')


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=60)
    parser.add_argument("--pg", default=DEFAULT_PG)
    parser.add_argument("--only", choices=("sqlite", "postgresql"))
    asyncio.run(main(parser.parse_args()))

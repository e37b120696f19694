"""Plain ``graph.ainvoke`` against ``instance.ainvoke(graph, ...)``: the same run, two calls.

Issue 12: the LangGraph way must cost what the explicit form costs. One instance, one
three-node fenced graph (``durability="sync"``), each run on a thread of its own; the two
calls alternate run by run (side by side, the same load on both), after a warm-up of each.
Prints the median and the 90th percentile of each, and the ratio of the medians.

    python benchmarks/bench_plain_calls.py                       # SQLite file, 200 runs each
    python benchmarks/bench_plain_calls.py --pg postgresql://postgres@127.0.0.1:5432/test
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import tempfile
import time
import uuid
from pathlib import Path
from typing import Any, TypedDict

from langgraph.graph import END, START, StateGraph

from langgraph_fence import Instance, fence_graph


class State(TypedDict, total=False):
    n: int


async def step(state: State) -> State:
    return {"n": state.get("n", 0) + 1}


def graph_of(instance: Instance) -> Any:
    builder = StateGraph(State)
    for name in ("a", "b", "c"):
        builder.add_node(name, step)
    builder.add_edge(START, "a")
    builder.add_edge("a", "b")
    builder.add_edge("b", "c")
    builder.add_edge("c", END)
    return fence_graph(builder).compile(checkpointer=instance.checkpointer, name="bench")


async def bench(url: str, runs: int, engine_options: dict[str, Any]) -> None:
    async with Instance.open(url, engine_options=engine_options) as instance:
        graph = graph_of(instance)

        async def plain() -> None:
            config = {"configurable": {"thread_id": f"bench-{uuid.uuid4().hex}"}}
            await graph.ainvoke({"n": 0}, config, durability="sync")

        async def explicit() -> None:
            config = {"configurable": {"thread_id": f"bench-{uuid.uuid4().hex}"}}
            await instance.ainvoke(graph, {"n": 0}, config, tenant_id="default", durability="sync")

        calls = {"graph.ainvoke": plain, "instance.ainvoke": explicit}
        times: dict[str, list[float]] = {name: [] for name in calls}
        for call in calls.values():  # warm-up
            for _ in range(5):
                await call()
        for _ in range(runs):
            for name, call in calls.items():
                started = time.perf_counter()
                await call()
                times[name].append((time.perf_counter() - started) * 1000)
        medians = {}
        for name, samples in times.items():
            samples.sort()
            medians[name] = statistics.median(samples)
            p90 = samples[int(len(samples) * 0.9) - 1]
            print(f"{name:18} median {medians[name]:7.2f} ms   p90 {p90:7.2f} ms   ({runs} runs)")
        ratio = medians["graph.ainvoke"] / medians["instance.ainvoke"]
        print(f"ratio graph.ainvoke / instance.ainvoke (medians): {ratio:.3f}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=200)
    parser.add_argument("--pg", help="a PostgreSQL URL (a schema of its own is created)")
    args = parser.parse_args()
    if args.pg:
        import sqlalchemy as sa

        schema = f"bench_plain_{uuid.uuid4().hex[:8]}"
        admin = sa.create_engine(args.pg.replace("+asyncpg", ""))
        with admin.begin() as conn:
            conn.execute(sa.text(f'CREATE SCHEMA "{schema}"'))
        try:
            options = {"connect_args": {"server_settings": {"search_path": schema}}}
            url = args.pg if "+asyncpg" in args.pg else args.pg.replace("://", "+asyncpg://", 1)
            asyncio.run(bench(url, args.runs, options))
        finally:
            with admin.begin() as conn:
                conn.execute(sa.text(f'DROP SCHEMA "{schema}" CASCADE'))
            admin.dispose()
    else:
        with tempfile.TemporaryDirectory() as directory:
            url = f"sqlite+aiosqlite:///{Path(directory) / 'bench.db'}"
            asyncio.run(bench(url, args.runs, {}))


if __name__ == "__main__":
    main()

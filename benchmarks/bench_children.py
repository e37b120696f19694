"""A tree at scale (issue 31, item 7): N ANY_INSTANCE children of one parent, on SQLite and
PostgreSQL. Not a test: it asserts nothing and prints what it measured.

    python benchmarks/bench_children.py [--n 1000 10000] [--db sqlite postgresql]
        [--ends sql|serve] [--one-by-one 1000] [--pg URL]

For each database and N, one parent step:

1. **spawn**: ``ctx.spawn_children("leaf", {key: input, ...})``, timed around the call
   (the whole batch: inputs checked and serialized, the one statement or transaction);
   with ``--one-by-one K``, also K children spawned with ``await ctx.spawn_child(...)`` one
   after the other (the README's old pattern), for comparison.
2. **wait**: ``ctx.wait_children(children)``. The children end either by a statement of the
   benchmark (``--ends sql``, the default: every child but the last is set ``done`` with an
   output, as a worker's release and output would leave it, in one transaction; then the
   last, with the NOTIFY ``serve()`` sends at a run's end on PostgreSQL), or run for real by
   ``serve()`` of a second instance in this process (``--ends serve``, concurrency 8).
   Measured: the wait's looks (the reads of every pending child) and how long one took
   with all N pending, and the time from the last child's end (committed) to the parent
   step going on after ``wait_children``, against the poll interval (50 ms).

PostgreSQL works in a schema of its own (dropped after); SQLite in a temporary file.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import sys
import tempfile
import time
import uuid
from pathlib import Path
from typing import Any, TypedDict

from langgraph.graph import END, START, StateGraph
from sqlalchemy import text

# BENCH_TREE: another checkout of the project to measure (e.g. the commit before this
# change, whose steps spawn one child at a time and whose wait reads one child per read).
sys.path.insert(0, os.environ.get("BENCH_TREE") or str(Path(__file__).resolve().parent.parent))

from langgraph_fence import ChildPlacement, Instance, LeaseKey, fence_graph, get_execution_context
from langgraph_fence.database import schema_options
from langgraph_fence.execution.children import child_execution_id
from langgraph_fence.queue.notifications import ENDS_CHANNEL

DEFAULT_PG = os.environ.get("LANGGRAPH_FENCE_PG_URL", "postgresql://postgres@127.0.0.1:5432/test")
POLL = 0.05


class Tree(TypedDict, total=False):
    n: int
    out: list[Any]


class Leaf(TypedDict, total=False):
    i: int
    out: int


def leaf_graph(instance: Instance) -> Any:
    async def leaf(state: Leaf) -> Leaf:
        return {"out": state["i"] * 2}

    builder: StateGraph[Leaf] = StateGraph(Leaf)
    builder.add_node("leaf", leaf)
    builder.add_edge(START, "leaf")
    builder.add_edge("leaf", END)
    return fence_graph(builder).compile(checkpointer=instance.checkpointer, name="leaf")


async def one_tree(url: str, options: dict[str, Any], n: int, args: argparse.Namespace) -> None:
    figures: dict[str, Any] = {}
    looks: list[tuple[float, float, int]] = []  # (started, took, children read) per look
    ended_at: list[float] = []
    parent_done = asyncio.Event()
    children_spawned = asyncio.Event()
    thread = f"tree-{uuid.uuid4().hex[:8]}"
    root = LeaseKey("bench", thread)
    async with Instance.open(
        url, engine_options=options, lease_ttl=120, instance_id="parent"
    ) as parent:
        queue = parent._run_queue()
        # What the wait reads: every pending child at once (child_ends), or, in a tree
        # before it, one child per read (state): each read is counted as a look then.
        read = "child_ends" if hasattr(queue, "child_ends") else "state"
        real = getattr(queue, read)

        async def reading(*args: Any) -> Any:
            started = time.monotonic()
            try:
                return await real(*args)
            finally:
                size = len(args[0]) if read == "child_ends" else 1
                looks.append((started, time.monotonic() - started, size))

        setattr(queue, read, reading)

        async def fan(state: Tree) -> Tree:
            ctx = get_execution_context()
            inputs = {f"c{i}": {"i": i} for i in range(n)}
            started = time.monotonic()
            if hasattr(ctx, "spawn_children"):
                children = await ctx.spawn_children(
                    "leaf", inputs, placement=ChildPlacement.ANY_INSTANCE
                )
            else:  # a tree before it: one child at a time
                children = [
                    await ctx.spawn_child(
                        "leaf", child_input, placement=ChildPlacement.ANY_INSTANCE, key=key
                    )
                    for key, child_input in inputs.items()
                ]
            figures["spawn"] = time.monotonic() - started
            if args.one_by_one and n == max(args.n):
                started = time.monotonic()
                for i in range(args.one_by_one):
                    await ctx.spawn_child(
                        "leaf", {"i": i}, placement=ChildPlacement.ANY_INSTANCE, key=f"one-{i}"
                    )
                figures["one_by_one"] = time.monotonic() - started
                # Ended at once: only the batch is waited for.
                await _end(parent, root, [f"one-{i}" for i in range(args.one_by_one)])
            children_spawned.set()
            figures["waiting"] = time.monotonic()
            out = await ctx.wait_children(children, timeout=3600, poll_interval=POLL)
            figures["resumed"] = time.monotonic()
            parent_done.set()
            return {"out": [len(out)]}

        builder: StateGraph[Tree] = StateGraph(Tree)
        builder.add_node("fan", fan)
        builder.add_edge(START, "fan")
        builder.add_edge("fan", END)
        graph = fence_graph(builder).compile(checkpointer=parent.checkpointer, name="fan")
        run = asyncio.create_task(
            parent.ainvoke(
                graph, {"n": n}, {"configurable": {"thread_id": thread}}, tenant_id="bench"
            )
        )
        await children_spawned.wait()
        if args.ends == "serve":
            async with Instance.open(url, engine_options=options, instance_id="worker") as worker:
                stop = asyncio.Event()
                serving = asyncio.create_task(
                    worker.serve(
                        {"leaf": leaf_graph(worker)},
                        concurrency=8,
                        poll_interval=0.05,
                        stop=stop,
                        handle_signals=False,
                    )
                )
                told = worker._run_queue()
                real_notify = told.notify

                async def notify(channel: str, payload: str) -> None:
                    ended_at.append(time.monotonic())  # a child's end, committed
                    await real_notify(channel, payload)

                told.notify = notify  # type: ignore[method-assign]
                await parent_done.wait()
                stop.set()
                await serving
        else:
            while len(looks) < 3:  # noqa: ASYNC110 - a few looks with all N pending
                await asyncio.sleep(0.01)
            await _end(parent, root, [f"c{i}" for i in range(n - 1)])
            seen = len(looks)
            while len(looks) < seen + 2:  # noqa: ASYNC110 - a look that saw those ends
                await asyncio.sleep(0.01)
            await _end(parent, root, [f"c{n - 1}"], last=True)
            ended_at.append(time.monotonic())
        await run
    full = [took for _, took, size in looks if size == n] or [took for _, took, _ in looks[:3]]
    end = max(ended_at)
    after = sum(1 for started, _, _ in looks if started >= end)
    print(
        f"| {url.split(':')[0].split('+')[0]} | {n} | {figures['spawn']:.2f} s | "
        f"{n / figures['spawn']:.0f} | "
        + (
            f"{figures['one_by_one']:.2f} s ({args.one_by_one}) | "
            if "one_by_one" in figures
            else "- | "
        )
        + f"{figures['resumed'] - figures['waiting']:.1f} s | "
        f"{len(looks)} | {statistics.median(full) * 1e3:.1f} ms | "
        f"{(figures['resumed'] - end) * 1e3:.0f} ms | {after} |",
        flush=True,
    )


async def _end(parent: Instance, root: LeaseKey, keys: list[str], last: bool = False) -> None:
    """Children of ``keys`` ended ``done`` with an output, as a worker would leave them, in
    one transaction; with ``last``, the NOTIFY of a run's end (PostgreSQL) in it too."""
    queue = parent._run_queue()
    output_type, blob = queue.serde.dumps_typed({"i": 0, "out": 0})
    ids = [child_execution_id(root, key) for key in keys]
    engine = queue._engine
    postgres = engine.dialect.name == "postgresql"
    keys_json = json.dumps(ids)
    source = (
        "SELECT value FROM jsonb_array_elements_text(CAST(:ids AS jsonb))"
        if postgres
        else "SELECT value FROM json_each(:ids)"
    )
    async with engine.connect() as conn:
        if postgres:
            conn = await conn.execution_options(isolation_level="READ COMMITTED")
        async with conn.begin():
            await conn.execute(
                text(
                    "UPDATE fence_leases SET status = 'done', epoch = 1, holder = NULL, "
                    f"expires_at = NULL WHERE tenant_id = 'bench' AND execution_id IN ({source})"
                ),
                {"ids": keys_json},
            )
            await conn.execute(
                text(
                    "UPDATE fence_executions SET output_type = :t, output = :o WHERE "
                    f"tenant_id = 'bench' AND execution_id IN ({source})"
                ),
                {"ids": keys_json, "t": output_type, "o": blob},
            )
            if postgres and last:
                scope = LeaseKey("bench", ids[-1]).scope_key
                await conn.execute(
                    text("SELECT pg_notify(:c || '_' || left(md5(current_schema()), 12), :p)"),
                    {"c": ENDS_CHANNEL, "p": scope},
                )


async def main() -> None:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--n", type=int, nargs="+", default=[1000, 10000])
    parser.add_argument("--db", nargs="+", default=["sqlite", "postgresql"])
    parser.add_argument("--ends", choices=["sql", "serve"], default="sql")
    parser.add_argument("--one-by-one", type=int, default=0)
    parser.add_argument("--pg", default=DEFAULT_PG)
    args = parser.parse_args()
    print(
        f"load average before: {' '.join(f'{x:.1f}' for x in os.getloadavg())}; ends: {args.ends}"
    )
    print(
        "| db | children | spawn_children | children/s | spawn_child one by one | waited | looks | "
        "one look, all pending | last end -> parent resumed | looks after the last end |"
    )
    print("|---|--:|--:|--:|--:|--:|--:|--:|--:|--:|")
    for db in args.db:
        for n in args.n:
            if db == "sqlite":
                with tempfile.TemporaryDirectory() as folder:
                    await one_tree(f"sqlite+aiosqlite:///{folder}/tree.db", {}, n, args)
                continue
            import asyncpg

            schema = f"lgf_children_{uuid.uuid4().hex[:8]}"
            dsn = args.pg.replace("postgresql+asyncpg://", "postgresql://")
            admin = await asyncpg.connect(dsn)
            await admin.execute(f'CREATE SCHEMA "{schema}"')
            try:
                await one_tree(args.pg, schema_options(schema), n, args)
            finally:
                await admin.execute(f'DROP SCHEMA "{schema}" CASCADE')
                await admin.close()
    print(f"load average after: {' '.join(f'{x:.1f}' for x in os.getloadavg())}")


if __name__ == "__main__":
    asyncio.run(main())

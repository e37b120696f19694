"""Side-by-side throughput of the official savers and SqlCheckpointer, fenced and unfenced.

    python benchmarks/bench_savers.py [--runs 90] [--pg URL] [--only DB]

The graphs of ``../shared/research/baseline-perf.md``: ``linear`` (10 nodes in a row, each
appends about 200 bytes to a list in the state) and ``fanout`` (one node sends to 8 parallel
nodes with ``Send``, then a join). Every run is a new thread. Savers, all in ONE process,
taking turns run by run so that drift and load from elsewhere hit them alike:

* ``official``: ``AsyncSqliteSaver`` (one aiosqlite connection, WAL) or ``AsyncPostgresSaver``
  (psycopg pool of 4);
* ``sql``: ``SqlCheckpointer`` without a run handle (unfenced);
* ``fenced``: ``FencedCheckpointer(SqlCheckpointer)`` with a held lease and its run handle in
  the config, so every ``aput``/``aput_writes`` checks the token inside its own write. The
  lease is acquired before the timed runs (one acquire per thread, not per write).
* ``server`` (with ``--server``; needs the ``server`` extra): the saver as LangGraph's Agent
  Server holds what ``langgraph_fence.server.checkpointer`` yields: its adapter
  (``_CustomCheckpointerAdapter``, which adds the run's metadata to each checkpoint) over
  the fenced saver, with the server's run metadata in the config. Printed as a second
  table beside ``sql``, the unfenced saver.

Reports node executions per second (from the median run time), the ratios fenced / sql and
fenced / official, and the CPU time per node execution (all threads of the process): on a
loaded machine the CPU figures say more about a saver's own cost than wall-clock rates do.
Needs the ``bench`` extra (``pip install -e '.[bench]'``).
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import operator
import os
import statistics
import sys
import tempfile
import time
import uuid
from collections.abc import AsyncIterator, Callable
from contextlib import AsyncExitStack, asynccontextmanager
from pathlib import Path
from typing import Annotated, Any, TypedDict

from langgraph.graph import END, START, StateGraph
from langgraph.types import Send

from langgraph_fence import FencedCheckpointer, LeaseKey, SqlLeaseRepository
from langgraph_fence.checkpointers import SqlCheckpointer
from langgraph_fence.database import create_engine, normalize_url
from langgraph_fence.fence import RunHandle

DEFAULT_PG = "postgresql://postgres@127.0.0.1:5432/test"
ROOT = Path(__file__).resolve().parents[1]
#: Each run works in a schema of its own (two benchmark runs on one database must not drop
#: each other's tables), dropped at its end.
SCHEMA = f"lgf_bench_{os.getpid()}"
PAYLOAD = "x" * 200
NODES_PER_RUN = 10
WARM_UP = 5
DURABILITIES = ("sync", "async")


class State(TypedDict):
    items: Annotated[list[str], operator.add]


def linear_graph(checkpointer: Any) -> Any:
    builder = StateGraph(State)
    names = [f"n{i}" for i in range(NODES_PER_RUN)]
    for name in names:
        builder.add_node(name, lambda state: {"items": [PAYLOAD]})
    builder.add_edge(START, names[0])
    for left, right in itertools.pairwise(names):
        builder.add_edge(left, right)
    builder.add_edge(names[-1], END)
    return builder.compile(checkpointer=checkpointer)


def fanout_graph(checkpointer: Any) -> Any:
    builder = StateGraph(State)
    builder.add_node("split", lambda state: {"items": [PAYLOAD]})
    builder.add_node("work", lambda state: {"items": [PAYLOAD]})
    builder.add_node("join", lambda state: {"items": [PAYLOAD]})
    builder.add_edge(START, "split")
    builder.add_conditional_edges(
        "split", lambda state: [Send("work", {"items": []}) for _ in range(8)], ["work"]
    )
    builder.add_edge("work", "join")
    builder.add_edge("join", END)
    return builder.compile(checkpointer=checkpointer)


GRAPHS: dict[str, Callable[[Any], Any]] = {"linear": linear_graph, "fanout": fanout_graph}


class Target:
    """One saver under test, with how to make a run's config."""

    def __init__(
        self,
        name: str,
        saver: Any,
        leases: SqlLeaseRepository | None = None,
        metadata: dict[str, Any] | None = None,
    ) -> None:
        self.name = name
        self.saver = saver
        self.leases = leases
        self.metadata = metadata

    async def configs(self, count: int) -> list[dict[str, Any]]:
        configs = []
        for _ in range(count):
            thread = uuid.uuid4().hex
            configurable: dict[str, Any] = {"thread_id": thread}
            if self.leases is not None:
                lease = await self.leases.acquire(LeaseKey("bench", thread), "bench", 600)
                assert lease is not None
                configurable["__fence"] = RunHandle(self.leases, lease, 600)
            config: dict[str, Any] = {"configurable": configurable}
            if self.metadata is not None:
                configurable["run_id"] = str(uuid.uuid4())
                config["metadata"] = dict(self.metadata)
            configs.append(config)
        return configs


async def one_run(graph: Any, config: dict[str, Any], durability: str) -> tuple[float, float]:
    """One run: (wall seconds, CPU seconds of all this process's threads)."""
    started, cpu_started = time.perf_counter(), time.process_time()
    await graph.ainvoke({"items": []}, config, durability=durability)
    return time.perf_counter() - started, time.process_time() - cpu_started


@asynccontextmanager
async def sqlite_official(directory: Path) -> AsyncIterator[tuple[Any, Any]]:
    """``(engine, official saver)`` on SQLite files in ``directory``."""
    from langgraph.checkpoint.sqlite.aio import AsyncSqliteSaver

    async with AsyncSqliteSaver.from_conn_string(str(directory / "official.db")) as official:
        await official.setup()
        engine = create_engine(f"sqlite+aiosqlite:///{directory / 'fence.db'}")
        try:
            yield engine, official
        finally:
            await engine.dispose()


@asynccontextmanager
async def postgres_official(url: str, schema: str = SCHEMA) -> AsyncIterator[tuple[Any, Any]]:
    """``(engine, official saver)`` in a fresh PostgreSQL ``schema``."""
    import asyncpg
    from langgraph.checkpoint.postgres.aio import AsyncPostgresSaver
    from psycopg.rows import dict_row
    from psycopg_pool import AsyncConnectionPool

    dsn = normalize_url(url).set(drivername="postgresql").render_as_string(hide_password=False)
    admin = await asyncpg.connect(dsn)
    try:
        await admin.execute(f'DROP SCHEMA IF EXISTS "{schema}" CASCADE')
        await admin.execute(f'CREATE SCHEMA "{schema}"')
    finally:
        await admin.close()
    pool = AsyncConnectionPool(
        f"{dsn}?options=-csearch_path%3D{schema}",
        min_size=4,
        max_size=4,
        open=False,
        kwargs={"autocommit": True, "prepare_threshold": 0, "row_factory": dict_row},
    )
    await pool.open()
    engine = create_engine(url, connect_args={"server_settings": {"search_path": schema}})
    try:
        official = AsyncPostgresSaver(pool)  # type: ignore[arg-type]
        await official.setup()
        yield engine, official
    finally:
        await engine.dispose()
        await pool.close()
        admin = await asyncpg.connect(dsn)
        try:
            await admin.execute(f'DROP SCHEMA IF EXISTS "{schema}" CASCADE')
        finally:
            await admin.close()


@asynccontextmanager
async def sqlite_targets(directory: Path, server: bool) -> AsyncIterator[list[Target]]:
    async with sqlite_official(directory) as (engine, official):
        yield await _fence_targets(engine, official, server)


@asynccontextmanager
async def postgres_targets(url: str, server: bool) -> AsyncIterator[list[Target]]:
    async with postgres_official(url) as (engine, official):
        yield await _fence_targets(engine, official, server)


async def _fence_targets(engine: Any, official: Any, server: bool) -> list[Target]:
    saver = SqlCheckpointer(engine)
    await saver.setup()
    leases = SqlLeaseRepository(engine)
    targets = [
        Target("official", official),
        Target("sql", saver),
        Target("fenced", FencedCheckpointer(saver), leases),
    ]
    if server:
        from langgraph_api import __version__

        sys.path.insert(0, str(ROOT))  # the repository's tests
        from tests.support.server_adapter import server_adapter

        adapter = server_adapter(FencedCheckpointer(saver))
        metadata = {"run_attempt": 1, "langgraph_api_version": __version__, "graph_id": "g"}
        targets.append(Target("server", adapter, leases, metadata))
    return targets


async def bench(backend: str, targets: list[Target], runs: int) -> list[dict[str, Any]]:
    """Per cell, ``runs`` runs per saver, the savers taking turns run by run (in a rotating
    order), so that load from elsewhere hits them alike; medians of the per-run figures."""
    results: list[dict[str, Any]] = []
    for graph_name in GRAPHS:
        for durability in DURABILITIES:
            graphs = [GRAPHS[graph_name](t.saver) for t in targets]
            configs = [await t.configs(runs + WARM_UP) for t in targets]
            samples: dict[str, list[tuple[float, float]]] = {t.name: [] for t in targets}
            for i in range(runs + WARM_UP):
                order = list(range(len(targets)))
                order = order[i % len(order) :] + order[: i % len(order)]
                for k in order:
                    sample = await one_run(graphs[k], configs[k][i], durability)
                    if i >= WARM_UP:  # connections, prepared statements, caches
                        samples[targets[k].name].append(sample)
            row: dict[str, Any] = {}
            for name, values in samples.items():
                row[name] = NODES_PER_RUN / statistics.median(wall for wall, _ in values)
                row[f"{name}_cpu"] = (
                    statistics.median(cpu for _, cpu in values) / NODES_PER_RUN * 1e6
                )
            row.update(backend=backend, graph=graph_name, durability=durability)
            results.append(row)
            print(_line(row), file=sys.stderr, flush=True)
    return results


def _server_line(row: dict[str, Any]) -> str:
    return (
        f"| {row['backend']} | {row['graph']} | {row['durability']} | {row['sql']:.0f} | "
        f"{row['server']:.0f} | {row['server'] / row['sql']:.2f} | "
        f"{row['sql_cpu']:.0f} / {row['server_cpu']:.0f} |"
    )


def _line(row: dict[str, Any]) -> str:
    return (
        f"| {row['backend']} | {row['graph']} | {row['durability']} | {row['official']:.0f} | "
        f"{row['sql']:.0f} | {row['fenced']:.0f} | {row['fenced'] / row['sql']:.2f} | "
        f"{row['fenced'] / row['official']:.2f} | {row['official_cpu']:.0f} / "
        f"{row['sql_cpu']:.0f} / {row['fenced_cpu']:.0f} |"
    )


async def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=90, help="runs per saver and cell")
    parser.add_argument("--pg", default=DEFAULT_PG, help="PostgreSQL URL")
    parser.add_argument("--only", choices=["sqlite", "postgresql"], help="one backend only")
    parser.add_argument(
        "--server", action="store_true", help="also the Agent Server's view (extra server)"
    )
    args = parser.parse_args()
    print(
        "| db | graph | durability | official | sql | fenced | fenced/sql | fenced/official "
        "| CPU µs/node official / sql / fenced |\n"
        "|---|---|---|---:|---:|---:|---:|---:|---:|"
    )
    rows: list[dict[str, Any]] = []
    async with AsyncExitStack() as stack:
        if args.only != "postgresql":
            directory = Path(stack.enter_context(tempfile.TemporaryDirectory()))
            targets = await stack.enter_async_context(sqlite_targets(directory, args.server))
            rows += await bench("sqlite", targets, args.runs)
        if args.only != "sqlite":
            targets = await stack.enter_async_context(postgres_targets(args.pg, args.server))
            rows += await bench("postgresql", targets, args.runs)
    for row in rows:
        print(_line(row))
    if args.server:
        print(
            "\n| db | graph | durability | sql | server | server/sql "
            "| CPU µs/node sql / server |\n|---|---|---|---:|---:|---:|---:|"
        )
        for row in rows:
            print(_server_line(row))


if __name__ == "__main__":
    asyncio.run(main())

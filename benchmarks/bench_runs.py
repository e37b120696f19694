"""The whole fenced run beside the unfenced saver, the official savers and InMemorySaver.

    python benchmarks/bench_runs.py [--runs 40] [--pg URL] [--only DB]

What a user pays end to end: ``fenced`` is ``Instance.ainvoke`` of a ``fence_graph`` graph on
``SqlCheckpointer`` (the take: binding, record and lease; the keeper, the node wrappers,
the release with the outcome, every checkpoint guarded); ``sql`` the same graph, unwrapped, on
``SqlCheckpointer`` with no lease; ``official`` ``AsyncSqliteSaver`` / ``AsyncPostgresSaver``;
``memory`` ``InMemorySaver``. The graphs, rotation and medians of ``bench_savers.py`` (linear
10 nodes, fanout 8), durability sync, async and exit, one process, a new thread per run.
``plain`` is the fenced graph called the LangGraph way, ``graph.ainvoke`` (the instance's
checkpointer takes the lease itself).

Beside each rate, the CPU time of this process per run (``time.process_time``: every
thread's, user + system; the database server's is not in it), median, for ``sql`` and
``fenced``: what the fence adds in this process, which other load on the box disturbs far
less than the wall-clock rates.

Also counts the SQL statements one fenced run sends beyond the saver's, at the driver
(``tests/support/statements.py``: the lease store's and the records', whether SQLAlchemy sends
them or the lease store runs them on the driver; the saver's, the same in both runs, are
left out).
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import itertools
import statistics
import sys
import tempfile
import time
import uuid
from collections.abc import AsyncIterator, Callable
from contextlib import AsyncExitStack, asynccontextmanager
from pathlib import Path
from typing import Any

from langgraph.checkpoint.memory import InMemorySaver
from langgraph.graph import END, START, StateGraph
from langgraph.types import Send

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from bench_savers import (
    DEFAULT_PG,
    NODES_PER_RUN,
    PAYLOAD,
    SCHEMA,
    WARM_UP,
    State,
    postgres_official,
    sqlite_official,
)

from langgraph_fence import SqlLeaseRepository, fence_graph
from langgraph_fence.checkpointers import SqlCheckpointer
from langgraph_fence.instance import Instance
from langgraph_fence.lease.records import SqlExecutionRecords
from tests.support.statements import Statements


def linear(builder: StateGraph[State]) -> None:
    names = [f"n{i}" for i in range(NODES_PER_RUN)]
    for name in names:
        builder.add_node(name, lambda state: {"items": [PAYLOAD]})
    builder.add_edge(START, names[0])
    for left, right in itertools.pairwise(names):
        builder.add_edge(left, right)
    builder.add_edge(names[-1], END)


def fanout(builder: StateGraph[State]) -> None:
    builder.add_node("split", lambda state: {"items": [PAYLOAD]})
    builder.add_node("work", lambda state: {"items": [PAYLOAD]})
    builder.add_node("join", lambda state: {"items": [PAYLOAD]})
    builder.add_edge(START, "split")
    builder.add_conditional_edges(
        "split", lambda state: [Send("work", {"items": []}) for _ in range(8)], ["work"]
    )
    builder.add_edge("work", "join")
    builder.add_edge("join", END)


SHAPES: dict[str, Callable[[StateGraph[State]], None]] = {"linear": linear, "fanout": fanout}
DURABILITIES = ("sync", "async", "exit")


class Target:
    """One way of running a graph: its name, and how one run goes."""

    def __init__(
        self, name: str, saver: Any, instance: Instance | None = None, *, plain: bool = False
    ) -> None:
        self.name = name
        self.saver = saver
        self.instance = instance
        self.plain = plain  # the fenced graph called as graph.ainvoke

    def graph(self, shape: str) -> Any:
        builder: StateGraph[State] = StateGraph(State)
        SHAPES[shape](builder)
        if self.instance is None:
            return builder.compile(checkpointer=self.saver, name=shape)
        return fence_graph(builder).compile(checkpointer=self.instance.checkpointer, name=shape)

    async def run(self, graph: Any, durability: str) -> None:
        config = {"configurable": {"thread_id": uuid.uuid4().hex}}
        if self.instance is None or self.plain:
            await graph.ainvoke({"items": []}, config, durability=durability)
        else:
            await self.instance.ainvoke(
                graph, {"items": []}, config, tenant_id="bench", durability=durability
            )


async def _targets(engine: Any, official: Any) -> list[Target]:
    saver = SqlCheckpointer(engine)
    await saver.setup()
    leases = SqlLeaseRepository(engine)
    await leases.setup()
    instance = Instance(leases, saver, records=SqlExecutionRecords(engine), lease_ttl=600)
    return [
        Target("official", official),
        Target("sql", saver),
        Target("fenced", saver, instance),
        Target("plain", saver, instance, plain=True),
        Target("memory", InMemorySaver()),
    ]


@asynccontextmanager
async def sqlite_targets(directory: Path) -> AsyncIterator[tuple[Any, list[Target]]]:
    async with sqlite_official(directory) as (engine, official):
        yield engine, await _targets(engine, official)


@asynccontextmanager
async def postgres_targets(url: str) -> AsyncIterator[tuple[Any, list[Target]]]:
    async with postgres_official(url, f"{SCHEMA}_runs") as (engine, official):
        yield engine, await _targets(engine, official)


async def statements_per_run(engine: Any, targets: list[Target]) -> dict[str, float]:
    """SQL statements per run beyond the saver's, fenced and unfenced, by kind."""
    statements = Statements(engine)
    by_name = {t.name: t for t in targets}
    out: dict[str, float] = {}
    for name in ("sql", "fenced"):
        graph = by_name[name].graph("linear")
        seen: list[str] = []
        for _ in range(5):
            await statements.take()
            await by_name[name].run(graph, "sync")
            seen += await statements.take()
        out[name] = len(seen) / 5
        if name == "fenced":
            kinds = collections.Counter(seen)
            print(f"fenced linear sync, statements by kind (5 runs): {kinds}", file=sys.stderr)
    return out


async def bench(backend: str, targets: list[Target], runs: int) -> list[dict[str, Any]]:
    results: list[dict[str, Any]] = []
    for shape in SHAPES:
        for durability in DURABILITIES:
            graphs = [t.graph(shape) for t in targets]
            samples: dict[str, list[float]] = {t.name: [] for t in targets}
            cpu: dict[str, list[float]] = {t.name: [] for t in targets}
            for i in range(runs + WARM_UP):
                order = list(range(len(targets)))
                order = order[i % len(order) :] + order[: i % len(order)]
                for k in order:
                    started, cpu_started = time.perf_counter(), time.process_time()
                    await targets[k].run(graphs[k], durability)
                    if i >= WARM_UP:
                        samples[targets[k].name].append(time.perf_counter() - started)
                        cpu[targets[k].name].append(time.process_time() - cpu_started)
            row: dict[str, Any] = {
                name: NODES_PER_RUN / statistics.median(values) for name, values in samples.items()
            }
            row.update(
                backend=backend,
                graph=shape,
                durability=durability,
                sql_cpu=1000 * statistics.median(cpu["sql"]),
                fenced_cpu=1000 * statistics.median(cpu["fenced"]),
                plain_cpu=1000 * statistics.median(cpu["plain"]),
            )
            results.append(row)
            print(_line(row), file=sys.stderr, flush=True)
    return results


HEADER = (
    "| db | graph | durability | InMemorySaver | official | sql | fenced | plain | fenced/sql "
    "| plain/sql | fenced/official | fenced/memory | CPU ms/run sql / fenced / plain "
    "| sql/fenced CPU |\n"
    "|---|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|"
)


def _line(row: dict[str, Any]) -> str:
    return (
        f"| {row['backend']} | {row['graph']} | {row['durability']} | {row['memory']:.0f} | "
        f"{row['official']:.0f} | {row['sql']:.0f} | {row['fenced']:.0f} | {row['plain']:.0f} | "
        f"{row['fenced'] / row['sql']:.2f} | {row['plain'] / row['sql']:.2f} | "
        f"{row['fenced'] / row['official']:.2f} | {row['fenced'] / row['memory']:.2f} | "
        f"{row['sql_cpu']:.1f} / {row['fenced_cpu']:.1f} / {row['plain_cpu']:.1f} | "
        f"{row['sql_cpu'] / row['fenced_cpu']:.2f} |"
    )


async def main() -> None:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--runs", type=int, default=40, help="runs per target and cell")
    parser.add_argument("--pg", default=DEFAULT_PG, help="PostgreSQL URL")
    parser.add_argument("--only", choices=["sqlite", "postgresql"], help="one backend only")
    args = parser.parse_args()
    rows: list[dict[str, Any]] = []
    counts: dict[str, dict[str, float]] = {}
    async with AsyncExitStack() as stack:
        if args.only != "postgresql":
            directory = Path(stack.enter_context(tempfile.TemporaryDirectory()))
            engine, targets = await stack.enter_async_context(sqlite_targets(directory))
            counts["sqlite"] = await statements_per_run(engine, targets)
            rows += await bench("sqlite", targets, args.runs)
        if args.only != "sqlite":
            engine, targets = await stack.enter_async_context(postgres_targets(args.pg))
            counts["postgresql"] = await statements_per_run(engine, targets)
            rows += await bench("postgresql", targets, args.runs)
    print(HEADER)
    for row in rows:
        print(_line(row))
    for backend, count in counts.items():
        print(
            f"\n{backend}: SQL statements per linear-10 sync run beyond the saver's: "
            f"unfenced {count['sql']:.1f}, fenced {count['fenced']:.1f}"
        )


if __name__ == "__main__":
    asyncio.run(main())

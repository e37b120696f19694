"""One instance holding N executions that wait in a node: does its keeper keep them all?

    python benchmarks/bench_scale.py [--n 1000] [--ttl 3] [--hold 15] [--pg URL]

Starts N runs on PostgreSQL (their step waits on an event, holding its lease), then, for
``--hold`` seconds with all N held, measures: leases lost (must be 0), renewal statements
per second and leases per statement, CPU of the process per held execution and second, and
the renewal lateness (how much later than due each statement went out: the window it was
due at, less the least window left among its leases when sent), median and p99. Issue 14
part (a); parts (b) and (c) are not built.
"""

from __future__ import annotations

import argparse
import asyncio
import operator
import statistics
import sys
import time
import uuid
from pathlib import Path
from typing import Annotated, TypedDict

from langgraph.graph import END, START, StateGraph

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from langgraph_fence import EventKind, FenceEvent, fence_graph
from langgraph_fence.database import schema_options
from langgraph_fence.fence import safety_margin
from langgraph_fence.instance import Instance

DEFAULT_PG = "postgresql://postgres@127.0.0.1:5432/test"


class Log(TypedDict, total=False):
    log: Annotated[list[str], operator.add]


async def main() -> None:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--n", type=int, default=1000)
    parser.add_argument("--ttl", type=float, default=3.0)
    parser.add_argument("--hold", type=float, default=15.0)
    parser.add_argument("--pg", default=DEFAULT_PG)
    args = parser.parse_args()
    import asyncpg

    schema = f"lgf_scale_{uuid.uuid4().hex[:8]}"
    dsn = args.pg.replace("postgresql+asyncpg://", "postgresql://")
    admin = await asyncpg.connect(dsn)
    await admin.execute(f'CREATE SCHEMA "{schema}"')
    go = asyncio.Event()
    entered = 0

    async def wait(state: Log) -> Log:
        nonlocal entered
        entered += 1
        await go.wait()
        return {"log": ["done"]}

    lost: list[FenceEvent] = []
    try:
        async with Instance.open(
            args.pg,
            engine_options=schema_options(schema),
            lease_ttl=args.ttl,
            max_held=max(args.n, 1000),
        ) as instance:
            instance.add_listener(
                lambda e: lost.append(e) if e.kind in (EventKind.LOST, EventKind.FENCED) else None
            )
            builder: StateGraph[Log] = StateGraph(Log)
            builder.add_node("wait", wait)
            builder.add_edge(START, "wait")
            builder.add_edge("wait", END)
            graph = fence_graph(builder).compile(checkpointer=instance.checkpointer, name="w")
            started = time.monotonic()
            tasks = [
                asyncio.create_task(
                    instance.ainvoke(
                        graph,
                        {"log": []},
                        {"configurable": {"thread_id": uuid.uuid4().hex}},
                        tenant_id="scale",
                    )
                )
                for _ in range(args.n)
            ]
            # A benchmark's progress report, polled: nothing waits on it.
            while entered < args.n and not any(t.done() for t in tasks):  # noqa: ASYNC110
                await asyncio.sleep(0.1)
            print(f"{entered} of {args.n} held after {time.monotonic() - started:.1f} s")
            keeper = instance._keeper
            held_from, cpu_from = instance.clock(), time.process_time()
            await asyncio.sleep(args.hold)  # the measurement window, not a synchronisation
            cpu = time.process_time() - cpu_from
            window = instance.clock() - held_from
            batches = [b for b in keeper.batches if b.sent_at >= held_from]
            go.set()
            results = await asyncio.gather(*tasks, return_exceptions=True)
    finally:
        await admin.execute(f'DROP SCHEMA "{schema}" CASCADE')
        await admin.close()
    due_at = args.ttl - safety_margin(args.ttl) - instance.renew_interval
    late = sorted(max(due_at - b.slack, 0.0) for b in batches) or [0.0]
    failed = sum(isinstance(r, BaseException) for r in results)
    print(
        f"N={args.n} TTL={args.ttl:g} s over {window:.1f} s held: leases lost {len(lost)} "
        f"(runs failed {failed}); renewal statements/s {len(batches) / window:.2f} "
        f"({statistics.mean(b.size for b in batches) if batches else 0:.0f} leases each, "
        f"answered in {statistics.median(b.took for b in batches) * 1e3 if batches else 0:.1f} "
        f"ms median); CPU {cpu / window / args.n * 1e6:.1f} µs per held execution per second "
        f"({cpu / window * 100:.1f} % of a core); renewal lateness median "
        f"{statistics.median(late) * 1e3:.0f} ms, "
        f"p99 {late[int(0.99 * (len(late) - 1))] * 1e3:.0f} ms"
    )


if __name__ == "__main__":
    asyncio.run(main())

"""Issue 14 at scale, on PostgreSQL: (a) one instance holding N executions, (b) workers on
one database, (c) the takeover latency of a handed-back execution.

    python benchmarks/bench_scale.py [--part a] [--n 1000] [--ttl 3] [--hold 15] [--pg URL]
    python benchmarks/bench_scale.py --part b [--runs 2000] [--workers 1 2 4] [--concurrency 8]
    python benchmarks/bench_scale.py --part c [--takeovers 10] [--poll-interval 1.0]

(a) Starts N runs (their step waits on an event, holding its lease; ``--max-held`` sets
the instance's limit: N by default, or ``default`` for its own), then, for ``--hold``
seconds with all N held, measures: leases lost (must be 0), renewal statements per second
and leases per statement, CPU of the process per held execution and second, and the renewal
lateness (how much later than due each statement went out: the window it was due at, less
the least window left among its leases when sent), median and p99. Then lets every step go
at once and counts the leases lost while the N runs end together.

(b) ``--runs`` submitted runs of ``bench_queue.py``'s one-node graph over 1, 2 and 4
``langgraph-fence worker`` processes (``bench_queue.throughput``): runs/s, and the CPU the
workers and every PostgreSQL process of the box spent meanwhile (from ``/proc``, as ``ps``
reads it: the database is on this box), to tell which saturates.

(c) Instance A runs a two-step graph and is drained after its first step (handed back, as
``serve()`` does on stop); instance B serves (poll ``--poll-interval``) and takes it over:
the time from A's hand-back to B's second step, with B woken by NOTIFY and polling only.
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import contextlib
import gc
import operator
import os
import resource
import statistics
import sys
import time
import uuid
from pathlib import Path
from typing import Annotated, TypedDict

from langgraph.graph import END, START, StateGraph

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from langgraph_fence import EventKind, FenceEvent, InstanceFullError, fence_graph
from langgraph_fence.database import schema_options
from langgraph_fence.fence import safety_margin
from langgraph_fence.instance import Instance

HERE = Path(__file__).resolve().parent
DEFAULT_PG = "postgresql://postgres@127.0.0.1:5432/test"


class Log(TypedDict, total=False):
    log: Annotated[list[str], operator.add]


async def main() -> None:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--part", choices=["a", "b", "c"], default="a")
    parser.add_argument("--n", type=int, default=1000)
    parser.add_argument("--ttl", type=float, default=3.0)
    parser.add_argument("--hold", type=float, default=15.0)
    parser.add_argument(
        "--max-held",
        type=lambda value: value if value in ("n", "default") else int(value),
        default="n",
        help="(a) the instance's max_held: 'n' (as many as --n, the default), 'default' "
        "(the instance's own, derived from the TTL), or a number",
    )
    parser.add_argument("--pg", default=DEFAULT_PG)
    parser.add_argument("--runs", type=int, default=2000)
    parser.add_argument("--workers", type=int, nargs="+", default=[1, 2, 4])
    parser.add_argument("--concurrency", type=int, default=8)
    parser.add_argument("--takeovers", type=int, default=10)
    parser.add_argument("--poll-interval", type=float, default=1.0)
    args = parser.parse_args()
    gc.callbacks.append(_gc_timer)
    print(f"load average before: {' '.join(f'{x:.1f}' for x in os.getloadavg())}")
    if args.part == "b":
        await part_b(args)
        return
    if args.part == "c":
        await part_c(args)
        return
    await part_a(args)


async def part_a(args: argparse.Namespace) -> None:
    import asyncpg

    schema = f"lgf_scale_{uuid.uuid4().hex[:8]}"
    dsn = args.pg.replace("postgresql+asyncpg://", "postgresql://")
    admin = await asyncpg.connect(dsn)
    await admin.execute(f'CREATE SCHEMA "{schema}"')
    go = asyncio.Event()
    waiting = 0  # runs in their step now (a run that lost its lease there has left it)

    async def wait(state: Log) -> Log:
        nonlocal waiting
        waiting += 1
        try:
            await go.wait()
        finally:
            waiting -= 1
        return {"log": ["done"]}

    lost: list[FenceEvent] = []
    try:
        async with Instance.open(
            args.pg,
            engine_options=schema_options(schema),
            lease_ttl=args.ttl,
            max_held={"n": args.n, "default": None}.get(args.max_held, args.max_held),
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
            ended = 0

            def count_end(_: object) -> None:
                nonlocal ended
                ended += 1

            for task in tasks:
                task.add_done_callback(count_end)
            # A benchmark's progress report, polled: nothing waits on it. Every start either
            # waits in its step or ends (refused: InstanceFullError; or failed, in its step
            # or before it).
            while waiting + ended < args.n:  # noqa: ASYNC110
                await asyncio.sleep(0.1)
            refused = sum(isinstance(t.exception(), InstanceFullError) for t in tasks if t.done())
            print(
                f"{waiting} of {args.n} held after {time.monotonic() - started:.1f} s; "
                f"{refused} refused (InstanceFullError), {ended - refused} ended otherwise"
            )
            keeper = instance.host.keeper
            lag = asyncio.create_task(_loop_lag())
            print(_gc_report("while starting"))
            GC_PASSES.clear()
            held_from, cpu_from = instance.clock(), time.process_time()
            await asyncio.sleep(args.hold)  # the measurement window, not a synchronisation
            cpu = time.process_time() - cpu_from
            window = instance.clock() - held_from
            batches = [b for b in keeper.batches if b.sent_at >= held_from]
            lag_held = max(LAGS, default=0.0)
            LAGS.clear()
            print(_gc_report("while held"))
            released_at = time.time()
            go.set()
            results = await asyncio.gather(*tasks, return_exceptions=True)
            lag.cancel()
            print(
                f"event loop lag (a 0.1 s sleep's overshoot): at most {lag_held:.2f} s while "
                f"held, {max(LAGS, default=0.0):.2f} s while the {args.n} runs ended"
            )
    finally:
        await admin.execute(f'DROP SCHEMA "{schema}" CASCADE')
        await admin.close()
    due_at = args.ttl - safety_margin(args.ttl) - instance.renew_interval
    late = sorted(max(due_at - b.slack, 0.0) for b in batches) or [0.0]
    errors = [r for r in results if isinstance(r, BaseException)]
    failed = len(errors)
    for kind, count in collections.Counter(type(e).__name__ for e in errors).most_common():
        example = next(e for e in errors if type(e).__name__ == kind)
        print(f"runs failed with {kind}: {count} (e.g. {str(example)[:300]})")
    while_held = sum(e.at < released_at for e in lost)
    print(
        f"leases lost while held {while_held}, once the {args.n} steps were let go at once "
        f"{len(lost) - while_held}; load average {' '.join(f'{x:.1f}' for x in os.getloadavg())}"
        f"; peak RSS {resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024:.0f} MB"
    )
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


LAGS: list[float] = []
#: The garbage collector's passes while the benchmark runs: (generation, seconds).
GC_PASSES: list[tuple[int, float]] = []
_gc_started = [0.0]


def _gc_timer(phase: str, info: dict[str, int]) -> None:
    if phase == "start":
        _gc_started[0] = time.perf_counter()
    else:
        GC_PASSES.append((info["generation"], time.perf_counter() - _gc_started[0]))


def _gc_report(label: str) -> str:
    full = [took for generation, took in GC_PASSES if generation == 2]
    return (
        f"garbage collector {label}: {len(GC_PASSES)} passes, {len(full)} full, longest full "
        f"{max(full, default=0.0):.2f} s, all passes {sum(t for _, t in GC_PASSES):.2f} s"
    )


async def _loop_lag() -> None:
    """Record how late a 0.1 s sleep wakes: how long the event loop was kept busy."""
    while True:
        asked = time.monotonic()
        await asyncio.sleep(0.1)
        LAGS.append(time.monotonic() - asked - 0.1)


async def part_b(args: argparse.Namespace) -> None:
    sys.path.insert(0, str(HERE))
    from bench_queue import cpu_probe, cpu_spent, throughput  # type: ignore[import-not-found]

    url = args.pg.replace("postgresql://", "postgresql+asyncpg://")
    print(f"{os.cpu_count()} CPUs on this box; the database is on it")
    print("| workers | runs | took | runs/s | workers' CPU | PostgreSQL's CPU | node runs |")
    print("|--:|--:|--:|--:|--:|--:|--:|")
    for workers in args.workers:
        got = await throughput(url, args.runs, workers, args.concurrency, probe=cpu_probe)
        (t0, w0, p0), (t1, w1, p1) = got["probe"]
        wall = t1 - t0
        print(
            f"| {workers} | {args.runs} | {got['elapsed']:.1f} s | {got['per_s']:.0f} | "
            f"{cpu_spent(w0, w1) / wall:.2f} cores | {cpu_spent(p0, p1) / wall:.2f} cores | "
            f"{got['counted']} ({got['distinct']} distinct) |"
        )
        print(f"  load average after: {' '.join(f'{x:.1f}' for x in os.getloadavg())}")


class Two(TypedDict, total=False):
    seen: list[str]


async def part_c(args: argparse.Namespace) -> None:
    import asyncpg
    from langgraph.errors import GraphDrained

    dsn = args.pg.replace("postgresql+asyncpg://", "postgresql://")
    admin = await asyncpg.connect(dsn)
    print(f"B polls every {args.poll_interval} s; {args.takeovers} hand-backs each way")
    try:
        for listen in (True, False):
            schema = f"lgf_scale_{uuid.uuid4().hex[:8]}"
            await admin.execute(f'CREATE SCHEMA "{schema}"')
            try:
                samples = await _takeovers(args, schema, listen, GraphDrained)
            finally:
                await admin.execute(f'DROP SCHEMA "{schema}" CASCADE')
            samples.sort()
            print(
                f"B woken by {'NOTIFY' if listen else 'polling only'}: hand-back to takeover "
                f"median {statistics.median(samples) * 1e3:.0f} ms, max {samples[-1] * 1e3:.0f} ms"
            )
    finally:
        await admin.close()


async def _takeovers(
    args: argparse.Namespace, schema: str, listen: bool, drained: type[BaseException]
) -> list[float]:
    go, on_b = asyncio.Event(), asyncio.Event()
    second_at: list[float] = []

    def build(instance: Instance, hold: bool) -> object:
        async def first(state: Two) -> Two:
            if hold:
                await go.wait()
            return {"seen": ["first"]}

        async def second(state: Two) -> Two:
            if not hold:
                second_at.append(time.monotonic())
                on_b.set()
            return {"seen": ["second"]}

        builder: StateGraph[Two] = StateGraph(Two)
        builder.add_node("first", first)
        builder.add_node("second", second)
        builder.add_edge(START, "first")
        builder.add_edge("first", "second")
        builder.add_edge("second", END)
        return fence_graph(builder).compile(checkpointer=instance.checkpointer, name="two")

    options = schema_options(schema)
    samples = []
    async with (
        Instance.open(args.pg, engine_options=options, instance_id="A") as a,
        Instance.open(args.pg, engine_options=options, instance_id="B") as b,
    ):
        graph_a = build(a, hold=True)
        handed_back: list[float] = []
        a.add_listener(
            lambda e: (
                handed_back.append(time.monotonic()) if e.kind is EventKind.HANDED_BACK else None
            )
        )
        stop = asyncio.Event()
        server = asyncio.create_task(
            b.serve(
                {"two": build(b, hold=False)},
                poll_interval=args.poll_interval,
                stop=stop,
                handle_signals=False,
                listen=listen,
            )
        )
        try:
            for i in range(args.takeovers):
                go.clear()
                on_b.clear()
                config = {"configurable": {"thread_id": f"c-{i}-{uuid.uuid4().hex[:6]}"}}
                run = asyncio.create_task(a.ainvoke(graph_a, {"seen": []}, config, tenant_id="c"))
                while not a._runs:  # noqa: ASYNC110 - a benchmark's own pacing
                    await asyncio.sleep(0.01)
                (held,) = a._runs
                held.control.request_drain("handed back by the benchmark")
                go.set()
                with contextlib.suppress(drained):
                    await run
                await asyncio.wait_for(on_b.wait(), 60)
                samples.append(second_at[-1] - handed_back[-1])
        finally:
            stop.set()
            await asyncio.wait_for(server, 60)
    return samples


if __name__ == "__main__":
    asyncio.run(main())

"""Submitted runs on PostgreSQL: round-trip latency (NOTIFY vs polling) and throughput per
worker count.

    python benchmarks/bench_queue.py [--db URL] [--latency-runs 30] [--poll-interval 1.0]
                                     [--runs 1000] [--workers 1 2 4] [--concurrency 8]

Measured, not asserted. In a schema of its own per part (dropped at the end):

* latency: one ``serve()`` in this process (poll ``--poll-interval``), a client submitting
  one run of a one-node graph at a time and awaiting ``run.result()``; from the submit call
  to the output in hand. Side by side: the server woken by the submit's NOTIFY
  (``listen=True``, the default) and polling only (``listen=False``).
* throughput: ``--runs`` runs of ``bench_count`` (one ``NON_IDEMPOTENT_WRITE`` node that
  inserts a row per execution into ``bench_counts``) over N ``langgraph-fence worker``
  processes (``--concurrency`` each). Four client tasks submit every run first (timed on
  their own); then the workers, started and waiting at a gate, are let go together; the time
  is from the gate to the last run ``done``.
  Then it checks that every run is done and ran its node exactly once.
* the loop beside it: the same runs of the same graph, not submitted but called in a loop
  (``--concurrency`` tasks awaiting ``Instance.ainvoke`` one run after another) in ONE
  process on the same database and saver, started at the same kind of gate: what the queue
  itself costs is submitted runs/s over the loop's. For each row, the CPU the runs' processes
  and every PostgreSQL process of the box spent meanwhile (from ``/proc``: the database is
  on this box).
"""

from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import sys
import tempfile
import time
import uuid
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any, TypedDict

from rich.console import Console
from rich.table import Table
from sqlalchemy import text

ROOT = Path(__file__).resolve().parents[1]
HERE_FILE = str(Path(__file__).resolve())
sys.path.insert(0, str(ROOT))

from langgraph.graph import END, START, StateGraph  # noqa: E402

from langgraph_fence import Effect, Instance, fence_graph  # noqa: E402
from langgraph_fence.database import create_engine  # noqa: E402
from langgraph_fence.steps.context import get_execution_context  # noqa: E402

DEFAULT_URL = "postgresql+asyncpg://postgres@127.0.0.1:5432/test"
GRAPH = "bench_count"
CREATE_COUNTS = (
    "CREATE TABLE IF NOT EXISTS bench_counts (id BIGSERIAL PRIMARY KEY, "
    "execution_id TEXT NOT NULL, token BIGINT NOT NULL)"
)


class State(TypedDict, total=False):
    n: int
    done: bool


GATE_ENV = "LGF_BENCH_GATE"


def graphs(instance: Instance) -> dict[str, Any]:
    """``--graphs benchmarks.bench_queue:graphs``: ``bench_count``, one counting node.

    With ``$LGF_BENCH_GATE`` set, the worker says it is up (``GATE.<instance id>``) and
    waits for the file ``GATE`` before it serves: every worker starts on the same signal.
    """
    engine = instance.repository.engine  # type: ignore[attr-defined]
    gate = os.environ.get(GATE_ENV)
    if gate:
        Path(f"{gate}.{instance.instance_id}").touch()
        while not Path(gate).exists():
            time.sleep(0.01)  # nothing else runs in this worker yet

    async def count(state: State) -> dict[str, Any]:
        fence = get_execution_context().fence
        async with engine.connect() as conn:  # autocommit: a plain, non-idempotent write
            await conn.execute(
                text("INSERT INTO bench_counts (execution_id, token) VALUES (:e, :t)"),
                {"e": fence.lease_execution_id, "t": fence.token},
            )
        return {"done": True}

    builder = StateGraph(State)
    builder.add_node("count", count)
    builder.add_edge(START, "count")
    builder.add_edge("count", END)
    graph = fence_graph(builder, effects={"count": Effect.NON_IDEMPOTENT_WRITE}).compile(
        checkpointer=instance.checkpointer, name=GRAPH
    )
    return {GRAPH: graph}


@asynccontextmanager
async def own_schema(url: str) -> AsyncIterator[tuple[str, dict[str, Any]]]:
    schema = f"lgf_bench_{uuid.uuid4().hex[:10]}"
    admin = create_engine(url)
    async with admin.connect() as conn:
        await conn.execute(text(f'CREATE SCHEMA "{schema}"'))
    options = {"connect_args": {"server_settings": {"search_path": schema}}}
    try:
        yield schema, options
    finally:
        async with admin.connect() as conn:
            await conn.execute(text(f'DROP SCHEMA IF EXISTS "{schema}" CASCADE'))
        await admin.dispose()


async def latency(url: str, runs: int, poll: float, listen: bool) -> list[float]:
    async with (
        own_schema(url) as (_, options),
        Instance.open(url, engine_options=options, instance_id="client") as client,
        Instance.open(url, engine_options=options, instance_id="server") as server,
    ):
        async with client._run_queue()._engine.connect() as conn:
            await conn.execute(text(CREATE_COUNTS))
        stop = asyncio.Event()
        task = asyncio.create_task(
            server.serve(
                graphs(server),
                poll_interval=poll,
                stop=stop,
                handle_signals=False,
                listen=listen,
            )
        )
        samples = []
        try:
            for i in range(runs):
                config = {"configurable": {"thread_id": f"lat-{i}"}}
                started = time.perf_counter()
                run = await client.submit(GRAPH, {"n": i}, config, tenant_id="bench")
                await run.result(timeout=60, poll_interval=0.01)
                samples.append(time.perf_counter() - started)
        finally:
            stop.set()
            await asyncio.wait_for(task, 60)
        return samples


def cpu_seconds(pid: int) -> float:
    """User + system CPU seconds of process ``pid`` so far (0 once it is gone)."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except OSError:
        return 0.0
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def postgres_pids() -> list[int]:
    pids = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                if (entry / "comm").read_text().strip() == "postgres":
                    pids.append(int(entry.name))
            except OSError:
                continue
    return pids


def cpu_probe(workers: list[int]) -> tuple[float, dict[int, float], dict[int, float]]:
    """When, and the CPU so far of each worker and of each PostgreSQL process."""
    return (
        time.monotonic(),
        {pid: cpu_seconds(pid) for pid in workers},
        {pid: cpu_seconds(pid) for pid in postgres_pids()},
    )


def cpu_spent(before: dict[int, float], after: dict[int, float]) -> float:
    # A backend that started meanwhile counts from 0; one that ended is not counted.
    return sum(cpu - before.get(pid, 0.0) for pid, cpu in after.items())


async def loop_child(url: str, schema: str, runs: int, concurrency: int) -> None:
    """The loop: ``runs`` runs of the same graph, ``concurrency`` at a time, each task
    awaiting ``Instance.ainvoke`` one run after another; waits at the gate first."""
    options = {"connect_args": {"server_settings": {"search_path": schema}}}
    async with Instance.open(url, engine_options=options, instance_id="loop") as instance:
        graph = graphs(instance)[GRAPH]
        left = list(range(runs))

        async def runner() -> None:
            while left:
                i = left.pop()
                config = {"configurable": {"thread_id": f"run-{i}"}}
                await instance.ainvoke(graph, {"n": i}, config, tenant_id="bench")

        await asyncio.gather(*(runner() for _ in range(concurrency)))
        # Kept up, as a worker is, until the benchmark has read its CPU and ends it.
        await asyncio.Event().wait()


async def throughput(
    url: str,
    runs: int,
    workers: int,
    concurrency: int,
    probe: Any = None,
    *,
    loop: bool = False,
) -> dict[str, Any]:
    """``probe(worker pids)``, if given, is called as the workers are let go and again at
    the last run's end; both answers are returned under ``"probe"``. With ``loop``, one
    process calls the graph in a loop instead (:func:`loop_child`), nothing submitted."""
    async with (
        own_schema(url) as (schema, options),
        Instance.open(url, engine_options=options, instance_id="client") as client,
    ):
        queue = client._run_queue()
        engine = queue._engine
        async with engine.connect() as conn:
            await conn.execute(text(CREATE_COUNTS))
        # Every run is submitted first (timed on its own), then the workers start
        # together: the time is the workers' alone, not the client's competing for CPU.
        started = time.perf_counter()
        ids = list(range(runs))

        async def submitter(part: list[int]) -> None:
            for i in part:
                config = {"configurable": {"thread_id": f"run-{i}"}}
                await client.submit(GRAPH, {"n": i}, config, tenant_id="bench")

        if not loop:
            await asyncio.gather(*(submitter(ids[k::4]) for k in range(4)))
        submitted = time.perf_counter() - started
        gate = Path(tempfile.mkdtemp()) / "gate"
        env = {**os.environ, "PYTHONPATH": str(ROOT), GATE_ENV: str(gate)}
        loop_command = [
            HERE_FILE,
            "--loop-child",
            schema,
            "--db",
            url,
            "--runs",
            str(runs),
            "--concurrency",
            str(concurrency),
        ]
        procs = (
            [await asyncio.create_subprocess_exec(sys.executable, *loop_command, cwd=ROOT, env=env)]
            if loop
            else [
                await asyncio.create_subprocess_exec(
                    sys.executable,
                    "-m",
                    "langgraph_fence.cli",
                    "-q",
                    "worker",
                    "--db",
                    url,
                    "--schema",
                    schema,
                    "--graphs",
                    "benchmarks.bench_queue:graphs",
                    "--concurrency",
                    str(concurrency),
                    "--poll-interval",
                    "0.2",
                    "--instance-id",
                    f"w{i}",
                    cwd=ROOT,
                    env=env,
                    stdout=asyncio.subprocess.DEVNULL,
                )
                for i in range(workers)
            ]
        )
        try:
            deadline = time.monotonic() + 120
            while len(list(gate.parent.glob("gate.*"))) < len(procs):
                if time.monotonic() > deadline:
                    raise RuntimeError("the workers did not come up")
                await asyncio.sleep(0.05)
            pids = [proc.pid for proc in procs]
            probed = [probe(pids)] if probe else []
            started = time.perf_counter()
            gate.touch()
            count = text("SELECT count(*) FROM fence_leases WHERE status = 'done'")
            deadline = time.monotonic() + 600
            while True:
                async with engine.connect() as conn:
                    done = int((await conn.execute(count)).scalar_one())
                if done >= runs:
                    break
                if time.monotonic() > deadline:
                    raise RuntimeError(f"only {done} of {runs} runs ended in time")
                await asyncio.sleep(0.05)
            elapsed = time.perf_counter() - started
            if probe:
                probed.append(probe(pids))
        finally:
            for proc in procs:
                if proc.returncode is None:
                    proc.terminate()
            for proc in procs:
                try:
                    await asyncio.wait_for(proc.wait(), 30)
                except TimeoutError:
                    proc.kill()
                    await proc.wait()
        async with engine.connect() as conn:
            rows = (
                await conn.execute(
                    text(
                        "SELECT count(*) AS n, count(DISTINCT execution_id) AS d FROM bench_counts"
                    )
                )
            ).one()
        return {
            "workers": 0 if loop else workers,
            "elapsed": elapsed,
            "submitted": submitted,
            "per_s": runs / elapsed,
            "counted": int(rows.n),
            "distinct": int(rows.d),
            "probe": probed,
        }


def _ms(samples: list[float]) -> str:
    ordered = sorted(samples)
    p95 = ordered[max(0, int(len(ordered) * 0.95) - 1)]
    return f"{statistics.median(samples) * 1e3:.1f} / {p95 * 1e3:.1f} / {max(samples) * 1e3:.1f}"


async def amain(args: argparse.Namespace) -> None:
    console = Console(width=160)
    if args.latency_runs:
        title = f"submit + result round trip (ms), poll interval {args.poll_interval} s"
        table = Table(title=title)
        table.add_column("server woken by")
        table.add_column("median / p95 / max", justify="right")
        for listen in (True, False):
            samples = await latency(args.db, args.latency_runs, args.poll_interval, listen)
            table.add_row("NOTIFY" if listen else "polling only", _ms(samples))
        console.print(table)
    if args.runs:
        table = Table(title=f"{args.runs} runs, concurrency {args.concurrency} each")
        columns = (
            "runs by",
            "seconds",
            "runs/s",
            "of the loop",
            "their CPU (cores)",
            "PostgreSQL CPU (cores)",
            "submitting took (s)",
            "node runs",
        )
        for column in columns:
            table.add_column(column, justify="right")
        base = None
        for workers in [0, *args.workers]:
            row = await throughput(
                args.db, args.runs, workers, args.concurrency, probe=cpu_probe, loop=workers == 0
            )
            (t0, w0, p0), (t1, w1, p1) = row["probe"]
            base = base or row["per_s"]
            table.add_row(
                "a loop, 1 process" if workers == 0 else f"{workers} worker(s)",
                f"{row['elapsed']:.1f}",
                f"{row['per_s']:.0f}",
                f"{row['per_s'] / base:.2f}",
                f"{cpu_spent(w0, w1) / (t1 - t0):.2f}",
                f"{cpu_spent(p0, p1) / (t1 - t0):.2f}",
                "-" if workers == 0 else f"{row['submitted']:.1f}",
                f"{row['counted']} ({row['distinct']} distinct)",
            )
        console.print(table)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--db", default=os.environ.get("LANGGRAPH_FENCE_PG_URL", DEFAULT_URL))
    parser.add_argument("--latency-runs", type=int, default=30)
    parser.add_argument("--poll-interval", type=float, default=1.0)
    parser.add_argument("--runs", type=int, default=1000)
    parser.add_argument("--workers", type=int, nargs="+", default=[1, 2, 4])
    parser.add_argument("--concurrency", type=int, default=8)
    parser.add_argument("--loop-child", metavar="SCHEMA", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.loop_child:
        asyncio.run(loop_child(args.db, args.loop_child, args.runs, args.concurrency))
        return 0
    asyncio.run(amain(args))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

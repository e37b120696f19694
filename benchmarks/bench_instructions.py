"""What the fence costs a run in instructions: ``bench_runs.py``'s ``sql`` and ``fenced``
targets under callgrind, which counts instructions, not seconds, so other load on the box
does not move the figures (run to run they agree within about 0.2 %).

    python benchmarks/bench_instructions.py [--runs 30] [--only sqlite|postgresql] [--pg URL]
        [--targets memory official plain] [--durability sync async exit]

Needs valgrind (``apt-get install valgrind``) and the ``bench`` extra. For each database,
graph (linear-10, fanout-8) and durability (sync, async, exit), one process per target
(``sql`` and ``fenced``, and any of ``--targets``: ``memory``, ``official``, ``plain``) runs
5 warm-up runs, then ``--runs`` counted ones with callgrind's instrumentation switched on
(``callgrind_control -i on``) only around them; printed: thousands of instructions (kIr)
per run in this process (the database server's are not in it), and sql / fenced: the
share of a fenced run the unfenced one would cost. Slow (callgrind runs Python about 50
times slower): about 15 minutes for both databases at the default (sql and fenced).
"""

from __future__ import annotations

import argparse
import asyncio
import os
import subprocess
import sys
import tempfile
import time
from contextlib import AsyncExitStack
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(HERE.parent))

from bench_runs import postgres_targets, sqlite_targets  # noqa: E402
from bench_savers import DEFAULT_PG  # noqa: E402

DURABILITIES = ("sync", "async", "exit")
CELLS = [(shape, durability) for shape in ("linear", "fanout") for durability in DURABILITIES]
TARGETS = ("memory", "official", "sql", "fenced", "plain")


def _wait_for(path: Path) -> None:
    # The two processes meet at files: the child is under valgrind, which counts every
    # instruction it runs, so it waits by polling, not in a loop of its own.
    while not path.exists():
        time.sleep(0.05)


async def _child(db: str, pg: str, shape: str, durability: str, target: str, runs: int) -> None:
    meet = Path(os.environ["LGF_CALLGRIND_MEET"])
    async with AsyncExitStack() as stack:
        if db == "sqlite":
            folder = Path(stack.enter_context(tempfile.TemporaryDirectory()))
            _, targets = await stack.enter_async_context(sqlite_targets(folder))
        else:
            _, targets = await stack.enter_async_context(postgres_targets(pg))
        chosen = {t.name: t for t in targets}[target]
        graph = chosen.graph(shape)
        for _ in range(5):
            await chosen.run(graph, durability)
        (meet / "ready").touch()
        _wait_for(meet / "on")
        for _ in range(runs):
            await chosen.run(graph, durability)
        (meet / "done").touch()
        _wait_for(meet / "off")


def _count(db: str, pg: str, shape: str, durability: str, target: str, runs: int) -> float:
    """Thousands of instructions per counted run of ``target``."""
    with tempfile.TemporaryDirectory() as folder:
        meet = Path(folder)
        out = meet / "callgrind.out"
        env = {**os.environ, "LGF_CALLGRIND_MEET": folder, "PYTHONHASHSEED": "0"}
        command = [
            "valgrind",
            "--tool=callgrind",
            "--instr-atstart=no",
            f"--callgrind-out-file={out}",
            sys.executable,
            __file__,
            "--child",
            db,
            shape,
            durability,
            target,
            "--runs",
            str(runs),
            "--pg",
            pg,
        ]
        log = meet / "valgrind.log"
        child = subprocess.Popen(command, env=env, stdout=subprocess.DEVNULL, stderr=log.open("w"))
        try:
            for reached, switch in (("ready", "on"), ("done", "off")):
                _wait_for(meet / reached)
                subprocess.run(
                    ["callgrind_control", "-i", switch, str(child.pid)],
                    check=True,
                    stdout=subprocess.DEVNULL,
                )
                (meet / switch).touch()
            if child.wait(timeout=600) != 0:
                raise RuntimeError(
                    f"{' '.join(command)} exited {child.returncode}:\n{log.read_text()}"
                )
        finally:
            if child.poll() is None:
                child.kill()
        totals = next(line for line in out.read_text().splitlines() if line.startswith("totals:"))
        return int(totals.split()[1]) / runs / 1000


def main() -> None:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--runs", type=int, default=30)
    parser.add_argument("--only", choices=["sqlite", "postgresql"])
    parser.add_argument("--pg", default=os.environ.get("LANGGRAPH_FENCE_PG_URL", DEFAULT_PG))
    parser.add_argument(
        "--targets",
        nargs="+",
        choices=TARGETS,
        default=["sql", "fenced"],
        help="bench_runs.py's targets to count (sql and fenced always)",
    )
    parser.add_argument("--durability", nargs="+", choices=["sync", "async", "exit"])
    parser.add_argument("--child", nargs=4, metavar=("DB", "SHAPE", "DURABILITY", "TARGET"))
    args = parser.parse_args()
    if args.child:
        asyncio.run(_child(*args.child[:1], args.pg, *args.child[1:], runs=args.runs))
        return
    targets = [t for t in TARGETS if t in {"sql", "fenced", *args.targets}]
    others = [t for t in targets if t not in ("sql", "fenced")]
    print(
        "| db | graph | durability | "
        + " | ".join(f"{t} kIr/run" for t in targets)
        + " | fenced - sql | sql/fenced | "
        + " | ".join(f"{t}/fenced" for t in others)
        + " |"
    )
    print("|---|---|---|" + "--:|" * (len(targets) + 2 + len(others)))
    cells = [c for c in CELLS if args.durability is None or c[1] in args.durability]
    for db in [args.only] if args.only else ["sqlite", "postgresql"]:
        for shape, durability in cells:
            counts = {t: _count(db, args.pg, shape, durability, t, args.runs) for t in targets}
            fenced, sql = counts["fenced"], counts["sql"]
            print(
                f"| {db} | {shape} | {durability} | "
                + " | ".join(f"{counts[t]:,.0f}" for t in targets)
                + f" | {fenced - sql:,.0f} | {sql / fenced:.3f} | "
                + " | ".join(f"{counts[t] / fenced:.3f}" for t in others)
                + " |",
                flush=True,
            )


if __name__ == "__main__":
    main()

"""Store throughput beside the official ``AsyncPostgresStore``, and the window of
``FencedStore`` over a foreign store.

    python benchmarks/bench_store.py [--ops 300] [--rounds 5] [--pg URL]

Stores, in ONE process, taking turns round by round (rotating order):

* ``official``: ``AsyncPostgresStore`` (psycopg, one connection, autocommit);
* ``fenced official``: ``FencedStore(AsyncPostgresStore)`` with every put made inside a
  fenced step: one lease read, then the delegated write;
* ``sql pg`` / ``sql sqlite``: ``SqlStore`` written from outside any step (unfenced);
* ``fenced sql pg`` / ``fenced sql sqlite``: ``FencedStore(SqlStore)`` inside a fenced step:
  the token is checked inside the put's own statement.

Each round makes ``--ops`` puts (new keys), then as many gets, then ``--ops / 10`` searches
with a filter (page of 10) over the round's items. Reported: operations per second from the
median round, per kind of op. The window of ``FencedStore`` over a foreign store (a take-over
committed after the lease read is not seen until the delegated write is over) is measured
put by put: from the end of the lease read to the end of the inner write, p50 / p99 / max.
Needs the ``bench`` extra (``pip install -e '.[bench]'``).
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import tempfile
import time
import urllib.parse
import uuid
from collections.abc import Iterator
from contextlib import AsyncExitStack, contextmanager
from pathlib import Path
from typing import Any

from langgraph.store.base import BaseStore, Result
from langgraph.store.memory import InMemoryStore
from langgraph.store.postgres import AsyncPostgresStore
from sqlalchemy import text

from langgraph_fence import Effect, FencedStore, LeaseKey, SqlLeaseRepository
from langgraph_fence.checkpointers import SqlStore
from langgraph_fence.database import create_engine, schema_options
from langgraph_fence.fence import ExecutionFence, RunHandle
from langgraph_fence.steps.context import ExecutionContext, reset_frame, set_frame

DEFAULT_PG = "postgresql://postgres@127.0.0.1:5432/test"
TTL = 600.0


class Timed(BaseStore):
    """A foreign store that records when each of its writes ended (for the window)."""

    def __init__(self, inner: BaseStore) -> None:
        self.inner = inner
        self.ended: list[float] = []

    def batch(self, ops: Any) -> list[Result]:
        raise NotImplementedError

    async def abatch(self, ops: Any) -> list[Result]:
        result = await self.inner.abatch(list(ops))
        self.ended.append(time.perf_counter())
        return result


class TimedRepo:
    """Wraps a lease repository's ``get`` to record when each lease read ended."""

    def __init__(self, repo: SqlLeaseRepository) -> None:
        self.repo = repo
        self.ended: list[float] = []
        original = repo.get

        async def get(key: LeaseKey) -> Any:
            lease = await original(key)
            self.ended.append(time.perf_counter())
            return lease

        repo.get = get  # type: ignore[method-assign]


@contextmanager
def in_step(handle: RunHandle) -> Iterator[None]:
    """Make the calls inside run as one fenced step of ``handle``'s run."""
    frame = ExecutionContext(
        fence=ExecutionFence(handle),
        node="bench",
        task_id=uuid.uuid4().hex,
        attempt=1,
        checkpoint_ns="",
        thread_id=handle.key.execution_id,
        effect=Effect.READ_ONLY,
        _handle=handle,
    )
    token = set_frame(frame)
    try:
        yield
    finally:
        reset_frame(token)


async def one_round(store: BaseStore, handle: RunHandle | None, ops: int) -> dict[str, float]:
    ns = ("bench", uuid.uuid4().hex[:12])
    timings: dict[str, float] = {}
    with in_step(handle) if handle is not None else _nothing():
        start = time.perf_counter()
        for i in range(ops):
            await store.aput(ns, f"k{i}", {"i": i, "kind": "even" if i % 2 == 0 else "odd"})
        timings["put"] = ops / (time.perf_counter() - start)
    start = time.perf_counter()
    for i in range(ops):
        await store.aget(ns, f"k{i}")
    timings["get"] = ops / (time.perf_counter() - start)
    searches = max(1, ops // 10)
    start = time.perf_counter()
    for i in range(searches):
        await store.asearch(ns, filter={"kind": "even"}, limit=10, offset=i % 5 * 10)
    timings["search"] = searches / (time.perf_counter() - start)
    return timings


@contextmanager
def _nothing() -> Iterator[None]:
    yield


def percentile(values: list[float], p: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(p * len(ordered)))]


async def main(ops: int, rounds: int, pg: str) -> None:
    schema = f"lgf_bench_store_{uuid.uuid4().hex[:8]}"
    admin = create_engine(pg)
    async with admin.connect() as conn:
        await conn.execute(text(f'CREATE SCHEMA "{schema}"'))
    tmp = Path(tempfile.mkdtemp())
    try:
        async with AsyncExitStack() as stack:
            pg_engine = create_engine(pg, **schema_options(schema))
            lite_engine = create_engine(f"sqlite+aiosqlite:///{tmp / 'bench.db'}")
            stack.push_async_callback(pg_engine.dispose)
            stack.push_async_callback(lite_engine.dispose)
            options = urllib.parse.quote(f"-csearch_path={schema}")
            official = await stack.enter_async_context(
                AsyncPostgresStore.from_conn_string(f"{pg}?options={options}")
            )
            await official.setup()
            handles: dict[str, RunHandle] = {}
            repos: dict[str, TimedRepo] = {}
            sql: dict[str, SqlStore] = {}
            for name, engine in (("pg", pg_engine), ("sqlite", lite_engine)):
                repo = SqlLeaseRepository(engine)
                await repo.setup()
                lease = await repo.acquire(LeaseKey("bench", uuid.uuid4().hex), "bench", TTL)
                assert lease is not None
                handles[name] = RunHandle(repo, lease, TTL)
                repos[name] = TimedRepo(repo)
                sql[name] = SqlStore(engine)
                await sql[name].setup()
            timed_official = Timed(official)
            timed_memory = Timed(InMemoryStore())
            stores: dict[str, tuple[BaseStore, RunHandle | None]] = {
                "official": (official, None),
                "fenced official": (FencedStore(timed_official), handles["pg"]),
                "sql pg": (sql["pg"], None),
                "fenced sql pg": (FencedStore(sql["pg"]), handles["pg"]),
                "sql sqlite": (sql["sqlite"], None),
                "fenced sql sqlite": (FencedStore(sql["sqlite"]), handles["sqlite"]),
                "fenced memory": (FencedStore(timed_memory), handles["pg"]),
            }
            results: dict[str, list[dict[str, float]]] = {name: [] for name in stores}
            names = list(stores)
            for r in range(rounds + 1):
                order = names[r % len(names) :] + names[: r % len(names)]
                for name in order:
                    store, handle = stores[name]
                    timings = await one_round(store, handle, ops)
                    if r:  # the first round warms up
                        results[name].append(timings)
            print(
                f"{ops} puts, {ops} gets, {max(1, ops // 10)} searches per round; {rounds} rounds"
            )
            print(f"{'store':<20}{'put/s':>10}{'get/s':>10}{'search/s':>10}")
            for name in names:
                row = [
                    statistics.median(t[k] for t in results[name]) for k in ("put", "get", "search")
                ]
                print(f"{name:<20}" + "".join(f"{v:>10.0f}" for v in row))
            # The window: lease read ended -> inner write ended, write by write.
            reads = repos["pg"].ended
            for name, timed in (("official", timed_official), ("memory", timed_memory)):
                windows = [(end - max(r for r in reads if r <= end)) * 1000 for end in timed.ended]
                print(
                    f"window over {name}: p50 {percentile(windows, 0.5):.3f} ms, "
                    f"p99 {percentile(windows, 0.99):.3f} ms, max {max(windows):.3f} ms "
                    f"({len(windows)} writes)"
                )
    finally:
        async with admin.connect() as conn:
            await conn.execute(text(f'DROP SCHEMA IF EXISTS "{schema}" CASCADE'))
        await admin.dispose()


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ops", type=int, default=300)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--pg", default=DEFAULT_PG)
    args = parser.parse_args()
    asyncio.run(main(args.ops, args.rounds, args.pg))

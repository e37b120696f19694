"""A failover of replicated PostgreSQL repeats nothing and issues no token twice (issue 38).

Each round builds a primary and a streaming standby of its own (``tests/support/pg_replica.py``;
never the shared server) and runs instances on them through the libpq multi-host URL. The
charge step writes through the exactly-once sink on ANOTHER database (the shared server, a
schema of the test's own), which records every token it accepted: the external system that
checks tokens. Then, with random timing and shape:

* executions finish before anything happens (replicated);
* A runs execution X (and maybe Y) into its first step and freezes;
* asynchronous: replication is cut. A's lease expires; B takes X over at token 2 and stamps
  and makes the charge: on the primary only (the sink, elsewhere, keeps the charge and its
  token). Maybe B also runs a new turn of a finished thread W: token 2, charged, lost too;
* the primary is killed, the standby promoted; the workers reconnect through the URL;
* A thaws, B goes on, a new instance C serves.

Under ``on_failover="quarantine"``: X (and Y) are dead-lettered with the failover named, the
charge B made is not made again, and the tokens the sink saw rise strictly for every
thread: W's next turn runs at the new timeline's first token, above the lost 2. With
synchronous replication and ``"trust"``: nothing is quarantined, B's takeover survived the
failover and finishes X, nothing is charged twice.
"""

from __future__ import annotations

import asyncio
import operator
import random
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Annotated, Any, TypedDict

import pytest
import sqlalchemy as sa
from langgraph.graph import END, START, StateGraph
from sqlalchemy.ext.asyncio import AsyncEngine

from langgraph_fence import (
    Effect,
    ExecutionLeaseLostError,
    Instance,
    LeaseKey,
    LeaseStatus,
    SqlLeaseRepository,
    fence_graph,
    get_execution_context,
)
from langgraph_fence.database import create_engine, transaction
from langgraph_fence.lease.timeline import TIMELINE_SPAN, token_parts
from langgraph_fence.sinks import fenced_write, setup_sink
from langgraph_fence.testing import Leases, open_leases
from tests.support.databases import pg_engine_options, unique
from tests.support.failover_graphs import (
    CALLS,
    HOLD_DIR_ENV,
    SHOP_GRAPH,
    SINK_SCHEMA_ENV,
    SINK_URL_ENV,
)
from tests.support.pg_cluster import find_bindir
from tests.support.pg_replica import ReplicatedPair
from tests.support.polling import eventually
from tests.support.processes import Started, start_worker, stop_process

pytestmark = [pytest.mark.chaos, pytest.mark.postgres]

TENANT = "acme"
DEADLINE = 60.0  # any one step, on a loaded 2-core box
ROUNDS = 10
SYNCHRONOUS_ROUNDS = 4
SHOP_GRAPHS = "tests.support.failover_graphs:shop_graphs"
_SETTLED = (LeaseStatus.DONE, LeaseStatus.DEAD_LETTERED)


_CALL = sa.text(
    "INSERT INTO calls (thread, run, token, holder) VALUES (:thread, :run, :token, :holder)"
)
_RECEIPT = sa.text(
    "INSERT INTO charges (thread, run, token, holder) VALUES (:thread, :run, :token, :holder)"
)


class Order(TypedDict, total=False):
    run: int
    log: Annotated[list[str], operator.add]


@dataclass
class Hold:
    inside: asyncio.Event = field(default_factory=asyncio.Event)
    go: asyncio.Event = field(default_factory=asyncio.Event)


class Shop:
    """prepare (read-only) then charge (a non-idempotent write through the sink, on the
    other database); a step can be held for one instance and thread."""

    def __init__(self, sink: AsyncEngine) -> None:
        self.sink = sink
        self.holds: dict[tuple[str, str, str], Hold] = {}

    def hold(self, instance: str, thread: str, node: str) -> Hold:
        made = self.holds[(instance, thread, node)] = Hold()
        return made

    async def _held(self, instance: str, node: str) -> None:
        hold = self.holds.get((instance, get_execution_context().thread_id, node))
        if hold is not None:
            hold.inside.set()
            await hold.go.wait()

    def graph(self, instance: Instance) -> Any:
        name = instance.instance_id

        async def prepare(state: Order) -> dict[str, Any]:
            await self._held(name, "prepare")
            return {"log": [f"prepared by {name}"]}

        async def charge(state: Order) -> dict[str, Any]:
            context = get_execution_context()
            fence = context.fence
            row = {
                "thread": context.thread_id,
                "run": state["run"],
                "token": fence.token,
                "holder": name,
            }
            # The payment API's call: not idempotent, every call counts.
            async with self.sink.connect() as conn:
                await conn.execute(_CALL, row)
            # Its receipt through the exactly-once sink, which checks the token.
            async with transaction(self.sink) as conn:
                key = f"charge:{context.thread_id}:{state['run']}"
                async with fenced_write(conn, fence, key) as write:
                    if not write.applied:
                        await conn.execute(_RECEIPT, row)
                        write.record(fence.token)
            await self._held(name, "charge")
            return {"log": [f"charged by {name} at token {fence.token}"]}

        builder = StateGraph(Order)
        builder.add_node("prepare", prepare)
        builder.add_node("charge", charge)
        builder.add_edge(START, "prepare")
        builder.add_edge("prepare", "charge")
        builder.add_edge("charge", END)
        effects = {"prepare": Effect.READ_ONLY, "charge": Effect.NON_IDEMPOTENT_WRITE}
        return fence_graph(builder, effects=effects).compile(
            checkpointer=instance.checkpointer, name="shop"
        )


@pytest.fixture
async def sink(own_schema: tuple[str, str]) -> AsyncIterator[AsyncEngine]:
    url, schema = own_schema
    engine = create_engine(url, **pg_engine_options(schema))
    await setup_sink(engine)
    async with engine.connect() as conn:
        for table in ("calls", "charges"):
            await conn.execute(
                sa.text(
                    f"CREATE TABLE {table} (id BIGSERIAL PRIMARY KEY, thread TEXT NOT NULL, "
                    "run INTEGER NOT NULL, token BIGINT NOT NULL, holder TEXT NOT NULL)"
                )
            )
    try:
        yield engine
    finally:
        await engine.dispose()


def config(thread: str) -> Any:
    return {"configurable": {"thread_id": thread}}


async def rows_of(sink: AsyncEngine, table: str, threads: list[str]) -> list[Any]:
    async with sink.connect() as conn:
        rows = await conn.execute(
            sa.text(
                f"SELECT thread, run, token, holder FROM {table} WHERE thread = ANY(:threads) "
                "ORDER BY id"
            ),
            {"threads": threads},
        )
        return list(rows)


@dataclass
class Round:
    """What one round did and found."""

    quarantined: set[str]
    statuses: dict[str, LeaseStatus]
    #: The payment API's calls, and the receipts the sink accepted: (thread, run, token,
    #: holder), in the order they committed.
    called: list[Any]
    charged: list[Any]
    shape: dict[str, object]


async def run_round(sink: AsyncEngine, seed: int, *, synchronous: bool, on_failover: str) -> Round:
    rng = random.Random(seed)
    bindir = find_bindir()
    assert bindir is not None
    pair = await asyncio.to_thread(ReplicatedPair.create, bindir, synchronous=synchronous)
    threads = {name: unique(name) for name in ("D", "W", "X", "Y", "N")}
    with_y = rng.random() < 0.5
    b_inside_at_kill = rng.random() < 0.5
    w_lost_turn = rng.random() < 0.5
    shape = {"Y": with_y, "B inside charge": b_inside_at_kill, "W lost turn": w_lost_turn}
    try:
        async with open_leases(pair.url, on_failover=on_failover) as leases:  # type: ignore[arg-type]
            shop = Shop(sink)
            a, b = leases.instance("A"), leases.instance("B")
            for name in ("D", "W"):
                await a.ainvoke(shop.graph(a), {"run": 1}, config(threads[name]), tenant_id=TENANT)
            in_flight = ["X", "Y"] if with_y else ["X"]
            holds = {name: shop.hold("A", threads[name], "prepare") for name in in_flight}
            runs_a = [
                asyncio.create_task(
                    a.ainvoke(shop.graph(a), {"run": 1}, config(threads[name]), tenant_id=TENANT)
                )
                for name in in_flight
            ]
            for hold in holds.values():
                await asyncio.wait_for(hold.inside.wait(), DEADLINE)
            await asyncio.to_thread(pair.caught_up)
            if not synchronous:
                await asyncio.to_thread(pair.cut)
            leases.stall(a)
            leases.advance(31.0)  # past A's 30 s lease, by the store's clock

            # B takes X over and charges it: on the primary only, when replication is cut.
            b_hold = shop.hold("B", threads["X"], "charge") if b_inside_at_kill else None
            if with_y:
                shop.hold("B", threads["Y"], "prepare")  # B takes Y too, and waits in it
            stop = asyncio.Event()
            serve_b = asyncio.create_task(
                b.serve(
                    {"shop": shop.graph(b)}, poll_interval=0.02, stop=stop, handle_signals=False
                )
            )
            x_key = LeaseKey(TENANT, threads["X"])
            if b_hold is not None:
                await asyncio.wait_for(b_hold.inside.wait(), DEADLINE)
            else:
                await until(leases, x_key, LeaseStatus.DONE)
            if w_lost_turn:
                await b.ainvoke(shop.graph(b), {"run": 2}, config(threads["W"]), tenant_id=TENANT)
            await asyncio.sleep(rng.uniform(0.0, 0.05))  # random timing of the kill

            await asyncio.to_thread(pair.fail_over)
            assert await asyncio.to_thread(pair.timeline) == 2

            # B goes on (its connections died; its retries reach the promoted server), A
            # thaws, and a new instance C serves whatever is left.
            if b_hold is not None:
                b_hold.go.set()
            for hold in shop.holds.values():
                hold.go.set()
            leases.resume(a)
            outcomes = await asyncio.wait_for(
                asyncio.gather(*runs_a, return_exceptions=True), DEADLINE
            )
            for outcome in outcomes:
                if isinstance(outcome, BaseException):
                    assert isinstance(outcome, ExecutionLeaseLostError), outcome
            stop.set()
            await asyncio.wait_for(serve_b, DEADLINE)

            c = leases.instance("C")
            stop_c = asyncio.Event()
            serve_c = asyncio.create_task(
                c.serve(
                    {"shop": shop.graph(c)}, poll_interval=0.02, stop=stop_c, handle_signals=False
                )
            )
            try:
                # New work after the failover: tokens of the new timeline.
                n_out = await c.ainvoke(
                    shop.graph(c), {"run": 1}, config(threads["N"]), tenant_id=TENANT
                )
                assert n_out["log"][-1].startswith("charged by C at token ")
                await c.ainvoke(shop.graph(c), {"run": 3}, config(threads["W"]), tenant_id=TENANT)
                keys = [LeaseKey(TENANT, threads[n]) for n in ("D", "W", *in_flight, "N")]
                for key in keys:
                    await until(leases, key, *_SETTLED)
            finally:
                stop_c.set()
                await asyncio.wait_for(serve_c, DEADLINE)

            statuses: dict[str, LeaseStatus] = {}
            for name in ("D", "W", *in_flight, "N"):
                lease = await leases.store.get(LeaseKey(TENANT, threads[name]))
                assert lease is not None
                statuses[name] = lease.status
            store = leases.store
            assert isinstance(store, SqlLeaseRepository)
            quarantined = {
                q.key.execution_id for report in store.failovers for q in report.quarantined
            }
            for name in in_flight:
                lease = await store.get(LeaseKey(TENANT, threads[name]))
                assert lease is not None
                if lease.status is LeaseStatus.DEAD_LETTERED:
                    assert lease.reason is not None
                    assert "after a database failover (timeline 1 to 2)" in lease.reason
            by_name = {v: k for k, v in threads.items()}
            found = {
                table: [
                    (by_name[r.thread], r.run, r.token, r.holder)
                    for r in await rows_of(sink, table, list(threads.values()))
                ]
                for table in ("calls", "charges")
            }
            return Round(
                quarantined={by_name[e] for e in quarantined if e in by_name},
                statuses=statuses,
                called=found["calls"],
                charged=found["charges"],
                shape=shape,
            )
    finally:
        await asyncio.to_thread(pair.remove)


async def until(leases: Leases, key: LeaseKey, *statuses: LeaseStatus) -> None:
    async def reached() -> bool:
        lease = await leases.store.get(key)
        return lease is not None and lease.status in statuses

    await eventually(reached, timeout=DEADLINE, what=f"{key.scope_key} to reach {statuses}")


def assert_nothing_repeated_and_tokens_rise(found: Round) -> None:
    """The payment API called at most once per (thread, run); the tokens the sink accepted
    rise strictly for each thread (a token issued twice shows as one accepted twice)."""
    calls = [(thread, run) for thread, run, _token, _holder in found.called]
    assert len(calls) == len(set(calls)), f"a charge was made twice: {found}"
    seen: dict[tuple[str, int], int] = {}
    last: dict[str, int] = {}
    for thread, run, token, _holder in found.charged:
        seen[(thread, run)] = token
        assert token > last.get(thread, 0), f"{thread}: token {token} accepted again: {found}"
        last[thread] = token
    # Every turn that ran to its end charged: D, N, W's first and last, X (by B).
    for must in (("D", 1), ("N", 1), ("W", 1), ("W", 3), ("X", 1)):
        assert must in seen, f"{must} never charged: {found}"
    # Work after the failover ran at tokens of the new timeline.
    assert token_parts(seen[("N", 1)])[0] == 2
    assert seen[("W", 3)] > TIMELINE_SPAN


async def test_an_asynchronous_failover_quarantines_and_repeats_nothing(
    sink: AsyncEngine,
) -> None:
    base = random.randrange(1_000_000)
    quarantined_total = 0
    for seed in range(base, base + ROUNDS):
        found = await run_round(sink, seed, synchronous=False, on_failover="quarantine")
        assert_nothing_repeated_and_tokens_rise(found)
        in_flight = {"X", "Y"} if found.shape["Y"] else {"X"}
        # X's takeover and charge were lost with the primary: X is quarantined, named.
        assert found.quarantined == in_flight, (seed, found)
        for name in in_flight:
            assert found.statuses[name] is LeaseStatus.DEAD_LETTERED, (seed, found)
        for name in ("D", "W", "N"):
            assert found.statuses[name] is LeaseStatus.DONE, (seed, found)
        # B's charge of X is the only one: the takeover after the failover did not repeat it.
        assert [c for c in found.charged if c[0] == "X"] == [("X", 1, 2, "B")], (seed, found)
        quarantined_total += len(found.quarantined)
    assert quarantined_total >= ROUNDS


async def test_a_synchronous_failover_under_trust_quarantines_nothing(sink: AsyncEngine) -> None:
    base = random.randrange(1_000_000)
    for seed in range(base, base + SYNCHRONOUS_ROUNDS):
        found = await run_round(sink, seed, synchronous=True, on_failover="trust")
        assert_nothing_repeated_and_tokens_rise(found)
        assert found.quarantined == set(), (seed, found)
        assert set(found.statuses.values()) == {LeaseStatus.DONE}, (seed, found)
        # B's takeover was replicated before the primary died: B finished X, once.
        assert [c[:3] for c in found.charged if c[0] == "X"] == [("X", 1, 2)], (seed, found)


async def test_trust_on_asynchronous_replication_repeats_the_lost_charge(
    sink: AsyncEngine,
) -> None:
    """Why ``"trust"`` is for synchronous replication only: on the asynchronous round the
    charge B made on the lost timeline is made a second time after the failover."""
    found = await run_round(
        sink, random.randrange(1_000_000), synchronous=False, on_failover="trust"
    )
    assert found.quarantined == set()
    assert [c[0] for c in found.called].count("X") == 2, found


async def test_a_url_that_names_the_standby_first_lands_on_the_primary() -> None:
    bindir = find_bindir()
    assert bindir is not None
    pair = await asyncio.to_thread(ReplicatedPair.create, bindir)
    try:
        standby_first = (
            f"postgresql://postgres@127.0.0.1:{pair.standby.port},"
            f"127.0.0.1:{pair.primary.port}/postgres"
        )
        async with open_leases(standby_first) as leases:
            lease = await leases.store.acquire(LeaseKey(TENANT, unique("k")), "A", 30.0)
            assert lease is not None
            async with leases.engine.connect() as conn:
                port = (await conn.execute(sa.text("SELECT inet_server_port()"))).scalar_one()
            assert port == pair.primary.port
    finally:
        await asyncio.to_thread(pair.remove)


async def test_worker_processes_carry_on_through_a_failover(
    own_schema: tuple[str, str], tmp_path: Path
) -> None:
    """The path users take: `langgraph-fence worker --db <multi-host URL>` processes, runs
    submitted from a client, the replication cut while some are in flight, the primary
    killed and the standby promoted. The workers reconnect and serve what comes after; what
    was in flight is quarantined, named; no charge is made twice."""
    sink_url, sink_schema = own_schema
    sink = create_engine(sink_url, **pg_engine_options(sink_schema))
    async with sink.connect() as conn:
        await conn.execute(sa.text(CALLS))
    bindir = find_bindir()
    assert bindir is not None
    pair = await asyncio.to_thread(ReplicatedPair.create, bindir)
    holds = tmp_path / "holds"
    holds.mkdir()
    env = {SINK_URL_ENV: sink_url, SINK_SCHEMA_ENV: sink_schema, HOLD_DIR_ENV: str(holds)}
    workers: list[Started] = []
    rng = random.Random()
    try:
        async with Instance.open(pair.url, journal=False) as client:
            for n in (1, 2):
                workers.append(
                    await start_worker(
                        tmp_path, f"w{n}", pair.url, "", SHOP_GRAPHS, ttl=3.0, poll=0.1,
                        extra=["--concurrency", "4"], env=env,
                    )
                )  # fmt: skip
            before = [unique("before") for _ in range(12)]
            held = before[0]  # in flight across the failover, whatever the timing
            (holds / held).touch()
            for thread in before:
                await client.submit(SHOP_GRAPH, {"log": []}, config(thread), tenant_id=TENANT)

            async def some_done_one_held() -> bool:
                done = [await finished(client, thread) for thread in before]
                return sum(done) >= 3 and (holds / f"{held}.inside").exists()

            await eventually(some_done_one_held, timeout=DEADLINE, what="a few runs done")
            await asyncio.to_thread(pair.cut)
            await asyncio.sleep(rng.uniform(0.0, 0.4))  # the runs go on, on the primary only
            await asyncio.to_thread(pair.fail_over)
            (holds / held).unlink()  # its worker goes on, on the promoted server

            after = [unique("after") for _ in range(3)]
            for thread in after:
                await client.submit(SHOP_GRAPH, {"log": []}, config(thread), tenant_id=TENANT)

            async def settled() -> bool:
                for thread in before + after:
                    lease = await client.repository.get(LeaseKey(TENANT, thread))
                    if lease is None or lease.status not in _SETTLED:
                        return False
                return True

            await eventually(settled, timeout=DEADLINE, what="every execution settled")
            leases = {
                thread: await client.repository.get(LeaseKey(TENANT, thread))
                for thread in before + after
            }
        for worker in workers:
            assert worker.returncode is None, worker.post_mortem()
        async with sink.connect() as conn:
            calls = [row.thread for row in await conn.execute(sa.text("SELECT thread FROM calls"))]
        assert len(calls) == len(set(calls)), f"a charge was made twice: {sorted(calls)}"
        # Served after the failover, through the multi-host URL.
        for thread in after:
            assert leases[thread].status is LeaseStatus.DONE  # type: ignore[union-attr]
            assert thread in calls
        quarantined = [
            thread
            for thread, lease in leases.items()
            if lease is not None and lease.status is LeaseStatus.DEAD_LETTERED
        ]
        # Each in flight when replication was cut is quarantined, the failover named; the
        # held one was, whatever the timing.
        assert held in quarantined
        for thread in quarantined:
            assert "after a database failover" in (leases[thread].reason or "")  # type: ignore[union-attr]
    finally:
        for worker in workers:
            await stop_process(worker, grace=10.0)
        await asyncio.to_thread(pair.remove)
        await sink.dispose()


async def finished(instance: Instance, thread: str) -> bool:
    lease = await instance.repository.get(LeaseKey(TENANT, thread))
    return lease is not None and lease.status is LeaseStatus.DONE

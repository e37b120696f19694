"""Sync steps are fenced as surely as async ones (issue 22).

LangGraph runs sync nodes and sync tools in worker threads. On the first version
``fence.confirm_now()`` in a sync node returned a coroutine nothing awaited: the strict
renewal never happened and the node went on to its call after a takeover. And the
exactly-once sink took only an async connection. Here, on real databases with real time:

* a sync node's ``confirm_now()`` renews on the run's loop (one round trip, seen in the
  lease row's expiry), and after a takeover raises ``ExecutionFencedError`` before its call;
* a sync node writing through ``fenced_write_sync`` on the user's own sync engine (stdlib
  sqlite3, psycopg), frozen past its lease and taken over: its write is refused, nothing of
  its transaction lands, and the new holder's write applies once.

Instance A runs the step and is frozen (its lease store and timers stop, as under SIGSTOP)
while instance B takes the execution over with ``serve()``.
"""

from __future__ import annotations

import asyncio
import operator
import threading
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Annotated, Any, TypedDict

import pytest
import sqlalchemy as sa
from langgraph.graph import END, START, StateGraph
from langgraph.types import RetryPolicy

from langgraph_fence import (
    Effect,
    ExecutionDeadLetteredError,
    ExecutionFencedError,
    ExecutionLeaseLostError,
    Instance,
    Lease,
    LeaseKey,
    LeaseStatus,
    fence_graph,
    fenced,
    get_execution_context,
)
from langgraph_fence.database import create_engine
from langgraph_fence.from_thread import run_on_loop
from langgraph_fence.lease.faults import StallableRepository
from langgraph_fence.sinks import fenced_write_sync, setup_sink
from langgraph_fence.testing import ManualClock
from tests.support.databases import Database, engine_options, sync_engine_for, unique
from tests.support.polling import eventually
from tests.support.stalls import TENANT, WAIT, invoke, lease_of, stallable


class Log(TypedDict):
    log: Annotated[list[str], operator.add]


def holder() -> str:
    return get_execution_context().fence._handle.lease.holder or ""


@dataclass
class Freeze:
    """Where A's sync step waits, in its worker thread, while the test freezes A."""

    reached: threading.Event = field(default_factory=threading.Event)
    go: threading.Event = field(default_factory=threading.Event)

    def hold_a(self) -> None:
        if holder() == "A":
            self.reached.set()
            if not self.go.wait(WAIT):
                raise TimeoutError("the test never let A go on")

    async def wait_reached(self) -> None:
        if not await asyncio.to_thread(self.reached.wait, WAIT):
            raise TimeoutError("A's step never reached its freeze")


def one_node_graph(instance: Instance, name: str, node: Any) -> Any:
    builder = StateGraph(Log)
    builder.add_node("step", node)
    builder.add_edge(START, "step")
    builder.add_edge("step", END)
    return builder.compile(checkpointer=instance.checkpointer, name=name)


async def take_over_with(b: Instance, graph: Any, thread: str) -> Lease:
    """B serves ``graph`` until the execution ``thread`` has ended."""
    stop = asyncio.Event()
    serving = asyncio.create_task(
        b.serve({graph.name: graph}, poll_interval=0.05, stop=stop, handle_signals=False)
    )

    async def ended() -> Lease | None:
        lease = await lease_of(b, thread)
        return lease if lease.status in (LeaseStatus.DONE, LeaseStatus.DEAD_LETTERED) else None

    try:
        return await eventually(ended, timeout=WAIT, what="B's takeover to end")
    finally:
        stop.set()
        await asyncio.wait_for(serving, WAIT)


# -- confirm_now() in a sync node


async def test_a_sync_node_confirming_after_a_takeover_is_fenced_before_its_call(
    database: Database,
) -> None:
    calls: list[tuple[str, int]] = []
    freeze = Freeze()

    @fenced
    def notify(state: Log) -> dict[str, list[str]]:
        freeze.hold_a()
        frame = get_execution_context()
        frame.fence.confirm_now()  # before a call that cannot check tokens
        calls.append((holder(), frame.fence.token))
        return {"log": ["notified"]}

    thread = unique("sync-confirm")
    async with stallable(database, "A") as (a, gate_a), stallable(database, "B") as (b, _):
        run_a = asyncio.create_task(
            invoke(a, one_node_graph(a, "sync_confirm", notify), {"log": []}, thread)
        )
        await freeze.wait_reached()
        gate_a.stall()  # SIGSTOP: A's renewals stop, its lease lapses
        lease = await take_over_with(b, one_node_graph(b, "sync_confirm", notify), thread)
        assert lease.status is LeaseStatus.DONE, lease
        gate_a.resume()  # SIGCONT: A wakes up inside its sync step
        freeze.go.set()
        with pytest.raises(ExecutionFencedError):
            await asyncio.wait_for(run_a, WAIT)
    assert calls == [("B", 2)]  # A's call never started


class CountingRenewals(StallableRepository):
    """The instance's lease store, counting the renewals sent to the database."""

    def __init__(self, inner: Any, gate: Any) -> None:
        super().__init__(inner, gate)
        self.renewals = 0

    async def renew(self, lease: Lease, ttl: float) -> Lease:
        self.renewals += 1
        return await super().renew(lease, ttl)


async def test_a_sync_node_confirming_with_the_lease_held_renews_in_one_round_trip(
    database: Database,
) -> None:
    seen: dict[str, Any] = {}
    thread = unique("sync-renew")
    # A long TTL: the instance's own renewals (every ttl/3) do not run during the step.
    async with stallable(database, "A", ttl=30.0) as (a, gate):
        store = a.repository
        assert isinstance(store, StallableRepository)
        counting = CountingRenewals(store.inner, gate)
        a.repository = counting
        loop = asyncio.get_running_loop()

        def row() -> Lease:
            found = run_on_loop(
                loop, lambda: counting.inner.get(LeaseKey(TENANT, thread)), what="t", on_loop="-"
            )
            assert found is not None
            return found

        @fenced
        def notify(state: Log) -> dict[str, list[str]]:
            fence = get_execution_context().fence
            before, renewals, until = row(), counting.renewals, fence.confirmed_until
            fence.confirm_now()
            seen.update(
                before=before,
                after=row(),
                renewals=counting.renewals - renewals,
                moved=fence.confirmed_until - until,
            )
            return {"log": ["notified"]}

        await invoke(a, one_node_graph(a, "sync_renew", notify), {"log": []}, thread)
    assert seen["renewals"] == 1
    before, after = seen["before"], seen["after"]
    assert after.epoch == before.epoch == 1
    assert after.holder == "A"
    assert after.expires_at > before.expires_at  # the row's expiry moved: the store renewed
    assert seen["moved"] > 0  # and the fence knows it


# -- the sync sink


@dataclass(frozen=True)
class Shop:
    """The user's own database, reached through a sync engine."""

    engine: sa.Engine

    def rows(self, table: str) -> list[tuple[Any, ...]]:
        with self.engine.connect() as conn:
            return [tuple(r) for r in conn.execute(sa.text(f"SELECT * FROM {table} ORDER BY 1"))]


@pytest.fixture
def shop(database: Database, tmp_path: Path) -> Iterator[tuple[Shop, str]]:
    """``(shop, async_url)``: the user's database with a sync engine, and its async URL."""
    if database.url.startswith("sqlite"):
        path = tmp_path / "shop.db"
        engine = sync_engine_for("sqlite", path)
        async_url = f"sqlite+aiosqlite:///{path}"
    else:
        engine = sync_engine_for("postgresql", database.url, database.schema)
        async_url = database.url
    with engine.begin() as conn:
        conn.execute(sa.text("CREATE TABLE audit (holder TEXT, token BIGINT)"))
        conn.execute(sa.text("CREATE TABLE charges (order_id TEXT, holder TEXT, token BIGINT)"))
    try:
        yield Shop(engine), async_url
    finally:
        engine.dispose()


@pytest.mark.parametrize("a_clock", ["frozen", "real"])
async def test_a_sync_write_stalled_past_its_lease_is_refused_and_lands_nothing(
    database: Database, shop: tuple[Shop, str], a_clock: str
) -> None:
    """frozen: A's sense of time stops too (the stall falls after its local check), so only
    the sink's high-water mark can refuse it. real: A's own fence already knows its hold ran
    out and refuses before any statement."""
    user_db, async_url = shop
    sink_engine = create_engine(async_url, **engine_options(async_url, database.schema))
    try:
        await setup_sink(sink_engine)
    finally:
        await sink_engine.dispose()
    freeze = Freeze()
    outcomes: dict[str, BaseException | str] = {}

    @fenced(effect=Effect.IDEMPOTENT_WRITE)
    def charge(state: Log) -> dict[str, list[str]]:
        freeze.hold_a()
        frame = get_execution_context()
        me = holder()
        try:
            with user_db.engine.begin() as conn:
                conn.execute(
                    sa.text("INSERT INTO audit VALUES (:h, :t)"), {"h": me, "t": frame.fence.token}
                )
                with fenced_write_sync(conn, frame.fence, "charge:o1") as write:
                    if not write.applied:
                        conn.execute(
                            sa.text("INSERT INTO charges VALUES ('o1', :h, :t)"),
                            {"h": me, "t": write.token},
                        )
                        write.record({"by": me})
        except BaseException as exc:
            outcomes[me] = exc
            raise
        outcomes[me] = "applied"
        return {"log": [me]}

    thread = unique("sync-sink")
    clock = ManualClock() if a_clock == "frozen" else None
    async with (
        stallable(database, "A", clock=clock) as (a, gate_a),
        stallable(database, "B") as (b, _),
    ):
        run_a = asyncio.create_task(
            invoke(a, one_node_graph(a, "sync_sink", charge), {"log": []}, thread)
        )
        await freeze.wait_reached()
        gate_a.stall()
        lease = await take_over_with(b, one_node_graph(b, "sync_sink", charge), thread)
        assert lease.status is LeaseStatus.DONE, lease
        # A goes on with its step while its lease store is still frozen: what refuses its
        # write is the sink (or A's own fence), not a renewal that woke first.
        freeze.go.set()
        await eventually(
            lambda: "A" in outcomes,
            timeout=WAIT,
            what="A's write to be refused",
        )
        gate_a.resume()
        with pytest.raises(ExecutionLeaseLostError):
            await asyncio.wait_for(run_a, WAIT)
    refused = outcomes["A"]
    if a_clock == "frozen":
        assert isinstance(refused, ExecutionFencedError), refused
        assert (refused.token_held, refused.token_seen) == (1, 2)
    else:
        assert isinstance(refused, ExecutionLeaseLostError), refused
    assert outcomes["B"] == "applied"
    assert user_db.rows("charges") == [("o1", "B", 2)]  # applied once, by the new holder
    assert user_db.rows("audit") == [("B", 2)]  # nothing of A's transaction landed


# -- sync write nodes stamp, clear and dead-letter as async ones do


def write_node(kind: str, seen: list[Lease], *, fail: bool, instance: Instance, thread: str) -> Any:
    """A ``NON_IDEMPOTENT_WRITE`` node of ``kind`` that records the lease row inside its body."""
    key = LeaseKey(TENANT, thread)

    def after_the_stamp(row: Lease | None) -> dict[str, list[str]]:
        assert row is not None
        seen.append(row)
        if fail:
            raise RuntimeError("the card network timed out")
        return {"log": ["charged"]}

    if kind == "async":

        @fenced(effect=Effect.NON_IDEMPOTENT_WRITE, name="step")
        async def charge(state: Log) -> dict[str, list[str]]:
            return after_the_stamp(await instance.repository.get(key))

        return charge
    loop = asyncio.get_running_loop()

    @fenced(effect=Effect.NON_IDEMPOTENT_WRITE, name="step")
    def charge_sync(state: Log) -> dict[str, list[str]]:
        row = run_on_loop(loop, lambda: instance.repository.get(key), what="read", on_loop="-")
        return after_the_stamp(row)

    return charge_sync


@pytest.mark.parametrize("kind", ["async", "sync"])
async def test_a_write_node_stamps_before_its_body_and_its_writes_clear_it(
    database: Database, kind: str
) -> None:
    seen: list[Lease] = []
    thread = unique(f"{kind}-stamp")
    async with stallable(database, "A") as (a, _):
        node = write_node(kind, seen, fail=False, instance=a, thread=thread)
        await invoke(a, one_node_graph(a, f"{kind}_stamp", node), {"log": []}, thread)
        after = await lease_of(a, thread)
    (during,) = seen
    assert [(e.node, e.token) for e in during.pending_effects] == [("step", 1)]
    assert after.status is LeaseStatus.DONE
    assert after.pending_effects == ()


@pytest.mark.parametrize("kind", ["async", "sync"])
async def test_a_failed_write_node_is_dead_lettered_not_retried(
    database: Database, kind: str
) -> None:
    seen: list[Lease] = []
    thread = unique(f"{kind}-dead")
    async with stallable(database, "A") as (a, _):
        node = write_node(kind, seen, fail=True, instance=a, thread=thread)
        builder = StateGraph(Log)
        builder.add_node("step", node, retry_policy=RetryPolicy(max_attempts=3))
        builder.add_edge(START, "step")
        builder.add_edge("step", END)
        graph = fence_graph(builder).compile(checkpointer=a.checkpointer, name=f"{kind}_dead")
        with pytest.raises(ExecutionDeadLetteredError, match="card network timed out"):
            await invoke(a, graph, {"log": []}, thread)
        lease = await lease_of(a, thread)
    assert len(seen) == 1  # the write ran once; the RetryPolicy did not repeat it
    assert lease.status is LeaseStatus.DEAD_LETTERED, lease

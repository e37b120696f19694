"""The keeper and admission control, on real databases (SQLite and PostgreSQL).

An instance renews every lease it holds with one keeper, batched; it takes on no more
executions than ``max_held``, refusing the next one before anything is written instead of
losing any; and a burst of starts does not starve the renewals of the runs it holds.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import gc
import operator
import sqlite3
import threading
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from typing import Annotated, Any, TypedDict

import pytest
import sqlalchemy.exc
from langgraph.graph import END, START, StateGraph
from sqlalchemy import event

from langgraph_fence import (
    EventKind,
    ExecutionLeaseLostError,
    FenceEvent,
    InstanceFullError,
    Lease,
    LeaseKey,
    LeaseStatus,
    fence_graph,
    get_execution_context,
)
from langgraph_fence.database import create_engine, schema_options
from langgraph_fence.events import Listeners
from langgraph_fence.execution.keeper import MAX_STARTING, Keeper
from langgraph_fence.fence import RunHandle, safety_margin
from langgraph_fence.instance import Instance
from langgraph_fence.lease.faults import StallableRepository, StallGate
from langgraph_fence.lease.sql import SqlLeaseRepository
from langgraph_fence.testing import Leases, ManualClock
from tests.support.databases import unique
from tests.support.polling import eventually

TENANT = "acme"


class Log(TypedDict, total=False):
    log: Annotated[list[str], operator.add]


class Waiting:
    """A graph whose one step waits (holding its lease) until ``go`` is set."""

    def __init__(self) -> None:
        self.entered = 0
        self.go = asyncio.Event()

    def graph(self, instance: Instance) -> Any:
        async def wait(state: Log) -> Log:
            self.entered += 1
            await self.go.wait()
            return {"log": ["done"]}

        return one_step(instance, wait, name="waiting")


def one_step(instance: Instance, step: Callable[[Log], Awaitable[Log]], *, name: str) -> Any:
    """A fenced graph of the one node ``step``, on ``instance``'s checkpointer."""
    builder: StateGraph[Log] = StateGraph(Log)
    builder.add_node(step.__name__, step)
    builder.add_edge(START, step.__name__)
    builder.add_edge(step.__name__, END)
    return fence_graph(builder).compile(checkpointer=instance.checkpointer, name=name)


def start(instance: Instance, graph: Any, thread: str) -> asyncio.Task[Any]:
    return asyncio.create_task(
        instance.ainvoke(
            graph, {"log": []}, {"configurable": {"thread_id": thread}}, tenant_id=TENANT
        )
    )


def losses(instance: Instance) -> list[FenceEvent]:
    lost: list[FenceEvent] = []

    def listen(event: FenceEvent) -> None:
        if event.kind in (EventKind.LOST, EventKind.FENCED):
            lost.append(event)

    instance.add_listener(listen)
    return lost


async def until(check: Callable[[], bool], within: float = 120.0) -> None:
    await eventually(check, timeout=within)


async def test_an_instance_at_its_limit_refuses_the_next_run_and_loses_none(
    database: Any,
) -> None:
    options = schema_options(database.schema or None)
    async with Instance.open(database.url, engine_options=options, max_held=2) as instance:
        lost = losses(instance)
        waiting = Waiting()
        graph = waiting.graph(instance)
        threads = [unique("held") for _ in range(3)]
        held = [start(instance, graph, t) for t in threads[:2]]
        await until(lambda: waiting.entered == 2, within=30.0)
        third_run = instance.ainvoke(
            graph, {"log": []}, {"configurable": {"thread_id": threads[2]}}, tenant_id=TENANT
        )
        with pytest.raises(InstanceFullError, match="max_held") as refused:
            await asyncio.wait_for(third_run, 30)  # admitted, it would wait in its step
        assert refused.value.code == "instance.full"
        # Refused before anything was written: no lease, no record, no thread binding.
        third = LeaseKey(TENANT, threads[2])
        assert await instance.repository.get(third) is None
        assert await instance.records.get(third) is None
        waiting.go.set()
        assert [r["log"] for r in await asyncio.gather(*held)] == [["done"], ["done"]]
        # A slot is free again: the refused run starts now.
        assert (await start(instance, graph, threads[2]))["log"] == ["done"]
    assert lost == []
    for thread in threads:
        lease = await _lease(database, LeaseKey(TENANT, thread))
        assert lease is not None
        assert lease.status is LeaseStatus.DONE


@pytest.fixture
def late_renewals(monkeypatch: pytest.MonkeyPatch) -> threading.Event:
    """An injected fault: every renewal statement of a ``SqlLeaseRepository`` is answered
    3.5 s late, until the event returned is set."""
    fast = threading.Event()
    renew_many = SqlLeaseRepository.renew_many

    async def late_renew_many(self: SqlLeaseRepository, leases: Any, ttl: float) -> Any:
        await asyncio.to_thread(fast.wait, 3.5)
        return await renew_many(self, leases, ttl)

    monkeypatch.setattr(SqlLeaseRepository, "renew_many", late_renew_many)
    return fast


@asynccontextmanager
async def renewed_every_second(database: Any) -> AsyncIterator[Instance]:
    """An instance at TTL 8 s renewed every second: a lease has 6.2 s of its window left
    when its renewal goes out on time; renewals in the thread, as ``Instance.open`` sets
    them up."""
    options = schema_options(database.schema or None)
    async with Instance.open(
        database.url, engine_options=options, lease_ttl=8.0, renew_interval=1.0
    ) as instance:
        assert instance.host.keeper.in_thread
        yield instance


async def test_while_renewals_run_late_a_new_run_waits_for_them_and_none_is_lost(
    database: Any, late_renewals: threading.Event
) -> None:
    """Below ``max_held`` too, an instance whose renewals come back late (3.5 s late of
    the 6.2 s left) takes on no new run: the next start waits, writing nothing, while the
    leases it holds are kept; once the renewals come back in time, it starts."""
    async with renewed_every_second(database) as instance:
        keeper = instance.host.keeper
        assert keeper.max_held == 3000  # derived: renewed every second, 3 000 leases a second
        lost = losses(instance)
        waiting = Waiting()
        graph = waiting.graph(instance)
        held = [start(instance, graph, unique("held")) for _ in range(5)]
        await until(lambda: waiting.entered == 5, within=60.0)
        await until(lambda: keeper.behind, within=30.0)
        thread = unique("deferred")
        deferred = start(instance, graph, thread)
        # One more late statement answered while the new run waits: it wrote nothing.
        answered = len(keeper.batches)
        await until(lambda: len(keeper.batches) > answered, within=30.0)
        assert keeper.behind
        assert not deferred.done()
        assert waiting.entered == 5
        assert await instance.repository.get(LeaseKey(TENANT, thread)) is None
        late_renewals.set()  # renewals answered at once again
        await until(lambda: waiting.entered == 6 or deferred.done(), within=30.0)
        assert not deferred.done(), deferred.exception()
        assert not keeper.behind
        waiting.go.set()
        results = await asyncio.gather(*held, deferred)
    assert [r["log"] for r in results] == [["done"]] * 6
    assert lost == []


async def test_the_last_run_ending_while_a_late_renewal_is_in_flight_holds_back_nothing(
    database: Any, late_renewals: threading.Event
) -> None:
    """Nothing held, nothing to fall behind with: a late renewal answered after the last
    run ended does not keep new runs out (else the instance would refuse every run for
    good, with no renewal left to clear it)."""
    async with renewed_every_second(database) as instance:
        keeper = instance.host.keeper
        waiting = Waiting()
        graph = waiting.graph(instance)
        first = start(instance, graph, unique("first"))
        await until(lambda: waiting.entered == 1, within=30.0)
        await until(lambda: keeper.behind, within=30.0)  # a renewal in flight, late
        answered = len(keeper.batches)
        waiting.go.set()
        assert (await first)["log"] == ["done"]
        assert not keeper.behind
        # The late renewal in flight for it is answered after its run ended.
        await until(lambda: len(keeper.batches) > answered, within=30.0)
        assert keeper.batches[-1].took >= 3.0
        assert not keeper.behind
        assert keeper.try_admit()  # serve() takes executions over again
        keeper.leave()
        second = start(instance, graph, unique("second"))
        await until(lambda: waiting.entered == 2 or second.done(), within=30.0)
        assert (await second)["log"] == ["done"]


async def _lease(database: Any, key: LeaseKey) -> Any:
    options = schema_options(database.schema or None)
    async with Instance.open(database.url, engine_options=options) as reader:
        return await reader.repository.get(key)


async def test_renewals_keep_their_deadline_while_200_runs_start_at_once(database: Any) -> None:
    """Runs already held keep being renewed in time while 200 more start together (each
    start binds, records, acquires and checkpoints on the same pool): no lease is lost, and
    every renewal statement went out, and was answered, while each of its leases was still
    confirmed held. At TTL 3 s on PostgreSQL; on SQLite every write of the process waits
    for the file's one lock, whose busy handler is not fair to a long waiter: a renewal
    there can wait as long as the burst lasts, so its TTL is 10 s."""
    options = schema_options(database.schema or None)
    ttl = 10.0 if database.url.startswith("sqlite") else 3.0
    async with Instance.open(database.url, engine_options=options, lease_ttl=ttl) as instance:
        lost = losses(instance)
        keeper = instance.host.keeper
        waiting = Waiting()
        graph = waiting.graph(instance)
        first = [start(instance, graph, unique("first")) for _ in range(20)]
        await until(lambda: waiting.entered == 20)
        burst_from = instance.clock()
        burst = [start(instance, graph, unique("burst")) for _ in range(200)]
        everyone = [*first, *burst]
        await until(lambda: waiting.entered == 220 or any(t.done() for t in everyone))
        ended = [t for t in everyone if t.done()]
        assert not ended, f"a run ended while all should wait: {ended[0].exception()!r}"
        # Two more rounds of renewals with all 220 held.
        held_from = instance.clock()
        await until(
            lambda: any(
                b.sent_at >= held_from + 2 * instance.renew_interval for b in keeper.batches
            )
        )
        waiting.go.set()
        results = await asyncio.gather(*first, *burst, return_exceptions=True)
    during = [b for b in keeper.batches if b.sent_at >= burst_from]
    seen = [
        (round(b.sent_at - burst_from, 2), b.size, round(b.slack, 2), round(b.took, 2))
        for b in during
    ]
    failed = [r for r in results if isinstance(r, BaseException)]
    assert failed == [], f"{len(failed)} runs failed; renewals (at, leases, slack, took): {seen}"
    assert all(r["log"] == ["done"] for r in results)
    assert lost == []
    assert during, "no renewal went out during the burst"
    assert max(b.size for b in during) >= 20  # batched: many leases per statement
    # Every renewal was sent, and answered, while each of its leases was confirmed held.
    late = [b for b in during if b.slack <= 0 or b.took >= b.slack]
    assert late == [], f"renewals late: {late}"


@pytest.mark.postgres
async def test_renewals_go_through_while_every_pooled_connection_is_taken(
    own_schema: tuple[str, str],
) -> None:
    """The keeper renews on a connection budget of its own: with every connection of the
    instance's pool checked out (by a burst of starts or checkpoint writes), the leases it
    holds are renewed all the same."""
    url, schema = own_schema
    options = {**schema_options(schema), "pool_size": 3, "max_overflow": 0, "pool_timeout": 1}
    async with Instance.open(url, engine_options=options, lease_ttl=3.0) as instance:
        lost = losses(instance)
        waiting = Waiting()
        run = start(instance, waiting.graph(instance), unique("held"))
        await until(lambda: waiting.entered == 1, within=30.0)
        engine = instance.repository.engine  # type: ignore[attr-defined]
        taken = []
        try:
            while True:  # every connection the pool has left
                try:
                    taken.append(await engine.connect())
                except sqlalchemy.exc.TimeoutError:
                    break
            held_from = instance.clock()
            await until(
                lambda: (
                    sum(b.sent_at >= held_from for b in instance.host.keeper.batches) >= 2
                    or run.done()
                ),
                within=30.0,
            )
        finally:
            for conn in taken:
                await conn.close()
        waiting.go.set()
        assert (await run)["log"] == ["done"]
    assert lost == []


class QueuedAcquires(StallableRepository):
    """A lease store whose acquires queue (as behind a pool every connection of which a
    burst of starts holds) until ``served`` is set; every other call goes straight on."""

    def __init__(self, inner: Any) -> None:
        super().__init__(inner, StallGate())
        self.queued = 0
        self.served = asyncio.Event()

    async def acquire(
        self, key: LeaseKey, holder: str, ttl: float, *, reopen: bool = False
    ) -> Lease | None:
        self.queued += 1
        await self.served.wait()
        return await self.inner.acquire(key, holder, ttl, reopen=reopen)


async def test_a_burst_of_starts_whose_acquires_answer_after_their_window_loses_none(
    leases: Leases,
) -> None:
    """A burst of starts larger than the pool: the first starts' acquires wait, and are
    answered after the window each counts from its sending has run out (on the store the
    lease is fresh: it was written just now). No such start loses its lease: it is renewed
    at once, before its graph runs, and its renewals keep it from then on; the rest of the
    burst starts after them."""
    store = QueuedAcquires(leases.store)
    instance = Instance(
        store,
        leases.saver,
        instance_id="burst",
        lease_ttl=3.0,
        clock=leases.clock,
        sleep=leases.clock.sleep,
        records=leases.records,
    )
    lost = losses(instance)
    waiting = Waiting()
    graph = waiting.graph(instance)
    burst = [start(instance, graph, unique("burst")) for _ in range(50)]
    # The first starts' acquires queue (the rest wait their turn to start: MAX_STARTING).
    await until(lambda: store.queued >= MAX_STARTING, within=30.0)
    leases.advance(instance.lease_ttl)  # their windows ran out while they queued
    store.served.set()
    await until(lambda: waiting.entered == 50 or any(t.done() for t in burst), within=30.0)
    ended = [t for t in burst if t.done()]
    assert not ended, f"a run ended while all should wait: {ended[0].exception()!r}"
    assert lost == []
    # Held from then on: two rounds of renewals keep every lease.
    for _ in range(2):
        sent = len(instance.host.keeper.batches)
        leases.advance(instance.renew_interval)
        await until(lambda sent=sent: len(instance.host.keeper.batches) > sent, within=30.0)
    waiting.go.set()
    results = await asyncio.gather(*burst, return_exceptions=True)
    await instance.aclose()
    assert [r for r in results if isinstance(r, BaseException)] == []
    assert lost == []


# -- a loop kept busy: the renewer thread


class Blocking:
    """A graph whose step blocks the event loop for the thread ``blocker`` (synchronous
    work in an async node: ``block()`` runs on the loop) and waits on ``go`` otherwise.
    Every step run anywhere counts in ``ran`` (thread ids, in any process thread)."""

    def __init__(self, block: Callable[[], None]) -> None:
        self.block = block
        self.entered = 0
        self.go = asyncio.Event()
        self.ran: list[str] = []

    def graph(self, instance: Instance, *, blocker: str = "blocker") -> Any:
        async def work(state: Log) -> Log:
            thread = get_execution_context().thread_id
            self.ran.append(thread)
            if thread.startswith(blocker):
                self.block()
            else:
                self.entered += 1
                await self.go.wait()
            return {"log": ["done"]}

        return one_step(instance, work, name="blocking")


@asynccontextmanager
async def serving_in_another_thread(database: Any, graphs: Callable[[Instance], Any]) -> Any:
    """Instance B serving ``graphs(b)`` on an event loop in a thread of its own, so a test
    that blocks its own loop does not block B: whatever lapses, B takes over."""
    options = schema_options(database.schema or None)
    ready: concurrent.futures.Future[tuple[asyncio.AbstractEventLoop, asyncio.Event]] = (
        concurrent.futures.Future()
    )

    async def serve() -> None:
        stop = asyncio.Event()
        try:
            async with Instance.open(
                database.url, engine_options=options, instance_id="B", lease_ttl=30.0
            ) as b:
                served = b.serve(
                    {"blocking": graphs(b)}, poll_interval=0.1, stop=stop, handle_signals=False
                )
                ready.set_result((asyncio.get_running_loop(), stop))
                await served
        except BaseException as exc:
            if not ready.done():
                ready.set_exception(exc)
            raise

    done = asyncio.wrap_future(
        asyncio.get_running_loop().run_in_executor(None, asyncio.run, serve())
    )
    loop, stop = await asyncio.wrap_future(ready)
    try:
        yield
    finally:
        loop.call_soon_threadsafe(stop.set)
        await done


async def test_a_loop_blocked_by_synchronous_work_loses_no_lease(database: Any) -> None:
    """A node blocks the instance's event loop (synchronous work, here ``time.sleep``) for
    longer than a lease's slack, while other runs hold their leases: the renewer thread
    renews them all the same, so no lease is lost, nothing is taken over (by an instance
    serving meanwhile), and every run completes. At TTL 1.5 s (a window of 1.35 s, renewed
    every 0.5 s) with the loop blocked 3 s: below the 10 s the loop may stall."""
    options = schema_options(database.schema or None)
    blocked_for = 3.0
    window = Blocking(lambda: time.sleep(blocked_for))
    elsewhere = Blocking(lambda: None)
    elsewhere.go.set()  # B runs to its end whatever it takes over
    async with (
        serving_in_another_thread(database, elsewhere.graph),
        Instance.open(database.url, engine_options=options, lease_ttl=1.5) as instance,
    ):
        assert instance.host.keeper.loop_stall_bound > blocked_for
        assert blocked_for > instance.lease_ttl - safety_margin(instance.lease_ttl)
        lost = losses(instance)
        graph = window.graph(instance)
        held = [start(instance, graph, unique("held")) for _ in range(5)]
        await until(lambda: window.entered == 5, within=30.0)
        blocked_from = instance.clock()
        blocker = start(instance, graph, unique("blocker"))
        await until(lambda: blocker.done(), within=30.0)
        blocked_until = instance.clock()
        window.go.set()
        results = await asyncio.gather(blocker, *held, return_exceptions=True)
        during = [
            b for b in instance.host.keeper.batches if blocked_from < b.sent_at < blocked_until
        ]
    assert [r for r in results if isinstance(r, BaseException)] == []
    assert all(r["log"] == ["done"] for r in results)
    assert lost == []
    assert elsewhere.ran == []  # nothing lapsed, so B took nothing over
    assert blocked_until - blocked_from >= blocked_for
    assert during, "no renewal went out while the loop was blocked"
    for thread in window.ran:
        lease = await _lease(database, LeaseKey(TENANT, thread))
        assert lease is not None
        assert (lease.status, lease.epoch) == (LeaseStatus.DONE, 1)  # never taken over


async def test_a_loop_blocked_past_its_bound_lets_its_lease_lapse(database: Any) -> None:
    """A loop that does not run again (a deadlocked process: here a node blocks it until
    another instance has run the step) keeps no lease forever: past the stall bound the
    renewer thread stops renewing, the lease lapses, and an instance serving meanwhile
    takes the execution over and runs it to its end; the blocked run, when its loop runs
    again, stops fenced."""
    options = schema_options(database.schema or None)
    taken_over = threading.Event()
    blocked = Blocking(lambda: taken_over.wait(timeout=60.0))
    elsewhere = Blocking(taken_over.set)
    async with (
        serving_in_another_thread(database, elsewhere.graph),
        Instance.open(database.url, engine_options=options, lease_ttl=1.5) as instance,
    ):
        lost = losses(instance)
        thread = unique("blocker")
        run = start(instance, blocked.graph(instance), thread)
        with pytest.raises(ExecutionLeaseLostError):
            await asyncio.wait_for(run, 90)
        assert taken_over.is_set(), "the loop was let go before anyone took over"
        await until(lambda: len(lost) > 0, within=30.0)
    assert elsewhere.ran == [thread]
    key = LeaseKey(TENANT, thread)
    lease = await eventually(lambda: _lease_done(database, key), timeout=30.0)
    assert lease.epoch == 2  # taken over once, by B, and run to its end there


async def _lease_done(database: Any, key: LeaseKey) -> Lease | None:
    lease = await _lease(database, key)
    return lease if lease is not None and lease.status is LeaseStatus.DONE else None


async def test_where_renewals_run_is_said_and_required(database: Any, leases: Leases) -> None:
    """A real deployment (``Instance.open``: a SQL store, the real clock) renews in the
    renewer thread, which ends with the instance; the ``leases`` fixture's instances (an
    injected clock and sleep) renew on their loop; and ``renewer="thread"`` where no thread
    can renew is refused, naming why, rather than falling back."""
    options = schema_options(database.schema or None)
    waiting = Waiting()
    async with Instance.open(database.url, engine_options=options, lease_ttl=3.0) as instance:
        assert instance.host.keeper.in_thread
        run = start(instance, waiting.graph(instance), unique("held"))
        await until(lambda: waiting.entered == 1, within=30.0)
        name = f"langgraph-fence renewer {instance.instance_id}"
        assert [t for t in threading.enumerate() if t.name == name]
        waiting.go.set()
        assert (await run)["log"] == ["done"]
    assert not [t for t in threading.enumerate() if t.name == name]  # ended with it
    assert not leases.instance("fixture").host.keeper.in_thread
    with pytest.raises(ValueError, match="injected clock"):
        Instance(
            leases.store,
            leases.saver,
            records=leases.records,
            clock=leases.clock,
            renewer="thread",
        )
    with pytest.raises(ValueError, match="renewer must be"):
        Instance(leases.store, leases.saver, records=leases.records, renewer="elsewhere")  # type: ignore[arg-type]


class _GatedRenewals(SqlLeaseRepository):
    """A SQL store whose next ``renew_many`` (once armed) waits at a gate, from any thread
    (the renewer thread's twin store is a copy of it)."""

    def __init__(self, engine: Any) -> None:
        super().__init__(engine)
        self.armed = threading.Event()
        self.entered = threading.Event()
        self.proceed = threading.Event()

    async def renew_many(self, leases: Any, ttl: float) -> Any:
        if self.armed.is_set():
            self.armed.clear()
            self.entered.set()
            await asyncio.to_thread(self.proceed.wait, 30.0)
        return await super().renew_many(leases, ttl)


@pytest.mark.parametrize("renewer", ["thread", "loop"])
async def test_a_renewal_refused_for_the_token_before_a_retake_does_not_fence_the_run(
    tmp_path: Any, renewer: str
) -> None:
    """A renewal in flight at token 1 while the run yields its lease and re-takes it at
    token 2 is refused by the store (the lease moved on): that answer is about token 1 and
    must not fence the run, which holds token 2 and goes on renewing it."""
    engine = create_engine(f"sqlite+aiosqlite:///{tmp_path / 'keeper.db'}")
    store = _GatedRenewals(engine)
    await store.setup()
    ttl = 3.0
    keeper = Keeper(
        ttl=ttl,
        renew_interval=ttl / 3,
        clock=time.monotonic,
        sleep=asyncio.sleep,
        events=Listeners("A"),
        holder="A",
        thread_store=store if renewer == "thread" else None,
    )
    try:
        # A second run keeps the keeper busy while the first one yields.
        other = RunHandle(store, await store.acquire(LeaseKey(TENANT, unique("o")), "A", ttl), ttl)
        keeper.keep(other)
        key = LeaseKey(TENANT, unique("r"))
        handle = RunHandle(store, await store.acquire(key, "A", ttl), ttl)
        store.armed.set()
        keeper.keep(handle)
        await until(store.entered.is_set, within=10.0)  # a renewal of token 1 in flight
        await keeper.release(handle)
        handle.note_yielded(await store.yield_lease(handle.lease))
        sent_at = time.monotonic()
        handle.replace_lease(await store.retake(handle.lease, ttl), sent_at=sent_at)
        keeper.keep(handle)
        assert handle.token == 2
        store.proceed.set()  # the renewal of token 1 reaches the store: refused
        await until(lambda: handle not in keeper._in_flight, within=10.0)
        assert handle.error is None
        renewed = await store.renew(handle.lease, ttl)  # token 2 still holds the lease
        assert (renewed.epoch, renewed.holder) == (2, "A")
    finally:
        await keeper.aclose()
        await store.aclose()
        await engine.dispose()


async def test_the_last_run_letting_go_while_sqlite_runs_its_renewal_leaves_no_write_lock(
    tmp_path: Any,
) -> None:
    """On SQLite a renewal is an ``UPDATE ... RETURNING``, which holds the database's write
    lock until it is stepped to its end. The last run held by an instance whose renewals run
    on its loop lets go of its lease (it ended, or yielded it to wait for remote children)
    while SQLite runs its renewal: the renewal is let end, and the write lock is free once
    it has. (Cancelled there, the statement stayed stepped once with the lock held after
    its connection was closed, until the garbage collector freed its cursor: every writer
    of the file waited out its busy timeout and failed.)"""
    path = tmp_path / "keeper.db"
    engine = create_engine(f"sqlite+aiosqlite:///{path}")
    clock = ManualClock()
    store = SqlLeaseRepository(engine, clock=clock)
    await store.setup()
    ttl = 3.0
    keeper = Keeper(
        ttl=ttl,
        renew_interval=ttl / 3,
        clock=clock,
        sleep=clock.sleep,
        events=Listeners("A"),
        holder="A",
    )
    lease = await store.acquire(LeaseKey(TENANT, unique("r")), "A", ttl)
    assert lease is not None
    handle = RunHandle(store, lease, ttl, clock=clock)
    letting_go: list[asyncio.Future[None]] = []

    def on_statement(conn: Any, cursor: Any, statement: str, *args: Any) -> None:
        # The renewal goes to SQLite's thread right after this: the run lets go meanwhile.
        if statement.startswith("UPDATE fence_leases SET expires_at") and not letting_go:
            letting_go.append(asyncio.ensure_future(keeper.release(handle)))

    event.listen(engine.sync_engine, "before_cursor_execute", on_statement)
    gc.disable()  # a collection would free a stranded statement's cursor, and its lock
    try:
        keeper.keep(handle)
        clock.advance(ttl / 3)  # its renewal falls due and is sent
        await until(lambda: bool(letting_go), within=10.0)
        await letting_go[0]
        await until(lambda: not keeper._sending, within=30.0)  # the renewal has ended
        probe = sqlite3.connect(path, timeout=0)  # no busy wait: is the lock free now?
        try:
            probe.execute("BEGIN IMMEDIATE")
            probe.execute("ROLLBACK")
        finally:
            probe.close()
    finally:
        gc.enable()
        await keeper.aclose()
        await store.aclose()
        await engine.dispose()

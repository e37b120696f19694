"""Takeover by any instance: serve() resumes, dead-letters, skips, and stops gracefully.

In the manner of the nr-llm ADR-112 suite, on a real SQLite store and checkpointer with a
controlled clock (the ``leases`` fixture), and the stamp order on both kinds of saver.
"""

from __future__ import annotations

import asyncio
import contextvars
import logging
import operator
from typing import Annotated, Any, TypedDict

import pytest
from langchain_core.runnables import RunnableConfig
from langgraph.checkpoint.memory import InMemorySaver
from langgraph.graph import END, START, StateGraph
from langgraph.types import RetryPolicy

from langgraph_fence import (
    Effect,
    ExecutionFencedError,
    Lease,
    LeaseKey,
    LeaseStatus,
    MemoryLeaseRepository,
    fence_graph,
)
from langgraph_fence.instance import Instance
from langgraph_fence.lease.records import ExecutionRecord
from langgraph_fence.steps.context import get_execution_context
from langgraph_fence.testing import Leases
from tests.support.databases import unique
from tests.support.polling import eventually
from tests.support.serving import serving, until_status

worker: contextvars.ContextVar[str] = contextvars.ContextVar("worker", default="?")


class Order(TypedDict, total=False):
    order: str
    log: Annotated[list[str], operator.add]


async def died_holding(
    leases: Leases, b: Instance, key: LeaseKey, graph: str, given: dict[str, Any]
) -> Lease:
    """Instance A took ``key`` (a 30 s lease; returned) and died before its first
    checkpoint: its record (of ``graph``, with input ``given``) is there, its lease has run
    out."""
    held = await leases.store.acquire(key, "A", 30.0)
    assert held is not None
    await b.records.record(ExecutionRecord(key, graph, key.execution_id, given))
    leases.advance(31.0)
    return held


class Shop:
    """An order graph whose charge step can hold instance A inside it."""

    def __init__(self, effect: Effect) -> None:
        self.effect = effect
        self.charges: list[tuple[str, int]] = []
        self.a_inside = asyncio.Event()
        self.a_go = asyncio.Event()

    def graph(self, instance: Instance) -> Any:
        async def prepare(state: Order) -> dict[str, Any]:
            return {"log": [f"prepare by {worker.get()}"]}

        async def charge(state: Order) -> dict[str, Any]:
            token = get_execution_context().fence.token
            self.charges.append((worker.get(), token))
            if worker.get() == "A":
                self.a_inside.set()
                await self.a_go.wait()
            return {"log": [f"charge at token {token}"]}

        async def finish(state: Order) -> dict[str, Any]:
            return {"log": ["finish"]}

        builder = StateGraph(Order)
        builder.add_node("prepare", prepare)
        builder.add_node("charge", charge, retry_policy=RetryPolicy(max_attempts=5))
        builder.add_node("finish", finish)
        builder.add_edge(START, "prepare")
        builder.add_edge("prepare", "charge")
        builder.add_edge("charge", "finish")
        builder.add_edge("finish", END)
        return fence_graph(builder, effects={"charge": self.effect}).compile(
            checkpointer=instance.checkpointer, name="shop"
        )


async def _reap_mid_charge(leases: Leases, effect: Effect) -> tuple[Shop, LeaseKey, Any]:
    """Run on A until it is inside charge (stamped), stall A, expire its lease, serve on B."""
    shop = Shop(effect)
    a, b = leases.instance("A"), leases.instance("B")
    thread = unique("order")
    key = LeaseKey("acme", thread)

    async def run_a() -> Any:
        worker.set("A")
        return await a.ainvoke(
            shop.graph(a),
            {"order": thread, "log": []},
            {"configurable": {"thread_id": thread}},
            tenant_id="acme",
            durability="sync",
        )

    task_a = asyncio.create_task(run_a())
    await asyncio.wait_for(shop.a_inside.wait(), 10)
    leases.stall(a)
    leases.advance(31.0)
    worker.set("B")
    async with serving(b, {"shop": shop.graph(b)}, durability="sync"):
        await until_status(leases, key, LeaseStatus.DONE, LeaseStatus.DEAD_LETTERED)
    leases.resume(a)
    shop.a_go.set()
    with pytest.raises(ExecutionFencedError):
        await asyncio.wait_for(task_a, 10)
    return shop, key, b


async def test_a_run_reaped_mid_non_idempotent_write_is_dead_lettered(leases: Leases) -> None:
    shop, key, _ = await _reap_mid_charge(leases, Effect.NON_IDEMPOTENT_WRITE)
    lease = await leases.store.get(key)
    assert lease is not None
    assert lease.status is LeaseStatus.DEAD_LETTERED
    assert lease.reason is not None
    assert "'charge'" in lease.reason
    assert "at token 1" in lease.reason
    # Never repeated, even though the node has retries left.
    assert shop.charges == [("A", 1)]


async def test_a_run_reaped_mid_idempotent_write_is_reclaimed(leases: Leases) -> None:
    shop, key, b = await _reap_mid_charge(leases, Effect.IDEMPOTENT_WRITE)
    lease = await leases.store.get(key)
    assert lease is not None
    assert lease.status is LeaseStatus.DONE
    assert lease.epoch == 2
    assert lease.pending_effect is None
    assert shop.charges == [("A", 1), ("B", 2)]
    state = await shop.graph(b).aget_state(
        {"configurable": {"thread_id": key.execution_id, "tenant_id": key.tenant_id}}
    )
    assert state.values["log"] == ["prepare by A", "charge at token 2", "finish"]


async def test_a_run_renewed_between_the_candidate_query_and_the_take_is_skipped(
    leases: Leases,
) -> None:
    shop = Shop(Effect.IDEMPOTENT_WRITE)
    b = leases.instance("B")
    key = LeaseKey("acme", unique("order"))
    holder = await died_holding(leases, b, key, "shop", {"log": []})

    class RenewsRightAfterTheQuery:
        """Fault point: the holder wakes up between B's candidate query and B's take."""

        def __init__(self) -> None:
            self.renewed: list[Lease] = []

        async def __call__(self) -> None:
            assert holder is not None
            self.renewed.append(await leases.store.renew(holder, 30.0))

    fault = RenewsRightAfterTheQuery()
    real_candidates = b.repository.takeover_candidates
    polls: list[int] = []

    async def candidates_then_renew(limit: int = 100, **order: Any) -> Any:
        found = await real_candidates(limit, **order)
        polls.append(len(found))
        if not fault.renewed:
            await fault()
        return found

    b.repository.takeover_candidates = candidates_then_renew  # type: ignore[method-assign]
    async with serving(b, {"shop": shop.graph(b)}):
        # The take after the first query, then several more polls: none takes it.
        await eventually(lambda: len(polls) >= 5)
    lease = await leases.store.get(key)
    assert lease is not None
    assert lease.holder == "A"
    assert lease.epoch == 1
    assert shop.charges == []


async def test_an_execution_of_an_unknown_graph_is_left_untouched(
    leases: Leases, caplog: pytest.LogCaptureFixture
) -> None:
    b = leases.instance("B")
    key = LeaseKey("acme", unique("order"))
    await died_holding(leases, b, key, "payroll", {"log": []})
    with caplog.at_level(logging.WARNING, logger="langgraph_fence"):
        async with serving(b, {"shop": Shop(Effect.READ_ONLY).graph(b)}):
            await eventually(lambda: "not served here" in caplog.text)
    lease = await leases.store.get(key)
    assert lease is not None
    assert lease.status is LeaseStatus.RUNNING
    assert lease.epoch == 1
    assert caplog.text.count("not served here") == 1  # logged once, not every poll


async def test_a_run_that_died_before_its_first_checkpoint_starts_from_its_input(
    leases: Leases,
) -> None:
    shop = Shop(Effect.IDEMPOTENT_WRITE)
    b = leases.instance("B")
    key = LeaseKey("acme", unique("order"))
    await died_holding(leases, b, key, "shop", {"order": "o", "log": ["input"]})
    worker.set("B")
    async with serving(b, {"shop": shop.graph(b)}):
        await until_status(leases, key, LeaseStatus.DONE)
    state = await shop.graph(b).aget_state(
        {"configurable": {"thread_id": key.execution_id, "tenant_id": key.tenant_id}}
    )
    assert state.values["log"] == ["input", "prepare by B", "charge at token 2", "finish"]


async def test_a_record_the_store_cannot_read_for_a_moment_is_no_dead_letter(
    leases: Leases,
) -> None:
    """Taken over, its record's read fails on a connection error (retries spent): an
    infrastructure error, not a broken record. Handed back, and the next look runs it to
    its end (before: dead-lettered for good, "its execution record cannot be loaded")."""
    shop = Shop(Effect.IDEMPOTENT_WRITE)
    b = leases.instance("B")
    key = LeaseKey("acme", unique("order"))
    await died_holding(leases, b, key, "shop", {"order": "o", "log": ["input"]})
    read = b.records.get
    failures: list[str] = []

    async def blinking_get(*args: Any, **kwargs: Any) -> Any:
        if not failures:  # the fault, injected on purpose: the first read only
            failures.append("get")
            raise ConnectionResetError("injected: connection lost")
        return await read(*args, **kwargs)

    b.records.get = blinking_get  # type: ignore[method-assign]
    worker.set("B")
    async with serving(b, {"shop": shop.graph(b)}):
        await until_status(leases, key, LeaseStatus.DONE, LeaseStatus.DEAD_LETTERED)
    lease = await leases.store.get(key)
    assert lease is not None
    assert lease.status is LeaseStatus.DONE, lease.reason
    assert failures == ["get"]


async def test_stop_drains_at_a_superstep_and_hands_the_execution_back(leases: Leases) -> None:
    b, c = leases.instance("B"), leases.instance("C")
    in_step, release = asyncio.Event(), asyncio.Event()
    ran: list[tuple[str, str]] = []

    async def first(state: Order) -> dict[str, Any]:
        ran.append(("first", worker.get()))
        in_step.set()
        await release.wait()
        return {"log": ["first"]}

    async def second(state: Order) -> dict[str, Any]:
        ran.append(("second", worker.get()))
        return {"log": ["second"]}

    def build(instance: Instance) -> Any:
        builder = StateGraph(Order)
        builder.add_node("first", first)
        builder.add_node("second", second)
        builder.add_edge(START, "first")
        builder.add_edge("first", "second")
        builder.add_edge("second", END)
        return fence_graph(builder).compile(checkpointer=instance.checkpointer, name="two")

    key = LeaseKey("acme", unique("order"))
    assert await leases.store.acquire(key, "dead", 30.0) is not None
    await b.records.record(ExecutionRecord(key, "two", key.execution_id, {"log": []}))
    leases.advance(31.0)
    worker.set("B")
    async with serving(b, {"two": build(b)}) as stop_b:
        await asyncio.wait_for(in_step.wait(), 10)
        stop_b.set()  # SIGTERM: finish the step in flight, then hand the execution back

        async def drain_requested() -> bool:
            return any(run.control.drain_requested for run in b.host.runs)

        await eventually(drain_requested)
        release.set()
    lease = await leases.store.get(key)
    assert lease is not None
    assert lease.status is LeaseStatus.PENDING
    assert lease.holder is None
    assert ran == [("first", "B")]

    worker.set("C")
    async with serving(c, {"two": build(c)}):
        # At once: no lease expiry to wait for (the clock did not move).
        await until_status(leases, key, LeaseStatus.DONE)
    assert ran == [("first", "B"), ("second", "C")]


async def test_bad_input_to_serve_is_refused() -> None:
    instance = Instance(MemoryLeaseRepository(), InMemorySaver())
    builder = StateGraph(Order)
    builder.add_node("n", lambda s: {})
    builder.add_edge(START, "n")
    plain = builder.compile(checkpointer=InMemorySaver())
    fenced = builder.compile(checkpointer=instance.checkpointer, name="graph")
    for graphs, options, named in [
        ({}, {}, "graphs"),
        ({"n": plain}, {}, "instance.checkpointer"),
        ({"n": fenced}, {"concurrency": 0}, "concurrency"),
        ({"n": fenced}, {"poll_interval": 0}, "poll_interval"),
    ]:
        with pytest.raises(ValueError, match=named):
            await instance.serve(graphs, handle_signals=False, **options)


class Recording:
    """A lease store that writes down the order of the calls that matter."""

    def __init__(self, inner: Any, events: list[str]) -> None:
        self.inner = inner
        self.events = events

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)

    async def mark_pending_effect(self, lease: Lease, effect: Any, ttl: float) -> Lease:
        self.events.append(f"stamp+renew {effect.node}")
        return await self.inner.mark_pending_effect(lease, effect, ttl)

    async def clear_pending_effects(self, lease: Lease, keys: Any = None) -> Lease:
        self.events.append("clear")
        return await self.inner.clear_pending_effects(lease, keys)


@pytest.mark.parametrize("saver_kind", ["sql", "memory"])
async def test_the_order_is_stamp_renew_effect_clear(leases: Leases, saver_kind: str) -> None:
    events: list[str] = []
    store = Recording(leases.store, events)
    saver = leases.saver if saver_kind == "sql" else InMemorySaver()
    instance = Instance(store, saver, clock=leases.clock)  # type: ignore[arg-type]

    async def charge(state: Order) -> dict[str, Any]:
        lease = await leases.store.get(get_execution_context().fence._handle.key)
        assert lease is not None
        assert lease.pending_effect is not None  # stamped before
        events.append("effect")
        return {"log": ["charged"]}

    builder = StateGraph(Order)
    builder.add_node("charge", charge)
    builder.add_edge(START, "charge")
    builder.add_edge("charge", END)
    graph = fence_graph(builder, effects={"charge": Effect.NON_IDEMPOTENT_WRITE}).compile(
        checkpointer=instance.checkpointer, name="graph"
    )
    thread = unique("order")
    config: RunnableConfig = {"configurable": {"thread_id": thread}}
    await instance.ainvoke(graph, {"log": []}, config, tenant_id="acme", durability="sync")
    if saver_kind == "sql":
        # Cleared inside the checkpointer's own write of the task: no extra store call.
        assert events == ["stamp+renew charge", "effect"]
    else:
        assert events == ["stamp+renew charge", "effect", "clear"]
    lease = await leases.store.get(LeaseKey("acme", thread))
    assert lease is not None
    assert lease.pending_effect is None  # no trace left behind
    assert lease.status is LeaseStatus.DONE


@pytest.mark.parametrize(
    ("effect", "ends"),
    [(Effect.IDEMPOTENT_WRITE, LeaseStatus.DONE), (Effect.NON_IDEMPOTENT_WRITE, None)],
)
async def test_confirm_now_during_a_graceful_stop_drains_the_step(
    leases: Leases, effect: Effect, ends: LeaseStatus | None
) -> None:
    b, c = leases.instance("B"), leases.instance("C")
    in_step, go = asyncio.Event(), asyncio.Event()
    sent: list[str] = []

    async def send_email(state: Order) -> dict[str, Any]:
        if worker.get() == "B":
            in_step.set()
            await go.wait()
        await get_execution_context().fence.confirm_now()  # before a call that can't check
        sent.append(worker.get())
        return {"log": ["sent"]}

    def build(instance: Instance) -> Any:
        builder = StateGraph(Order)
        builder.add_node("send_email", send_email)
        builder.add_edge(START, "send_email")
        builder.add_edge("send_email", END)
        return fence_graph(builder, effects={"send_email": effect}).compile(
            checkpointer=instance.checkpointer, name="mail"
        )

    key = LeaseKey("acme", unique("mail"))
    assert await leases.store.acquire(key, "dead", 30.0) is not None
    await b.records.record(ExecutionRecord(key, "mail", key.execution_id, {"log": []}))
    leases.advance(31.0)
    worker.set("B")
    async with serving(b, {"mail": build(b)}) as stop_b:
        await asyncio.wait_for(in_step.wait(), 10)
        stop_b.set()

        async def stopping() -> bool:
            return any(run.handle.stop_reason for run in b.host.runs)

        await eventually(stopping)
        go.set()
    assert sent == []  # the e-mail was not sent during the shutdown
    lease = await leases.store.get(key)
    assert lease is not None
    assert lease.status is LeaseStatus.PENDING
    # Handed back. An idempotent write is resumed and C sends it once; a non-idempotent one
    # is dead-lettered by C's take: its stamp stands and nothing proves it did not start.
    worker.set("C")
    async with serving(c, {"mail": build(c)}):
        await until_status(leases, key, LeaseStatus.DONE, LeaseStatus.DEAD_LETTERED)
    final = await leases.store.get(key)
    assert final is not None
    if ends is LeaseStatus.DONE:
        assert final.status is LeaseStatus.DONE
        assert sent == ["C"]
    else:
        assert final.status is LeaseStatus.DEAD_LETTERED
        assert sent == []
        assert final.reason is not None
        assert "'send_email'" in final.reason


async def test_only_a_submitted_run_pays_for_the_pin_at_its_takeover(leases: Leases) -> None:
    """A takeover of a run started by ``ainvoke`` reads the thread's checkpoint and sends
    no pin; a submitted run's claim reads it once and sends its one pin UPDATE (checkpoint
    reads and pin statements counted)."""
    from sqlalchemy import event

    from langgraph_fence.execution.serve import Server

    shop = Shop(Effect.IDEMPOTENT_WRITE)
    a, b = leases.instance("A"), leases.instance("B")
    graph = shop.graph(b)
    thread = unique("started")
    started = LeaseKey("acme", thread)

    async def run_a() -> Any:
        worker.set("A")
        config = {"configurable": {"thread_id": thread}}
        # durability="sync": the checkpoint after prepare is stored before the next step
        # starts, so the take below finds it (and its parent) whatever the machine's load.
        return await a.ainvoke(
            shop.graph(a), {"log": []}, config, tenant_id="acme", durability="sync"
        )

    task_a = asyncio.create_task(run_a())
    await asyncio.wait_for(shop.a_inside.wait(), 10)  # past prepare: a checkpoint stands
    submitted = await b.submit("shop", {"log": []}, cfg_of(unique("sub")), tenant_id="acme")
    leases.stall(a)
    leases.advance(31.0)  # A's lease expired
    worker.set("B")
    server = Server(
        b.host, {"shop": graph}, concurrency=1, poll_interval=1, max_takeovers=3, kwargs={}
    )
    statements: list[str] = []
    reads: list[Any] = []
    real_read = graph.checkpointer.aget_tuple

    async def counted_read(config: Any) -> Any:
        reads.append(config)
        return await real_read(config)

    def sent(_c: Any, _cur: Any, statement: str, *_: Any) -> None:
        statements.append(statement)

    async def take(key: LeaseKey) -> tuple[int, int]:
        (candidate,) = [c for c in await b.repository.takeover_candidates(10) if c.key == key]
        head = (await b.records.heads_of([key]))[key]
        statements.clear()
        reads.clear()
        event.listen(leases.engine.sync_engine, "before_cursor_execute", sent)
        assert b.host.keeper.try_admit()
        try:
            assert await server._take_one(graph, candidate, head)
        finally:
            event.remove(leases.engine.sync_engine, "before_cursor_execute", sent)
        counted = (len(reads), sum("SET input_after" in s for s in statements))
        await asyncio.wait_for(asyncio.gather(*server.running), 10)
        server.running.clear()
        b.host.keeper.leave()  # the slot take_work takes for a run
        return counted

    graph.checkpointer.aget_tuple = counted_read  # type: ignore[method-assign]
    try:
        plain = await take(started)
        claimed = await take(submitted.key)
    finally:
        del graph.checkpointer.aget_tuple  # the instance attribute: back to the method
        leases.resume(a)
        shop.a_go.set()
    with pytest.raises(ExecutionFencedError):
        await asyncio.wait_for(task_a, 10)
    # The run started by ainvoke: its latest checkpoint (and its parent, for the progress
    # mark), no pin. The submitted one: none yet, and its pin; not read again after the
    # take (nobody held it, so nobody could write since the read).
    assert plain == (2, 0)
    assert claimed == (1, 1)
    assert (await submitted.result(timeout=5))["log"]


def cfg_of(thread: str) -> dict[str, Any]:
    return {"configurable": {"thread_id": thread}}


class Turn(TypedDict, total=False):
    n: int


def turns(instance: Instance, step: Any) -> Any:
    """``turns``: one node, ``step``."""
    builder: StateGraph[Any] = StateGraph(Turn)
    builder.add_node("step", step)
    builder.add_edge(START, "step")
    builder.add_edge("step", END)
    return fence_graph(builder).compile(checkpointer=instance.checkpointer, name="turns")


async def test_a_busy_loop_begins_a_threads_queued_run_once_the_run_before_it_ends(
    leases: Leases, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A look that a run's end woke takes work at once but sweeps (promotes queued runs,
    among others) at most every ``SWEEP_EVERY`` seconds; when it may not sweep yet, it
    pauses only until it may, never for the whole poll interval. The thread's queued run
    begins within that (one second here), with a poll interval of a minute."""
    from langgraph_fence.execution import serve as serve_module

    monkeypatch.setattr(serve_module, "SWEEP_EVERY", 1.0)
    b = leases.instance("B")
    began, go = asyncio.Event(), asyncio.Event()

    async def step(state: Turn) -> dict[str, Any]:
        if state["n"] == 1:
            began.set()
            await go.wait()
        return {"n": state["n"] * 10}

    thread = {"configurable": {"thread_id": unique("turns")}}
    first = await b.submit("turns", {"n": 1}, thread, tenant_id="acme")
    async with serving(b, {"turns": turns(b, step)}, poll_interval=60.0):
        await asyncio.wait_for(began.wait(), 10)
        second = await b.submit("turns", {"n": 2}, thread, tenant_id="acme", on_busy="enqueue")
        go.set()
        assert await first.result(timeout=10, poll_interval=0.01) == {"n": 10}
        assert await second.result(timeout=10, poll_interval=0.01) == {"n": 20}


async def test_a_full_loop_still_begins_queued_runs_behind_a_backlog(
    leases: Leases, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The looks a run's end wakes only take work, and the sweep that follows may find
    every slot full: it still begins the thread's queued run (pending, claimed in its
    tenant's turn), never leaving it queued until another tenant's backlog drains."""
    from langgraph_fence.execution import serve as serve_module

    monkeypatch.setattr(serve_module, "SWEEP_EVERY", 3.0)  # the run's end falls within it
    b = leases.instance("B")
    began, go, hold = asyncio.Event(), asyncio.Event(), asyncio.Event()
    holding = asyncio.Event()

    async def step(state: Turn) -> dict[str, Any]:
        if state["n"] == 1:
            began.set()
            await go.wait()
        elif state["n"] == 3:
            holding.set()
            await hold.wait()  # another tenant's run, filling the loop's one slot
        return {"n": state["n"] * 10}

    thread = {"configurable": {"thread_id": unique("turns")}}
    first = await b.submit("turns", {"n": 1}, thread, tenant_id="acme")
    async with serving(b, {"turns": turns(b, step)}, concurrency=1, poll_interval=60.0):
        try:
            await asyncio.wait_for(began.wait(), 10)
            queued = await b.submit("turns", {"n": 2}, thread, tenant_id="acme", on_busy="enqueue")
            other = await b.submit(
                "turns",
                {"n": 3},
                {"configurable": {"thread_id": unique("other")}},
                tenant_id="zeta",
            )
            assert (await queued.state()).queued
            go.set()
            assert await first.result(timeout=10, poll_interval=0.01) == {"n": 10}
            await asyncio.wait_for(holding.wait(), 10)  # the slot is full

            async def begun() -> bool:
                return not (await queued.state()).queued

            await eventually(begun, timeout=15, what="the queued run begun while the slot is full")
            hold.set()
            assert await other.result(timeout=10, poll_interval=0.01) == {"n": 30}
            assert await queued.result(timeout=10, poll_interval=0.01) == {"n": 20}
        finally:
            hold.set()  # the loop drains its runs as it stops

"""Admin operations under the execution's lease, and erasure (issue 24, item 5).

``adelete_thread``, ``aprune``, ``acopy_thread`` and ``adelete_for_runs`` made while a run of
the thread writes used to land in the middle of it: the run ended ``done`` over a state
missing a channel's blob, or a copy landed rows with no token in a running thread. Through
an instance's checkpointer they now take the thread's execution lease for their duration
and are refused while another instance holds it. Deleting a thread erases it: every row of
it (checkpoints, blobs, writes, the execution record, the thread binding, the lease's
reason, the sink's stored results); only the sink's high-water mark row stays, holding the
scope key and a token. Every test runs on SQLite and PostgreSQL.
"""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any, TypedDict

import pytest
from langchain_core.runnables import RunnableConfig
from langgraph.checkpoint.memory import InMemorySaver
from langgraph.graph import END, START, StateGraph
from langgraph.types import Command, interrupt
from sqlalchemy import text
from sqlalchemy.ext.asyncio import AsyncEngine

from checkpointers import SqlCheckpointer
from langgraph_fence import (
    Effect,
    LeaseKey,
    LeaseStatus,
    MemoryLeaseRepository,
    PendingEffect,
    SqlLeaseRepository,
    fence_graph,
    get_execution_context,
)
from langgraph_fence.database import transaction
from langgraph_fence.errors import ExecutionLeaseHeldError
from langgraph_fence.instance import Instance
from langgraph_fence.lease.records import SqlExecutionRecords
from langgraph_fence.sinks import fenced_write
from langgraph_fence.testing import ManualClock
from tests.support.databases import SQL_BACKENDS, setup_all, unique
from tests.support.polling import eventually
from tests.support.tables import stored_anywhere

RUNS_ON = SQL_BACKENDS
CARD = "4111111111111111"


class Order(TypedDict, total=False):
    card: str
    first: list[str]  # not a scalar: kept in a blob row of its own, not inline
    second: str


@pytest.fixture
async def engine(
    backend: str, make_engine: Callable[[str], AsyncEngine]
) -> AsyncIterator[AsyncEngine]:
    engine = make_engine(backend)
    yield engine
    await engine.dispose()


async def open_instance(engine: AsyncEngine, name: str) -> Instance:
    await setup_all(engine)
    saver = SqlCheckpointer(engine)
    await saver.setup()  # on this loop
    records = SqlExecutionRecords(engine)
    repository = SqlLeaseRepository(engine)
    return Instance(repository, saver, instance_id=unique(name), lease_ttl=10.0, records=records)


@pytest.fixture
async def instance(engine: AsyncEngine) -> AsyncIterator[Instance]:
    inst = await open_instance(engine, "worker")
    yield inst
    await inst.aclose()


def order_graph(instance: Instance, second: Callable[[], Awaitable[None]] | None = None) -> Any:
    """``first`` writes one channel, ``second`` (which may wait) another, each with a
    checkpoint of its own; ``second`` also records a charge through the exactly-once sink."""
    engine = instance.checkpointer.inner.engine  # type: ignore[attr-defined]

    async def first(state: Order) -> dict[str, Any]:
        return {"first": [f"first:{state['card']}"]}

    async def second_step(state: Order) -> dict[str, Any]:
        if second is not None:
            await second()
        fence = get_execution_context().fence
        async with (
            transaction(engine) as conn,
            fenced_write(conn, fence, "charge") as write,
        ):
            if not write.applied:
                write.record({"charged": state["card"]})
        return {"second": "second"}

    builder = StateGraph(Order)
    builder.add_node("first", first)
    builder.add_node("second", second_step)
    builder.add_edge(START, "first")
    builder.add_edge("first", "second")
    builder.add_edge("second", END)
    return fence_graph(builder).compile(checkpointer=instance.checkpointer, name="graph")


def config_of(thread: str, tenant: str) -> RunnableConfig:
    return {"configurable": {"thread_id": thread, "tenant_id": tenant}}


class Paused:
    """A step that waits inside the run until the test lets it go (no sleeps)."""

    def __init__(self) -> None:
        self.entered = asyncio.Event()
        self.proceed = asyncio.Event()

    async def __call__(self) -> None:
        self.entered.set()
        await self.proceed.wait()


async def run_paused(
    instance: Instance, thread: str, tenant: str
) -> tuple[Any, Paused, asyncio.Task[Any]]:
    paused = Paused()
    graph = order_graph(instance, paused)
    run = asyncio.create_task(
        instance.ainvoke(graph, {"card": CARD}, config_of(thread, tenant), tenant_id=tenant)
    )
    await asyncio.wait_for(paused.entered.wait(), 10)
    return graph, paused, run


ADMIN_CALLS: dict[str, Callable[[Instance, str, str], Awaitable[None]]] = {
    "delete_thread": lambda i, thread, tenant: i.checkpointer.adelete_thread(
        thread, tenant_id=tenant
    ),
    "prune_delete": lambda i, thread, tenant: i.checkpointer.aprune(
        [thread], strategy="delete", tenant_id=tenant
    ),
    "prune_keep_latest": lambda i, thread, tenant: i.checkpointer.aprune(
        [thread], tenant_id=tenant
    ),
}


@pytest.mark.parametrize("call", sorted(ADMIN_CALLS))
async def test_an_admin_call_on_a_running_thread_is_refused_and_the_run_stays_whole(
    instance: Instance, call: str
) -> None:
    tenant, thread = unique("acme"), unique("order")
    graph, paused, run = await run_paused(instance, thread, tenant)
    with pytest.raises(ExecutionLeaseHeldError) as refused:
        await ADMIN_CALLS[call](instance, thread, tenant)
    message = str(refused.value)
    assert thread in message, message
    assert instance.instance_id in message, message
    paused.proceed.set()
    await asyncio.wait_for(run, 10)
    state = await graph.aget_state(config_of(thread, tenant))
    assert state.values == {"card": CARD, "first": [f"first:{CARD}"], "second": "second"}
    lease = await instance.repository.get(LeaseKey(tenant, thread))
    assert lease is not None
    assert lease.status is LeaseStatus.DONE


async def test_a_copy_into_a_running_thread_is_refused_and_lands_no_row(
    instance: Instance, engine: AsyncEngine
) -> None:
    tenant, source, target = unique("acme"), unique("source"), unique("target")
    await instance.ainvoke(
        order_graph(instance),
        {"card": "5500000000000004"},
        config_of(source, tenant),
        tenant_id=tenant,
    )
    graph, paused, run = await run_paused(instance, target, tenant)
    with pytest.raises(ExecutionLeaseHeldError):
        await instance.checkpointer.acopy_thread(source, target, tenant_id=tenant)
    paused.proceed.set()
    await asyncio.wait_for(run, 10)
    async with engine.connect() as conn:
        untokened = (
            await conn.execute(
                text(
                    "SELECT count(*) FROM fence_checkpoints WHERE tenant_id = :tenant"
                    " AND thread_id = :t AND fence_token IS NULL"
                ),
                {"tenant": tenant, "t": target},
            )
        ).scalar_one()
    assert untokened == 0
    state = await graph.aget_state(config_of(target, tenant))
    assert state.values["card"] == CARD


async def test_an_admin_call_on_an_idle_thread_runs_and_keeps_its_status(
    instance: Instance,
) -> None:
    tenant, thread, copy = unique("acme"), unique("order"), unique("copy")
    graph = order_graph(instance)
    await instance.ainvoke(graph, {"card": CARD}, config_of(thread, tenant), tenant_id=tenant)
    key = LeaseKey(tenant, thread)
    before = await instance.repository.get(key)
    assert before is not None
    await instance.checkpointer.acopy_thread(thread, copy, tenant_id=tenant)
    await instance.checkpointer.aprune([thread], tenant_id=tenant)
    after = await instance.repository.get(key)
    assert after is not None
    # Each call took the lease once (the token moved on: a stale writer of before is
    # fenced) and gave it back as it found it.
    assert (after.status, after.holder, after.reason) == (before.status, None, before.reason)
    assert after.epoch > before.epoch
    assert (await graph.aget_state(config_of(copy, tenant))).values["second"] == "second"
    assert len([s async for s in graph.aget_state_history(config_of(thread, tenant))]) == 1


async def assert_erased(instance: Instance, engine: AsyncEngine, key: LeaseKey, mark: int) -> None:
    """Nothing of the execution's thread is left but its lease's token and the sink's mark."""
    lease = await instance.repository.get(key)
    assert lease is not None  # the epoch never goes back: kept, with nothing of the run
    assert (lease.status, lease.holder, lease.reason, lease.pending_effects) == (
        LeaseStatus.DONE,
        None,
        None,
        (),
    )
    assert await instance.records.get(key) is None
    async with engine.connect() as conn:
        binding = (
            await conn.execute(
                text("SELECT count(*) FROM fence_thread_bindings WHERE tenant_id = :a"),
                {"a": key.tenant_id},
            )
        ).scalar_one()
        marks = (
            await conn.execute(
                text("SELECT token FROM fence_high_water WHERE scope_key = :s"),
                {"s": key.scope_key},
            )
        ).scalars()
        assert binding == 0
        # The high-water mark row stays: a scope key and a token, no result.
        assert list(marks) == [mark]


async def test_deleting_a_thread_erases_every_row_of_it_and_the_id_can_be_used_again(
    instance: Instance, engine: AsyncEngine
) -> None:
    tenant, thread = unique("acme"), unique("order")
    secret = f"{CARD}-{uuid.uuid4().hex[:8]}"  # no other test's rows can hold it
    graph = order_graph(instance)
    await instance.ainvoke(graph, {"card": secret}, config_of(thread, tenant), tenant_id=tenant)

    async def declined() -> None:
        # A reason masks a card number: the erasure of the reason is seen by the reference.
        raise RuntimeError(f"card declined, ref {secret.rsplit('-', 1)[1]}")

    # A second turn fails: its input is recorded and its error is the lease's reason.
    with pytest.raises(RuntimeError):
        await instance.ainvoke(
            order_graph(instance, declined),
            {"card": secret},
            config_of(thread, tenant),
            tenant_id=tenant,
        )
    held = {place.split(".")[0] for place in await stored_anywhere(engine, secret)}
    assert {
        "fence_checkpoint_blobs",
        "fence_checkpoint_writes",
        "fence_executions",
        "fence_applied",
    } <= held, held
    reference = f"ref {secret.rsplit('-', 1)[1]}"
    assert "fence_leases.reason" in await stored_anywhere(engine, reference)
    key = LeaseKey(tenant, thread)
    before = await instance.repository.get(key)
    assert before is not None
    assert before.status is LeaseStatus.FAILED

    await instance.checkpointer.adelete_thread(thread, tenant_id=tenant)

    assert await stored_anywhere(engine, secret) == []
    assert await stored_anywhere(engine, reference) == []
    await assert_erased(instance, engine, key, mark=1)
    assert (await graph.aget_state(config_of(thread, tenant))).values == {}

    # A new run of the same thread, under another execution id even (the binding is gone):
    # a new thread, whose charge the sink applies again.
    again = unique("again")
    await instance.ainvoke(
        graph,
        {"card": "4000000000000002"},
        config_of(thread, tenant),
        tenant_id=tenant,
        execution_id=again,
    )
    assert (await graph.aget_state(config_of(thread, tenant))).values["second"] == "second"
    # And the erased execution itself starts again at the next token, above the kept mark.
    await instance.checkpointer.adelete_thread(thread, tenant_id=tenant)
    await instance.ainvoke(graph, {"card": "x"}, config_of(thread, tenant), tenant_id=tenant)
    lease = await instance.repository.get(key)
    assert lease is not None
    assert lease.status is LeaseStatus.DONE
    assert lease.epoch == before.epoch + 2


async def test_a_dead_lettered_thread_is_erased_too(
    instance: Instance, engine: AsyncEngine
) -> None:
    tenant, thread = unique("acme"), unique("order")
    secret = f"{CARD}-{uuid.uuid4().hex[:8]}"
    await instance.ainvoke(
        order_graph(instance), {"card": secret}, config_of(thread, tenant), tenant_id=tenant
    )
    key = LeaseKey(tenant, thread)
    await instance.repository.dead_letter(key, f"IntegrityError: card {secret}")

    await instance.checkpointer.adelete_thread(thread, tenant_id=tenant)

    assert await stored_anywhere(engine, secret) == []
    await assert_erased(instance, engine, key, mark=1)


async def test_an_interrupted_thread_pruned_meanwhile_still_resumes(instance: Instance) -> None:
    tenant, thread = unique("acme"), unique("order")

    async def ask(state: Order) -> dict[str, Any]:
        return {"second": interrupt("charge?")}

    builder = StateGraph(Order)
    builder.add_node("ask", ask)
    builder.add_edge(START, "ask")
    builder.add_edge("ask", END)
    graph = fence_graph(builder).compile(checkpointer=instance.checkpointer, name="graph")
    config = config_of(thread, tenant)
    await instance.ainvoke(graph, {"card": CARD}, config, tenant_id=tenant)
    key = LeaseKey(tenant, thread)
    waiting = await instance.repository.get(key)
    assert waiting is not None
    assert waiting.status is LeaseStatus.WAITING

    await instance.checkpointer.aprune([thread], tenant_id=tenant)

    pruned = await instance.repository.get(key)
    assert pruned is not None
    assert pruned.status is LeaseStatus.WAITING
    assert pruned.epoch == waiting.epoch + 1
    await instance.ainvoke(graph, Command(resume="yes"), config, tenant_id=tenant)
    assert (await graph.aget_state(config)).values == {"card": CARD, "second": "yes"}


async def test_the_sync_twins_hold_the_lease_too(instance: Instance) -> None:
    tenant, thread = unique("acme"), unique("order")
    graph, paused, run = await run_paused(instance, thread, tenant)
    with pytest.raises(ExecutionLeaseHeldError):
        await asyncio.to_thread(instance.checkpointer.delete_thread, thread, tenant_id=tenant)
    paused.proceed.set()
    await asyncio.wait_for(run, 10)
    await asyncio.to_thread(instance.checkpointer.delete_thread, thread, tenant_id=tenant)
    assert (await graph.aget_state(config_of(thread, tenant))).values == {}
    assert await instance.records.get(LeaseKey(tenant, thread)) is None


async def test_on_memory_stores_a_running_thread_is_refused_and_an_idle_one_erased() -> None:
    instance = Instance(MemoryLeaseRepository(), InMemorySaver(), instance_id=unique("mem"))
    tenant, thread = unique("acme"), unique("chat")
    paused = Paused()

    async def step(state: Order) -> dict[str, Any]:
        await paused()
        return {"second": "second"}

    builder = StateGraph(Order)
    builder.add_node("step", step)
    builder.add_edge(START, "step")
    builder.add_edge("step", END)
    graph = fence_graph(builder).compile(checkpointer=instance.checkpointer, name="graph")
    config = config_of(thread, tenant)
    run = asyncio.create_task(instance.ainvoke(graph, {"card": CARD}, config, tenant_id=tenant))
    await asyncio.wait_for(paused.entered.wait(), 10)
    with pytest.raises(ExecutionLeaseHeldError):
        await instance.checkpointer.adelete_thread(thread, tenant_id=tenant)
    paused.proceed.set()
    await asyncio.wait_for(run, 10)
    await instance.checkpointer.adelete_thread(thread, tenant_id=tenant)
    assert (await graph.aget_state(config)).values == {}
    assert await instance.records.get(LeaseKey(tenant, thread)) is None
    lease = await instance.repository.get(LeaseKey(tenant, thread))
    assert lease is not None
    assert (lease.status, lease.epoch) == (LeaseStatus.DONE, 2)


async def test_deleting_a_running_runs_checkpoints_is_refused(instance: Instance) -> None:
    tenant, thread = unique("acme"), unique("order")
    run_id = str(uuid.uuid4())
    paused = Paused()
    graph = order_graph(instance, paused)
    config: Any = config_of(thread, tenant)
    config["configurable"]["run_id"] = run_id  # kept in each checkpoint's metadata
    run = asyncio.create_task(instance.ainvoke(graph, {"card": CARD}, config, tenant_id=tenant))
    await asyncio.wait_for(paused.entered.wait(), 10)
    # LangGraph stores the checkpoints in the background (durability "async"): wait until
    # one of the run's has landed, or there is nothing of it to delete yet.
    await eventually(
        lambda: instance.checkpointer.aget_tuple(config_of(thread, tenant)),
        interval=0.01,
        what="a checkpoint of the run to land",
    )
    with pytest.raises(ExecutionLeaseHeldError):
        await instance.checkpointer.adelete_for_runs([run_id], tenant_id=tenant)
    paused.proceed.set()
    await asyncio.wait_for(run, 10)
    await instance.checkpointer.adelete_for_runs([run_id], tenant_id=tenant)
    assert (await graph.aget_state(config_of(thread, tenant))).values == {}


async def test_an_admin_call_keeps_a_dead_workers_stamps_for_its_taker(
    engine: AsyncEngine, clock: ManualClock
) -> None:
    await setup_all(engine)
    repository = SqlLeaseRepository(engine, clock=clock)
    saver = SqlCheckpointer(engine)
    await saver.setup()  # on this loop
    records = SqlExecutionRecords(engine)
    admin = Instance(repository, saver, instance_id=unique("admin"), records=records)
    tenant, thread = unique("acme"), unique("order")
    key = LeaseKey(tenant, thread)
    lease = await repository.acquire(key, "worker-1", 10.0)
    assert lease is not None
    charge = PendingEffect(Effect.NON_IDEMPOTENT_WRITE, "charge", unique("task"), lease.epoch)
    lease = await repository.mark_pending_effect(lease, charge, 10.0)
    with pytest.raises(ExecutionLeaseHeldError, match="worker-1"):
        await admin.checkpointer.aprune([thread], tenant_id=tenant)
    clock.advance(11)  # worker-1 died mid-charge

    await admin.checkpointer.aprune([thread], tenant_id=tenant)

    after = await repository.get(key)
    assert after is not None
    assert (after.status, after.holder, after.pending_effects) == (
        LeaseStatus.PENDING,
        None,
        (charge,),
    )
    # The next taker still sees the charge that may have happened, and does not repeat it.
    taken = await repository.take_over(after, "worker-2", 10.0)
    assert taken is not None
    assert taken.status is LeaseStatus.DEAD_LETTERED


async def test_deleting_a_thread_erases_its_submitted_runs_inputs_and_outputs(
    instance: Instance, engine: AsyncEngine
) -> None:
    """Each submitted run keeps its input and output in ``fence_runs``: erased with the
    thread, with its record."""
    from langgraph_fence.execution.serve import Server

    tenant, thread = unique("acme"), unique("order")
    secret = f"{CARD}-{uuid.uuid4().hex[:8]}"
    graph = order_graph(instance)
    run = await instance.submit(
        "graph", {"card": secret}, config_of(thread, tenant), tenant_id=tenant
    )
    server = Server(
        instance.host, {"graph": graph}, concurrency=1, poll_interval=1, max_takeovers=3, kwargs={}
    )
    await server.take_work(1)
    await asyncio.wait_for(asyncio.gather(*server.running), 20)
    await run.result(timeout=5)
    second = await instance.submit(
        "graph", {"card": secret + "-2"}, config_of(thread, tenant), tenant_id=tenant
    )  # the first run's end is kept in its row now
    assert await second.cancel()
    assert "fence_runs" in {place.split(".")[0] for place in await stored_anywhere(engine, secret)}
    await instance.checkpointer.adelete_thread(thread, tenant_id=tenant)
    assert await stored_anywhere(engine, secret) == []

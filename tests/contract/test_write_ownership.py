"""Write ownership, in the spirit of langgraph PR #8894: only the lease's current holder writes.

Two workers (two engines, as two processes would have) share one thread. A holds the lease
at token n; B takes it over (n + 1) and writes; A's writes are refused and leave no row, and
the chain never forks. Every test runs on SQLite and PostgreSQL, and for three ways of
fencing:

* ``sql``: :class:`SqlCheckpointer` alone, the token checked inside its own write;
* ``wrapped``: :class:`FencedCheckpointer` over it (delegates to the inner guard);
* ``outside``: :class:`FencedCheckpointer` over a saver that cannot guard the lease (the
  leases live elsewhere), so the wrapper checks before delegating.
"""

from __future__ import annotations

import asyncio
import operator
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, replace
from typing import Annotated, Any, TypedDict

import pytest
from langchain_core.runnables import RunnableConfig
from langgraph.checkpoint.base import BaseCheckpointSaver
from langgraph.checkpoint.conformance.test_utils import generate_checkpoint, generate_metadata
from langgraph.checkpoint.serde.types import ERROR, INTERRUPT
from langgraph.graph import END, START, StateGraph
from sqlalchemy import text
from sqlalchemy.ext.asyncio import AsyncEngine

from checkpointers import SqlCheckpointer
from langgraph_fence import (
    Effect,
    ExecutionFencedError,
    ExecutionLeaseRepository,
    FencedCheckpointer,
    LeaseKey,
    MemoryLeaseRepository,
    PendingEffect,
    SqlLeaseRepository,
)
from langgraph_fence.fence import RunHandle
from langgraph_fence.testing import ManualClock
from tests.support.databases import SQL_BACKENDS, unique

RUNS_ON = SQL_BACKENDS
MODES = ["sql", "wrapped", "outside"]
TTL = 10.0


@dataclass
class Worker:
    """One worker: its own engine, lease store and saver."""

    name: str
    engine: AsyncEngine
    leases: ExecutionLeaseRepository
    saver: BaseCheckpointSaver[Any]

    async def take(self, key: LeaseKey) -> RunHandle:
        lease = await self.leases.acquire(key, self.name, TTL)
        assert lease is not None, f"{self.name} could not take {key}"
        return RunHandle(self.leases, lease, TTL)


@pytest.fixture(params=MODES)
async def workers(
    request: pytest.FixtureRequest,
    backend: str,
    make_engine: Callable[[str], AsyncEngine],
    clock: ManualClock,
) -> AsyncIterator[tuple[Worker, Worker]]:
    mode = request.param
    shared_memory = MemoryLeaseRepository(clock=clock)
    pair = []
    for name in ("A", "B"):
        engine = make_engine(backend)
        sql = SqlCheckpointer(engine)
        await sql.setup()
        leases: ExecutionLeaseRepository
        if mode == "outside":
            leases = shared_memory
        else:
            leases = SqlLeaseRepository(engine, clock=clock)
            await leases.setup()  # type: ignore[attr-defined]
        saver: BaseCheckpointSaver[Any] = sql if mode == "sql" else FencedCheckpointer(sql)
        pair.append(Worker(name, engine, leases, saver))
    yield pair[0], pair[1]
    for worker in pair:
        await worker.engine.dispose()


def config(thread_id: str, handle: RunHandle | None, checkpoint_id: str | None = None) -> Any:
    configurable: dict[str, Any] = {"thread_id": thread_id, "checkpoint_ns": ""}
    if checkpoint_id is not None:
        configurable["checkpoint_id"] = checkpoint_id
    if handle is not None:
        configurable["__fence"] = handle
    return {"configurable": configurable}


async def put(worker: Worker, thread_id: str, handle: RunHandle | None, parent: str | None) -> str:
    checkpoint = generate_checkpoint(channel_values={"who": worker.name, "data": [worker.name]})
    checkpoint["channel_versions"] = {"who": 1, "data": 1}
    stored = await worker.saver.aput(
        config(thread_id, handle, parent), checkpoint, generate_metadata(), {"who": 1, "data": 1}
    )
    return str(stored["configurable"]["checkpoint_id"])


async def rows(engine: AsyncEngine, table: str, thread_id: str) -> list[Any]:
    columns = {
        "fence_checkpoints": "checkpoint_id, parent_checkpoint_id, fence_token",
        "fence_checkpoint_writes": "checkpoint_id, task_id, fence_token",
    }[table]
    async with engine.connect() as conn:
        result = await conn.execute(
            text(f"SELECT {columns} FROM {table} WHERE thread_id = :t ORDER BY 1"),
            {"t": thread_id},
        )
        return list(result.all())


def assert_no_fork(chain: list[Any]) -> None:
    children: dict[str | None, int] = {}
    for _, parent, _ in chain:
        children[parent] = children.get(parent, 0) + 1
    assert all(n == 1 for n in children.values()), f"the chain forked: {chain}"


async def test_stale_owner_is_refused_and_the_chain_does_not_fork(
    workers: tuple[Worker, Worker], clock: ManualClock
) -> None:
    a, b = workers
    thread = unique("thread")
    key = LeaseKey("tenant", thread)
    handle_a = await a.take(key)
    first = await put(a, thread, handle_a, None)
    await a.saver.aput_writes(config(thread, handle_a, first), [("data", "a")], "task-a")

    clock.advance(TTL + 1)
    handle_b = await b.take(key)
    assert handle_b.token == handle_a.token + 1
    second = await put(b, thread, handle_b, first)
    await b.saver.aput_writes(config(thread, handle_b, second), [("data", "b")], "task-b")

    with pytest.raises(ExecutionFencedError) as refused:
        await put(a, thread, handle_a, first)
    assert refused.value.token_held == handle_a.token
    assert refused.value.token_seen == handle_b.token
    assert handle_a.error is refused.value, "the refusal is recorded on the run's handle"
    with pytest.raises(ExecutionFencedError) as refused_writes:
        await a.saver.aput_writes(config(thread, handle_a, second), [("data", "stale")], "late")
    assert refused_writes.value is refused.value, "the run raises its first fencing error"

    chain = await rows(a.engine, "fence_checkpoints", thread)
    assert [row[0] for row in chain] == [first, second], "A's refused checkpoint left a row"
    assert_no_fork(chain)
    tokens = {row[0]: row[2] for row in chain}
    if isinstance(a.leases, MemoryLeaseRepository):
        # Checked outside the database: the rows claim no token.
        assert tokens == {first: None, second: None}
    else:
        # Checked inside the write: every row carries the token it was written under.
        assert tokens == {first: handle_a.token, second: handle_b.token}
    writes = await rows(a.engine, "fence_checkpoint_writes", thread)
    assert [w[1] for w in writes] == ["task-a", "task-b"], "A's refused writes left a row"

    # Reads are never fenced: the stale owner still reads, and sees B's head.
    latest = await a.saver.aget_tuple(config(thread, handle_a))
    assert latest is not None
    assert latest.checkpoint["id"] == second
    assert latest.checkpoint["channel_values"]["who"] == "B"
    assert [t.checkpoint["id"] async for t in a.saver.alist(config(thread, handle_a))] == [
        second,
        first,
    ]


async def test_a_handle_of_another_execution_is_refused(workers: tuple[Worker, Worker]) -> None:
    a, _ = workers
    mine, other = unique("thread"), unique("thread")
    handle = await a.take(LeaseKey("tenant", mine))
    await a.take(LeaseKey("tenant", other))  # the other thread's execution exists, held
    with pytest.raises(ExecutionFencedError, match="belongs to execution"):
        await put(a, other, handle, None)
    assert await rows(a.engine, "fence_checkpoints", other) == []

    # The same token under another tenant is another execution too.
    fresh = await a.take(LeaseKey("tenant", unique("thread")))
    cfg = config(fresh.key.execution_id, fresh)
    cfg["configurable"]["tenant_id"] = "another-tenant"
    with pytest.raises(ExecutionFencedError, match="another-tenant"):
        await a.saver.aput(cfg, generate_checkpoint(), generate_metadata(), {})
    assert await rows(a.engine, "fence_checkpoints", fresh.key.execution_id) == []


async def test_a_forged_lease_is_refused(workers: tuple[Worker, Worker]) -> None:
    """A handle naming the right key with a token the store never issued to it."""
    a, b = workers
    thread = unique("thread")
    key = LeaseKey("tenant", thread)
    handle_b = await b.take(key)
    forged = RunHandle(a.leases, replace(handle_b.lease, holder="A"), TTL)
    with pytest.raises(ExecutionFencedError):
        await put(a, thread, forged, None)
    assert await rows(a.engine, "fence_checkpoints", thread) == []


async def test_pending_effect_is_cleared_by_the_tasks_own_write(
    workers: tuple[Worker, Worker], clock: ManualClock
) -> None:
    a, b = workers
    thread = unique("thread")
    key = LeaseKey("tenant", thread)
    handle = await a.take(key)
    head = await put(a, thread, handle, None)
    effect = PendingEffect(Effect.NON_IDEMPOTENT_WRITE, "charge", "task-charge", handle.token)
    other = PendingEffect(Effect.NON_IDEMPOTENT_WRITE, "email", "task-email", handle.token)
    await handle.mark_pending_effect(effect)
    await handle.mark_pending_effect(other)
    both = tuple(sorted((effect, other), key=lambda e: e.key))

    await a.saver.aput_writes(config(thread, handle, head), [("data", 1)], "another-task")
    stored = await a.leases.get(key)
    assert stored is not None, "another task's write cleared"
    assert stored.pending_effects == both, "another task's write cleared"
    assert set(handle.pending_effects) == {effect.key, other.key}

    # A step that failed or was interrupted did not finish: nothing proves its effect did
    # not start, so its error/interrupt write leaves the entry standing.
    for channel in (ERROR, INTERRUPT):
        await a.saver.aput_writes(config(thread, handle, head), [(channel, "x")], "task-charge")
        stored = await a.leases.get(key)
        assert stored is not None, channel
        assert stored.pending_effects == both, channel

    await a.saver.aput_writes(config(thread, handle, head), [("data", 2)], "task-charge")
    stored = await a.leases.get(key)
    # Only the charge's entry went: the e-mail, still mid-write, stands.
    assert stored is not None
    assert stored.pending_effects == (other,)
    assert set(handle.pending_effects) == {other.key}
    assert handle.lease.pending_effects == (other,)

    # A stale owner's entry stands: its refused write clears nothing.
    clock.advance(TTL + 1)
    await b.take(key)
    with pytest.raises(ExecutionFencedError):
        await a.saver.aput_writes(config(thread, handle, head), [("data", 3)], "task-email")
    stored = await a.leases.get(key)
    assert stored is not None
    assert stored.pending_effects == (other,)
    landed = {w[1] for w in await rows(a.engine, "fence_checkpoint_writes", thread)}
    assert landed == {"another-task", "task-charge"}


async def test_writes_whose_checkpoint_is_not_stored_clear_nothing(
    workers: tuple[Worker, Worker],
) -> None:
    """Orphan writes (their checkpoint's own write failed or is still in flight) are seen by
    no resume: a takeover resumes from the checkpoint before and would run the step again,
    so they are no proof that it finished."""
    a, _ = workers
    thread = unique("thread")
    key = LeaseKey("tenant", thread)
    handle = await a.take(key)
    head = await put(a, thread, handle, None)
    missing = generate_checkpoint()["id"]  # a checkpoint that was never stored
    effect = PendingEffect(
        Effect.NON_IDEMPOTENT_WRITE, "charge", "task-charge", handle.token, checkpoint_id=missing
    )
    await handle.mark_pending_effect(effect)
    await a.saver.aput_writes(config(thread, handle, missing), [("data", 1)], "task-charge")
    stored = await a.leases.get(key)
    assert stored is not None
    assert stored.pending_effects == (effect,)
    assert set(handle.pending_effects) == {effect.key}
    # Its writes did land (they are the saver's to keep), under the run's token.
    landed = {(w[0], w[1]) for w in await rows(a.engine, "fence_checkpoint_writes", thread)}
    assert landed == {(missing, "task-charge")}
    # The same writes on the stored checkpoint clear the entry.
    await a.saver.aput_writes(config(thread, handle, head), [("data", 1)], "task-charge")
    stored = await a.leases.get(key)
    assert stored is not None
    assert stored.pending_effects == ()


async def test_a_root_checkpoint_clears_the_entries_of_the_supersteps_before_it(
    workers: tuple[Worker, Worker],
) -> None:
    """With durability="exit" (no task writes are saved) and for writes that raced their
    checkpoint, the next root checkpoint is what proves a step's writes were recorded."""
    a, _ = workers
    thread = unique("thread")
    key = LeaseKey("tenant", thread)
    handle = await a.take(key)
    first = generate_checkpoint()["id"]
    older = PendingEffect(Effect.NON_IDEMPOTENT_WRITE, "charge", "t1", 1, checkpoint_id=first)
    unknown = PendingEffect(Effect.NON_IDEMPOTENT_WRITE, "legacy", "t0", 1)  # no superstep
    await handle.mark_pending_effect(older)
    await handle.mark_pending_effect(unknown)
    # The checkpoint of the entry's own superstep clears nothing (its tasks are running).
    checkpoint = generate_checkpoint()
    checkpoint["id"] = first
    await a.saver.aput(config(thread, handle), checkpoint, generate_metadata(), {})
    stored = await a.leases.get(key)
    assert stored is not None
    assert {e.key for e in stored.pending_effects} == {"t0", "t1"}
    # A subgraph's checkpoint clears nothing either: the root's next one does.
    sub = {"configurable": {**config(thread, handle)["configurable"], "checkpoint_ns": "n:1"}}
    await a.saver.aput(sub, generate_checkpoint(), generate_metadata(), {})
    stored = await a.leases.get(key)
    assert stored is not None
    assert {e.key for e in stored.pending_effects} == {"t0", "t1"}
    later = await put(a, thread, handle, first)
    assert later > first
    stored = await a.leases.get(key)
    assert stored is not None
    assert stored.pending_effects == (unknown,)
    assert set(handle.pending_effects) == {"t0"}


class State(TypedDict):
    log: Annotated[list[str], operator.add]


async def test_a_refused_write_drains_an_async_durability_run(
    workers: tuple[Worker, Worker], clock: ManualClock
) -> None:
    """B takes the lease during node b: A's write of b is refused, the run asks LangGraph to
    drain, and node d (two supersteps later) never starts, although with
    ``durability="async"`` the nodes run ahead of persistence."""
    a, b = workers
    thread = unique("thread")
    key = LeaseKey("tenant", thread)
    handle = await a.take(key)
    stopped = asyncio.Event()
    handle.on_stop(lambda _error: stopped.set())
    ran: list[str] = []

    async def node_b(state: State) -> dict[str, list[str]]:
        ran.append("b")
        clock.advance(TTL + 1)
        await b.take(key)
        return {"log": ["b"]}

    async def node_c(state: State) -> dict[str, list[str]]:
        ran.append("c")
        # Runs while b's refused write is on its way: wait until the run knows.
        await asyncio.wait_for(stopped.wait(), timeout=10)
        return {"log": ["c"]}

    def plain(name: str) -> Callable[[State], dict[str, list[str]]]:
        def node(state: State) -> dict[str, list[str]]:
            ran.append(name)
            return {"log": [name]}

        return node

    builder = StateGraph(State)
    builder.add_node("a", plain("a"))
    builder.add_node("b", node_b)
    builder.add_node("c", node_c)
    builder.add_node("d", plain("d"))
    builder.add_edge(START, "a")
    builder.add_edge("a", "b")
    builder.add_edge("b", "c")
    builder.add_edge("c", "d")
    builder.add_edge("d", END)
    graph = builder.compile(checkpointer=a.saver)
    run_config: RunnableConfig = {"configurable": {"thread_id": thread, "__fence": handle}}
    with pytest.raises(ExecutionFencedError) as raised:
        await graph.ainvoke({"log": []}, run_config, durability="async")
    assert raised.value is handle.error
    # c may or may not have started before the refusal was known; d never does.
    assert ran[:2] == ["a", "b"], ran
    assert "d" not in ran, ran


async def test_concurrent_writes_each_get_their_own_outcome(
    workers: tuple[Worker, Worker], clock: ManualClock
) -> None:
    """A fan-out superstep's writes arrive together (SQLite commits them as one group): the
    stale writer among them is refused alone, and every other write lands."""
    a, b = workers
    stale_thread, live_thread = unique("thread"), unique("thread")
    stale = await a.take(LeaseKey("tenant", stale_thread))
    stale_head = await put(a, stale_thread, stale, None)
    live = await b.take(LeaseKey("tenant", live_thread))
    live_head = await put(b, live_thread, live, None)
    clock.advance(TTL + 1)
    await b.take(LeaseKey("tenant", stale_thread))

    writes = [
        b.saver.aput_writes(config(live_thread, live, live_head), [("data", i)], f"task-{i}")
        for i in range(8)
    ]
    # Through the same saver, so on SQLite it joins the same group commit.
    writes.insert(4, b.saver.aput_writes(config(stale_thread, stale, stale_head), [("d", 0)], "x"))
    outcomes = await asyncio.gather(*writes, return_exceptions=True)
    assert isinstance(outcomes.pop(4), ExecutionFencedError)
    assert outcomes == [None] * 8
    landed = await rows(b.engine, "fence_checkpoint_writes", live_thread)
    assert sorted(w[1] for w in landed) == [f"task-{i}" for i in range(8)]
    assert await rows(a.engine, "fence_checkpoint_writes", stale_thread) == []

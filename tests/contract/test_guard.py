"""One guard: every guarded statement gives the same answer for the same stored lease.

A write made under a hold lands only while the stored lease is still that hold (same key,
holder, epoch, status ``running``; expiry is not part of it). The rule is written once
(:mod:`langgraph_fence.lease.guard`), but it runs in many statements: the lease store's renew,
release, stamp and clear (memory, SQLite, PostgreSQL), :class:`SqlCheckpointer`'s checkpoint
and writes statements on both drivers, and :class:`FencedCheckpointer`'s check before it
delegates to a saver that cannot guard; the same for the store: :class:`SqlStore`'s put
and delete statements, and :class:`FencedStore`'s check before it delegates to
``InMemoryStore``. Each is run here against the same table of stored lease states, and each
must land exactly where :func:`~langgraph_fence.lease.guard.holds` says, and leave nothing behind
where it is refused.

The sinks are not in the table: they fence by the token against their own high-water mark
(the external system's check, ``tests/contract/test_sinks.py``), not by the lease row.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, replace
from typing import Any

import pytest
from langgraph.checkpoint.base import BaseCheckpointSaver
from langgraph.checkpoint.conformance.test_utils import generate_checkpoint, generate_metadata
from langgraph.checkpoint.memory import InMemorySaver
from langgraph.store.base import BaseStore
from langgraph.store.memory import InMemoryStore
from sqlalchemy import text
from sqlalchemy.ext.asyncio import AsyncEngine

from checkpointers import SqlCheckpointer, SqlStore
from langgraph_fence import (
    Effect,
    ExecutionFencedError,
    ExecutionLeaseRepository,
    FencedCheckpointer,
    FencedStore,
    Lease,
    LeaseKey,
    LeaseStatus,
    MemoryLeaseRepository,
    PendingEffect,
    SqlLeaseRepository,
)
from langgraph_fence.fence import RunHandle
from langgraph_fence.keys import FENCE_CONFIG_KEY
from langgraph_fence.lease.guard import holds
from langgraph_fence.testing import ManualClock
from tests.support.databases import unique
from tests.support.leases import run_step

TTL = 10.0


@dataclass(frozen=True)
class State:
    """A stored lease, as a change from the hold ``H`` at epoch 1 (``None``: no row)."""

    name: str
    change: dict[str, Any] | None
    lapsed: bool = False


STATES = [
    State("the hold itself", {}),
    State("the hold, lapsed, nobody took it", {}, lapsed=True),
    State("no lease row", None),
    State("taken over (epoch + 1)", {"epoch": 2}),
    State("another holder at the same epoch", {"holder": "other"}),
    *(
        State(f"{status.value} at the same epoch", {"status": status, "holder": holder})
        for status, holder in [
            (LeaseStatus.PENDING, None),
            (LeaseStatus.WAITING, None),
            (LeaseStatus.DONE, None),
            (LeaseStatus.FAILED, None),
            (LeaseStatus.DEAD_LETTERED, None),
            # A status that is not running fences even with the holder's name left on it.
            (LeaseStatus.DONE, "H"),
        ]
    ),
]


@dataclass
class Backend:
    """One lease store, a saver over it, and a way to put a lease row in any state."""

    name: str
    leases: ExecutionLeaseRepository
    saver: BaseCheckpointSaver[Any]
    engine: AsyncEngine | None
    clock: ManualClock
    kv: BaseStore

    async def store(self, hold: Lease, state: State) -> None:
        """Make the stored lease of ``hold.key`` be ``state``."""
        if state.lapsed:
            self.clock.advance(TTL + 1)
        if isinstance(self.leases, MemoryLeaseRepository):
            rows = self.leases._rows  # the test's own stored state, set directly
            if state.change is None:
                del rows[hold.key]
            else:
                rows[hold.key] = replace(rows[hold.key], **state.change)
            return
        assert self.engine is not None
        where = "tenant_id = :t AND execution_id = :e"
        params: dict[str, Any] = {"t": hold.key.tenant_id, "e": hold.key.execution_id}
        if state.change is None:
            sql = f"DELETE FROM fence_leases WHERE {where}"
        else:
            sets = []
            for column, value in state.change.items():
                sets.append(f"{column} = :{column}")
                params[column] = value.value if isinstance(value, LeaseStatus) else value
            if not sets:
                return
            sql = f"UPDATE fence_leases SET {', '.join(sets)} WHERE {where}"
        async with self.engine.begin() as conn:
            await conn.execute(text(sql), params)

    async def checkpoints(self, thread_id: str) -> int:
        found = [c async for c in self.saver.alist({"configurable": {"thread_id": thread_id}})]
        return len(found)


@pytest.fixture
async def guarded(
    backend: str, make_engine: Callable[[str], AsyncEngine]
) -> AsyncIterator[Backend]:
    """The guarded statements of ``backend``: its lease store, saver and store."""
    clock = ManualClock()
    if backend == "memory":
        # A saver that cannot guard: FencedCheckpointer checks the lease, then delegates.
        leases = MemoryLeaseRepository(clock=clock)
        kv: BaseStore = FencedStore(InMemoryStore())
        yield Backend("memory", leases, FencedCheckpointer(InMemorySaver()), None, clock, kv)
        return
    engine = make_engine(backend)
    sql_leases = SqlLeaseRepository(engine, clock=clock)
    await sql_leases.setup()
    saver = SqlCheckpointer(engine)
    await saver.setup()
    sql_store = SqlStore(engine)
    await sql_store.setup()
    yield Backend(backend, sql_leases, saver, engine, clock, FencedStore(sql_store))
    # The store's pooled connections go with the engine, on this loop (not at GC).
    await saver.aclose()
    await engine.dispose()


def _config(thread_id: str, handle: RunHandle, checkpoint_id: str | None = None) -> Any:
    configurable: dict[str, Any] = {
        "thread_id": thread_id,
        "checkpoint_ns": "",
        FENCE_CONFIG_KEY: handle,
    }
    if checkpoint_id is not None:
        configurable["checkpoint_id"] = checkpoint_id
    return {"configurable": configurable}


Statement = Callable[[Backend, RunHandle, str], Awaitable[Any]]


async def _renew(b: Backend, handle: RunHandle, thread: str) -> Any:
    return await b.leases.renew(handle.lease, TTL)


async def _renew_many(b: Backend, handle: RunHandle, thread: str) -> Any:
    # Beside another hold in the same statement: each row is guarded on its own.
    beside = await b.leases.acquire(LeaseKey("tenant", unique("beside")), "H", TTL)
    assert beside is not None
    other, answer = await b.leases.renew_many([beside, handle.lease], TTL)
    assert isinstance(other, Lease), other
    if isinstance(answer, ExecutionFencedError):
        raise answer
    return answer


async def _release(b: Backend, handle: RunHandle, thread: str) -> Any:
    return await b.leases.release(handle.lease, LeaseStatus.PENDING)


async def _stamp(b: Backend, handle: RunHandle, thread: str) -> Any:
    effect = PendingEffect(Effect.NON_IDEMPOTENT_WRITE, "charge", "task-1", handle.token)
    return await b.leases.mark_pending_effect(handle.lease, effect, TTL)


async def _clear(b: Backend, handle: RunHandle, thread: str) -> Any:
    return await b.leases.clear_pending_effects(handle.lease)


async def _checkpoint(b: Backend, handle: RunHandle, thread: str) -> Any:
    checkpoint = generate_checkpoint(channel_values={"x": 1})
    checkpoint["channel_versions"] = {"x": 1}
    return await b.saver.aput(_config(thread, handle), checkpoint, generate_metadata(), {"x": 1})


async def _writes(b: Backend, handle: RunHandle, thread: str) -> Any:
    return await b.saver.aput_writes(_config(thread, handle, "c-1"), [("x", 2)], "task-1")


async def _store_put(b: Backend, handle: RunHandle, thread: str) -> Any:
    async def node(state: Any) -> None:
        await b.kv.aput(("memories", thread), "summary", {"v": 1})

    return await run_step(node, handle, thread)


async def _store_delete(b: Backend, handle: RunHandle, thread: str) -> Any:
    async def node(state: Any) -> None:
        await b.kv.adelete(("memories", thread), "summary")

    return await run_step(node, handle, thread)


STATEMENTS: dict[str, Statement] = {
    "lease renew": _renew,
    "lease renew_many": _renew_many,
    "lease release": _release,
    "stamp": _stamp,
    "clear stamps": _clear,
    "checkpoint": _checkpoint,
    "writes": _writes,
    "store put": _store_put,
    "store delete": _store_delete,
}


@pytest.mark.parametrize("state", STATES, ids=lambda s: s.name)
@pytest.mark.parametrize("statement", list(STATEMENTS))
async def test_every_guarded_statement_answers_as_the_guard_does(
    guarded: Backend, statement: str, state: State
) -> None:
    key = LeaseKey("tenant", unique("guard"))
    thread = key.execution_id
    hold = await guarded.leases.acquire(key, "H", TTL)
    assert hold is not None
    # The handle's own clock stands still: what is tested is the statement's guard, not the
    # run's local confirmation window (tests/unit/test_fence.py has that).
    handle = RunHandle(guarded.leases, hold, TTL, clock=ManualClock())
    await guarded.store(hold, state)
    expected = holds(hold, await guarded.leases.get(key))
    assert expected == (state.change == {}), f"the guard itself disagrees on {state.name!r}"

    try:
        await STATEMENTS[statement](guarded, handle, thread)
        landed = True
    except ExecutionFencedError:
        landed = False

    assert landed == expected, (
        f"{guarded.name} {statement} {'landed' if landed else 'was refused'} on {state.name!r}; "
        f"the guard says it {'lands' if expected else 'is refused'}"
    )
    if not landed and statement == "store put":
        assert await guarded.kv.aget(("memories", thread), "summary") is None, "a refused put"
    if not landed and statement == "checkpoint":
        assert await guarded.checkpoints(thread) == 0, "a refused checkpoint left a row"
    if not landed and statement in {"stamp", "clear stamps", "lease renew", "lease release"}:
        after = await guarded.leases.get(key)
        before_change = state.change or {}
        if after is not None:
            assert after.epoch == before_change.get("epoch", hold.epoch), "a refusal changed it"
            assert after.pending_effects == (), "a refused stamp left an entry"

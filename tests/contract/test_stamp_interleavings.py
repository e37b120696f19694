"""The stamp set in every interleaving: N parallel tasks, a kill anywhere, then a takeover.

One superstep of N tasks (each a non-idempotent or idempotent write) runs against the real
``SqlCheckpointer`` and lease store on SQLite and PostgreSQL. The events are the ones
LangGraph produces, in any order it can: each task stamps, then saves its finished writes;
the superstep's own checkpoint (``C_N``) is saved at any moment (``durability="async"``
saves it concurrently with the tasks); the next checkpoint (``C_N+1``) only after every
task's writes. The run is killed after any prefix of the events, and another instance
takes it over.

The pure model: a task's entry is cleared once its writes and ``C_N`` are both stored, in
either order (by its writes saved after ``C_N``, or by ``C_N`` saved after them: the run
remembers writes that landed before their proof), or by ``C_N+1``; the takeover
dead-letters iff a non-idempotent entry stands. The guarantee
under test: a resumed run never re-runs a non-idempotent write that may have happened (a
resume re-runs every task whose writes it cannot see: ``C_N+1`` missing, and ``C_N`` or
the task's writes missing).
"""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from langgraph.checkpoint.conformance.test_utils import generate_checkpoint, generate_metadata
from sqlalchemy.ext.asyncio import AsyncEngine

from checkpointers import SqlCheckpointer
from langgraph_fence import Effect, LeaseKey, LeaseStatus, PendingEffect, SqlLeaseRepository
from langgraph_fence.database import create_engine
from langgraph_fence.fence import RunHandle
from langgraph_fence.testing import ManualClock
from tests.support.databases import SQL_BACKENDS, pg_engine_options

RUNS_ON = SQL_BACKENDS

TTL = 10.0


@st.composite
def interleavings(draw: st.DrawFn) -> tuple[list[Effect], list[str], int]:
    """``(effects, events, kill)``: the tasks' effects, one order LangGraph can produce,
    and how many of the events happen before the kill."""
    effects = draw(
        st.lists(
            st.sampled_from([Effect.NON_IDEMPOTENT_WRITE, Effect.IDEMPOTENT_WRITE]),
            min_size=1,
            max_size=4,
        )
    )
    pending = {f"t{i}": ["stamp", "write"] for i in range(len(effects))}
    events: list[str] = []
    put_n = False
    while pending or not put_n:
        choices = [f"{kind} {task}" for task, kinds in pending.items() for kind in kinds[:1]]
        if not put_n:
            choices.append("put C_N")
        event = draw(st.sampled_from(choices))
        events.append(event)
        if event == "put C_N":
            put_n = True
        else:
            _, task = event.split()
            pending[task].pop(0)
            if not pending[task]:
                del pending[task]
    events.append("put C_N+1")
    kill = draw(st.integers(min_value=0, max_value=len(events)))
    return effects, events, kill


def model(effects: list[Effect], done: list[str]) -> tuple[bool, set[str]]:
    """``(dead_lettered, tasks a resume re-runs)`` after the events ``done``."""
    later_checkpoint = "put C_N+1" in done
    c_n_at = done.index("put C_N") if "put C_N" in done else None

    def seen(task: str) -> bool:
        return later_checkpoint or (f"write {task}" in done and c_n_at is not None)

    # Exact: an entry is cleared as soon as a resume would see its task's writes.
    cleared = seen

    tasks = [f"t{i}" for i in range(len(effects))]
    dead = any(
        effect is Effect.NON_IDEMPOTENT_WRITE and f"stamp {task}" in done and not cleared(task)
        for task, effect in zip(tasks, effects, strict=True)
    )
    return dead, {task for task in tasks if not seen(task)}


class World:
    """A saver and a lease store on one database, on one loop, for every example."""

    def __init__(self, engine: AsyncEngine) -> None:
        self.loop = asyncio.new_event_loop()
        self.clock = ManualClock()
        self.engine = engine
        self.leases = SqlLeaseRepository(engine, clock=self.clock)
        self.saver = SqlCheckpointer(engine)
        self.run(self.leases.setup())
        self.run(self.saver.setup())

    def run(self, coro: Any) -> Any:
        return self.loop.run_until_complete(asyncio.wait_for(coro, 30))

    def close(self) -> None:
        try:
            self.run(self.saver.aclose())
            self.run(self.engine.dispose())
        finally:
            self.loop.close()

    async def scenario(self, effects: list[Effect], events: list[str], kill: int) -> Any:
        thread = f"th-{uuid.uuid4().hex[:10]}"
        key = LeaseKey("acme", thread)
        lease = await self.leases.acquire(key, "A", TTL)
        assert lease is not None
        handle = RunHandle(self.leases, lease, TTL, clock=self.clock)

        def config(checkpoint_id: str | None = None) -> Any:
            configurable: dict[str, Any] = {
                "thread_id": thread,
                "checkpoint_ns": "",
                "__fence": handle,
            }
            if checkpoint_id is not None:
                configurable["checkpoint_id"] = checkpoint_id
            return {"configurable": configurable}

        checkpoints = [generate_checkpoint() for _ in range(3)]
        ids = [c["id"] for c in checkpoints]
        assert ids == sorted(ids)
        await self.saver.aput(config(), checkpoints[0], generate_metadata(), {})
        c_n = ids[1]
        for event in events[:kill]:
            if event == "put C_N":
                await self.saver.aput(config(ids[0]), checkpoints[1], generate_metadata(), {})
            elif event == "put C_N+1":
                await self.saver.aput(config(c_n), checkpoints[2], generate_metadata(), {})
            else:
                kind, task = event.split()
                if kind == "stamp":
                    effect = effects[int(task[1:])]
                    await handle.mark_pending_effect(
                        PendingEffect(effect, task, task, handle.token, checkpoint_id=c_n)
                    )
                else:
                    await self.saver.aput_writes(config(c_n), [("log", task)], task)
        self.clock.advance(TTL)
        current = await self.leases.get(key)
        assert current is not None
        return await self.leases.take_over(current, "B", TTL)


@pytest.fixture
def world(backend: str, request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[World]:
    if backend == "sqlite":
        engine = create_engine(f"sqlite+aiosqlite:///{tmp_path / 'stamps.db'}")
    else:
        url, schema = request.getfixturevalue("pg_schema")
        engine = create_engine(url, **pg_engine_options(schema))
    made = World(engine)
    yield made
    made.close()


def test_a_takeover_never_resumes_past_a_write_that_may_have_happened(world: World) -> None:
    @settings(
        max_examples=60,
        deadline=None,
        suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture],
    )
    @given(interleavings())
    def check(case: tuple[list[Effect], list[str], int]) -> None:
        effects, events, kill = case
        taken = world.run(world.scenario(effects, events, kill))
        assert taken is not None
        dead, rerun = model(effects, events[:kill])
        where = f"{effects} {events[:kill]} | killed before {events[kill:]}"
        assert (taken.status is LeaseStatus.DEAD_LETTERED) == dead, where
        if not dead:
            # The guarantee: nothing a resume re-runs is a write that may have happened.
            stamped_again = {
                f"t{i}"
                for i, effect in enumerate(effects)
                if effect is Effect.NON_IDEMPOTENT_WRITE and f"stamp t{i}" in events[:kill]
            }
            assert not (stamped_again & rerun), where
            assert taken.pending_effects == ()

    check()

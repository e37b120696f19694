"""LISTEN/NOTIFY on PostgreSQL (issue 14): what becomes runnable wakes a serving instance at
once, and a submitted run's end wakes its ``result()``; polling stays the fallback.

Each server here polls once and then waits a minute, so only a notification can wake it
within the test's deadline.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any, TypedDict

import pytest
from langchain_core.runnables import RunnableConfig
from langgraph.errors import GraphDrained
from langgraph.graph import END, START, StateGraph
from sqlalchemy import text

from langgraph_fence import ExecutionLeaseLostError, Instance, fence_graph
from langgraph_fence.testing import ManualClock
from tests.support.databases import Database, pg_engine_options, unique
from tests.support.polling import eventually

pytestmark = pytest.mark.parametrize("database", ["postgresql"], indirect=True)

#: Far longer than any deadline below: a server waiting this long was not woken.
POLL = 60.0


class State(TypedDict, total=False):
    text: str
    seen: list[str]


class Steps:
    """Two steps; the first waits for ``go`` on the instance named ``hold_on``."""

    def __init__(self, hold_on: str) -> None:
        self.hold_on = hold_on
        self.go = asyncio.Event()
        self.entered = asyncio.Event()
        self.ran: list[tuple[str, str]] = []  # (instance, step)

    def graph(self, instance: Instance) -> Any:
        async def first(state: State, config: RunnableConfig) -> dict[str, Any]:
            self.ran.append((instance.instance_id, "first"))
            if instance.instance_id == self.hold_on:
                self.entered.set()
                await self.go.wait()
            return {"seen": ["first"]}

        async def second(state: State) -> dict[str, Any]:
            self.ran.append((instance.instance_id, "second"))
            return {"seen": [*state.get("seen", []), "second"]}

        builder = StateGraph(State)
        builder.add_node("first", first)
        builder.add_node("second", second)
        builder.add_edge(START, "first")
        builder.add_edge("first", "second")
        builder.add_edge("second", END)
        return fence_graph(builder).compile(checkpointer=instance.checkpointer, name="steps")


@asynccontextmanager
async def opened(database: Database, name: str, **options: Any) -> AsyncIterator[Instance]:
    async with Instance.open(
        database.url,
        engine_options=pg_engine_options(database.schema),
        instance_id=name,
        **options,
    ) as instance:
        yield instance


@asynccontextmanager
async def serving(instance: Instance, steps: Steps, poll: float = POLL) -> AsyncIterator[None]:
    """``instance`` serving ``steps``' graph, its first look done."""
    stop = asyncio.Event()
    task = asyncio.create_task(
        instance.serve(
            {"steps": steps.graph(instance)}, poll_interval=poll, stop=stop, handle_signals=False
        )
    )
    queue = instance._run_queue()

    async def looked() -> bool:
        return instance.instance_id in (await queue.served()).get("steps", [])

    try:
        await eventually(looked, timeout=20, what="the server's first look")
        yield
    finally:
        stop.set()
        await asyncio.wait_for(task, 20)


def cfg(thread: str) -> dict[str, Any]:
    return {"configurable": {"thread_id": thread}}


def ran_on(steps: Steps, name: str) -> bool:
    return (name, "second") in steps.ran


async def test_a_handed_back_run_wakes_a_serving_instance_at_once(database: Database) -> None:
    a_name, b_name = unique("a"), unique("b")
    steps = Steps(hold_on=a_name)
    async with opened(database, a_name) as a, opened(database, b_name) as b, serving(b, steps):
        run = asyncio.create_task(
            a.ainvoke(steps.graph(a), {"text": "x"}, cfg(unique("t")), tenant_id="acme")
        )
        await asyncio.wait_for(steps.entered.wait(), 20)
        (held,) = a.host.runs
        held.control.request_drain("handed back by the test")  # as serve() does on stop
        steps.go.set()
        with pytest.raises(GraphDrained):
            await run  # drained after its first step, handed back pending
        await eventually(lambda: ran_on(steps, b_name), timeout=10, what="B's takeover")
    assert steps.ran == [(a_name, "first"), (b_name, "second")]


async def test_a_run_whose_lease_lapsed_is_handed_back_and_wakes_a_server(
    database: Database,
) -> None:
    """A's lease lapses by its own clock (its renewals could not be proven in time); the
    store would keep the lease for its whole TTL, but A hands it back and B takes it at
    once."""
    a_name, b_name = unique("a"), unique("b")
    steps = Steps(hold_on=a_name)
    clock = ManualClock()
    async with (
        opened(database, a_name, clock=clock, sleep=clock.sleep, lease_ttl=30.0) as a,
        opened(database, b_name) as b,
        serving(b, steps),
    ):
        run = asyncio.create_task(
            a.ainvoke(steps.graph(a), {"text": "x"}, cfg(unique("t")), tenant_id="acme")
        )
        await asyncio.wait_for(steps.entered.wait(), 20)
        clock.advance(31.0)  # A's window ran out: its watchdog stops the run
        with pytest.raises(ExecutionLeaseLostError):
            await asyncio.wait_for(run, 20)
        await eventually(lambda: ran_on(steps, b_name), timeout=10, what="B's takeover")
    assert (b_name, "first") in steps.ran  # the first step had not finished on A


async def test_result_is_woken_at_the_runs_end(database: Database) -> None:
    b_name = unique("b")
    steps = Steps(hold_on=b_name)
    async with opened(database, unique("client")) as client, opened(database, b_name) as b:
        queue = client._run_queue()
        looks = 0
        state = queue.state

        async def counted(key: Any, run_id: Any = None) -> Any:
            nonlocal looks
            looks += 1
            return await state(key, run_id)

        queue.state = counted  # type: ignore[method-assign]
        async with serving(b, steps, poll=0.05):
            run = await client.submit("steps", {"text": "x"}, cfg(unique("t")), tenant_id="acme")
            await asyncio.wait_for(steps.entered.wait(), 20)
            # Its fallback look is every 30 s: only the end's NOTIFY returns it in time.
            result = asyncio.create_task(run.result(poll_interval=30))
            await eventually(lambda: looks >= 1, timeout=10, what="result()'s first look")
            steps.go.set()
            assert (await asyncio.wait_for(result, 10))["seen"] == ["first", "second"]
    assert looks == 2  # one before the end, one after it: woken, not polling


async def test_a_dropped_listen_connection_is_opened_again(database: Database) -> None:
    b_name = unique("b")
    steps = Steps(hold_on="nobody")
    async with (
        opened(database, unique("client")) as client,
        opened(database, b_name) as b,
        serving(b, steps),
    ):
        notifications = b._run_queue().notifications
        assert notifications is not None
        first = notifications.backend_pid
        assert first is not None
        async with client._run_queue()._engine.connect() as conn:
            await conn.execute(text("SELECT pg_terminate_backend(:pid)"), {"pid": first})
        await eventually(
            lambda: notifications.backend_pid not in (None, first),
            timeout=10,
            what="the LISTEN connection opened again",
        )
        run = await client.submit("steps", {"text": "x"}, cfg(unique("t")), tenant_id="acme")
        with contextlib.suppress(TimeoutError):
            await run.result(timeout=10)
        assert ran_on(steps, b_name), "a submit after the drop did not wake the server"

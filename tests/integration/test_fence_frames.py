"""The fence at the edges of a yield and of a frame (issue 31, items 1 and 2).

1. While a wait for ``ANY_INSTANCE`` children has yielded the root lease, code of the waiting
   step itself that runs beside the wait (another task of the step) either takes the lease
   again first, as steps do (a fenced tool's stamp, a store write, a side effect and the
   sink inside it, a spawn, ``confirm_now()``), or is refused with
   ``ExecutionContextUnavailableError`` naming the yield (``assert_held()``, the sink outside
   a side effect): never a fencing error, never a recorded lease loss, never a write under
   the yielded token.
2. An ancestor's fence used inside a child step (``PARENT_INSTANCE``, and ``ANY_INSTANCE``
   while the parent's lease is yielded) is refused with ``ExecutionContextUnavailableError``
   before anything is written.

On SQLite and PostgreSQL (the ``database`` fixture), with the ``leases`` tools (a
ManualClock); a second instance serves the children, each held in its node until the test
opens its gate. The yield is heard from the parent's events, never waited for with sleeps.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass
from typing import Any

import pytest
from langchain_core.tools import tool
from langgraph.graph import END, START, StateGraph
from langgraph.store.base import BaseStore
from langgraph.store.memory import InMemoryStore
from sqlalchemy import text
from sqlalchemy.ext.asyncio import AsyncEngine

from checkpointers import SqlStore
from langgraph_fence import (
    ChildPlacement,
    Effect,
    ExecutionContext,
    ExecutionContextUnavailableError,
    ExecutionFence,
    FencedStore,
    Instance,
    LeaseKey,
    LeaseStatus,
    fence_graph,
    fence_tools,
    fenced,
    get_execution_context,
    scope_key,
)
from langgraph_fence.database import transaction
from langgraph_fence.events import EventKind, FenceEvent
from langgraph_fence.execution.children import child_execution_id
from langgraph_fence.lease.transitions import is_yielded
from langgraph_fence.sinks import fenced_write, setup_sink
from langgraph_fence.testing import Leases, open_leases
from tests.support.children import Fan, Job, Work, child_graph
from tests.support.databases import Database, pg_engine_options, unique
from tests.support.polling import eventually
from tests.support.serving import cfg, serving

TENANT = "acme"


@pytest.fixture
async def leases(database: Database) -> AsyncIterator[Leases]:
    options = pg_engine_options(database.schema) if database.schema else {}
    async with open_leases(database.url, **options) as opened:
        await setup_sink(opened.engine)
        yield opened


async def sink_write(engine: AsyncEngine, fence: ExecutionFence, key: str) -> int:
    """One write through the exactly-once sink; the token it was made under."""
    async with transaction(engine) as conn, fenced_write(conn, fence, key) as write:
        if not write.applied:
            write.record(write.token)
    return write.token


async def applied(engine: AsyncEngine) -> dict[str, tuple[str, int]]:
    """The sink's applied keys: idempotency key -> (scope key, token)."""
    async with engine.connect() as conn:
        rows = await conn.execute(
            text("SELECT scope_key, idempotency_key, token FROM fence_applied")
        )
        return {row.idempotency_key: (row.scope_key, int(row.token)) for row in rows}


def one_step(state: Any, step: str, node: Any, **compile: Any) -> Any:
    """A fenced graph of one step, called ``step``."""
    builder = StateGraph(state)
    builder.add_node(step, node)
    builder.add_edge(START, step)
    builder.add_edge(step, END)
    return fence_graph(builder).compile(**compile)


def hear_yields(instance: Instance) -> tuple[asyncio.Event, list[tuple[str, int]]]:
    """An event set at the instance's first yield, and its yields and re-takes in order."""
    heard = asyncio.Event()
    marks: list[tuple[str, int]] = []

    def listener(event: FenceEvent) -> None:
        if event.kind in (EventKind.YIELDED, EventKind.RETAKEN):
            marks.append((event.kind.value, event.token))
        if event.kind is EventKind.YIELDED:
            heard.set()

    instance.add_listener(listener)
    return heard, marks


async def child_started(leases: Leases, work: Work, text_: str) -> bool:
    """Whether the worker runs the child of ``text_`` (its poll is woken by the clock)."""
    leases.advance(0.05)
    return text_ in work.ran


# -- item 1: the waiting step's own code beside a yielded wait


@dataclass
class Beside:
    """What the waiting step did beside its wait, once the lease was yielded."""

    yielded_then: bool = False
    outcome: Any = None
    error: BaseException | None = None


Act = Callable[[ExecutionContext, Leases], Awaitable[Any]]


def waiting_graph(
    instance: Instance, leases: Leases, act: Act, beside: Beside, gate: asyncio.Event
) -> Any:
    """One step: spawns an ANY_INSTANCE child and waits for it; beside the wait, once the
    lease is yielded, it runs ``act`` (in a task of its own, the step's frame), then opens
    the child's gate."""
    heard, _ = hear_yields(instance)

    @fenced(effect=Effect.NON_IDEMPOTENT_WRITE, stamp="effect")
    async def wait(state: Fan) -> dict[str, Any]:
        ctx = get_execution_context()
        child = await ctx.spawn_child(
            "shout", {"text": "a"}, placement=ChildPlacement.ANY_INSTANCE, key="c0"
        )

        async def then() -> None:
            await heard.wait()
            try:
                lease = await leases.store.get(LeaseKey(TENANT, ctx.thread_id))
                beside.yielded_then = lease is not None and is_yielded(lease.status, lease.holder)
                beside.outcome = await act(ctx, leases)
            except Exception as exc:
                beside.error = exc
            finally:
                gate.set()  # the child ends; the wait takes the lease again and returns

        results, _ = await asyncio.gather(ctx.wait_children([child], timeout=30), then())
        return {"results": [r["out"] for r in results]}

    return one_step(Fan, "wait", wait, checkpointer=instance.checkpointer, name="waiting")


@tool
async def charge(order: str) -> int:
    """Charge an order (a non-idempotent write): the token it ran under."""
    fence = get_execution_context().fence
    fence.assert_held()
    return fence.token


@tool
def charge_sync(order: str) -> int:
    """Charge an order from a worker thread: the token it ran under."""
    fence = get_execution_context().fence
    fence.assert_held()
    return fence.token


async def by_tool(ctx: ExecutionContext, leases: Leases) -> Any:
    [fenced_charge] = fence_tools([charge])  # undeclared: NON_IDEMPOTENT_WRITE
    return await fenced_charge.ainvoke({"order": "o1"})


async def by_sync_tool(ctx: ExecutionContext, leases: Leases) -> Any:
    [fenced_charge] = fence_tools([charge_sync])
    # Called from a worker thread, as a sync step calls it: the re-take goes to the loop.
    return await asyncio.to_thread(fenced_charge.invoke, {"order": "o1"})


async def _put(store: BaseStore, ctx: ExecutionContext) -> Any:
    await store.aput(("orders",), "o1", {"charged": True})
    item = await store.aget(("orders",), "o1")
    assert item is not None
    assert item.value == {"charged": True}
    return ctx.fence.token


async def by_sql_store(ctx: ExecutionContext, leases: Leases) -> Any:
    inner = SqlStore(leases.engine)  # checks the token inside its own write statement
    await inner.setup()
    return await _put(FencedStore(inner), ctx)


async def by_other_store(ctx: ExecutionContext, leases: Leases) -> Any:
    return await _put(FencedStore(InMemoryStore()), ctx)  # checked by one read, then written


async def by_confirm(ctx: ExecutionContext, leases: Leases) -> Any:
    await ctx.fence.confirm_now()
    return ctx.fence.token


async def by_sync_confirm(ctx: ExecutionContext, leases: Leases) -> Any:
    def confirm() -> int:
        ctx.fence.confirm_now()  # a sync step's form: blocks until confirmed
        return ctx.fence.token

    return await asyncio.to_thread(confirm)


async def by_side_effect(ctx: ExecutionContext, leases: Leases) -> Any:
    async with ctx.side_effect():  # the step's stamp="effect" write is stamped here
        return ctx.fence.token


async def by_sink_in_side_effect(ctx: ExecutionContext, leases: Leases) -> Any:
    async with ctx.side_effect():  # holds the lease; the sink's transaction opens inside
        return await sink_write(leases.engine, ctx.fence, "charge")


async def by_spawn(ctx: ExecutionContext, leases: Leases) -> Any:
    await ctx.spawn_child("shout", {"text": "b"}, placement=ChildPlacement.ANY_INSTANCE, key="c1")
    return ctx.fence.token


RETAKING: dict[str, Act] = {
    "tool": by_tool,
    "sync-tool": by_sync_tool,
    "sql-store": by_sql_store,
    "other-store": by_other_store,
    "confirm-now": by_confirm,
    "sync-confirm-now": by_sync_confirm,
    "side-effect": by_side_effect,
    "sink-in-side-effect": by_sink_in_side_effect,
    "spawn": by_spawn,
}


async def run_beside_a_yield(leases: Leases, act: Act) -> tuple[Beside, Any, list[Any]]:
    """Run the waiting graph with ``act`` beside its yielded wait: what happened beside it,
    the run's output, and the parent's yields and re-takes."""
    parent = leases.instance("parent")
    worker = leases.instance("worker", lease_ttl=120.0)  # outlasts the clock jumps here
    work, beside, gate = Work(), Beside(), asyncio.Event()
    work.gates["a"] = gate
    _, marks = hear_yields(parent)
    graph = waiting_graph(parent, leases, act, beside, gate)
    thread = unique("wait")
    async with serving(worker, {"shout": child_graph(worker, work)}):
        # durability="sync": the superstep's checkpoint is stored before the step runs. With
        # "async" it may still be on its way when the wait yields, and take the lease again
        # (as it must) before the act runs, which would then find it held.
        run = asyncio.create_task(
            parent.ainvoke(graph, {"items": []}, cfg(thread), tenant_id=TENANT, durability="sync")
        )
        try:
            await eventually(lambda: child_started(leases, work, "a"), what="the child to run")
            out = await asyncio.wait_for(run, 30)
        finally:
            if not run.done():
                run.cancel()
    lease = await leases.store.get(LeaseKey(TENANT, thread))
    assert lease is not None
    assert lease.status is LeaseStatus.DONE, lease
    return beside, out, marks


@pytest.mark.parametrize("name", list(RETAKING))
async def test_a_write_beside_a_yielded_wait_takes_the_lease_again_first(
    leases: Leases, name: str
) -> None:
    beside, out, marks = await run_beside_a_yield(leases, RETAKING[name])
    # The run was not fenced and lost nothing: it ended done with its child's output.
    assert out["results"] == ["A"]
    assert beside.yielded_then  # the write was asked for while the lease stood yielded
    assert beside.error is None, repr(beside.error)
    # It ran under the lease taken again (epoch 2), never under the yielded token 1.
    assert marks[:2] == [("yielded", 1), ("retaken", 2)]
    assert beside.outcome == 2
    if name == "sink-in-side-effect":
        assert (await applied(leases.engine))["charge"][1] == 2


async def _assert_held(ctx: ExecutionContext, leases: Leases) -> None:
    ctx.fence.assert_held()


async def _sink(ctx: ExecutionContext, leases: Leases) -> None:
    await sink_write(leases.engine, ctx.fence, "charge")


REFUSED: dict[str, Callable[[ExecutionContext, Leases], Awaitable[None]]] = {
    "assert_held()": _assert_held,
    "fenced_write()": _sink,
}


@pytest.mark.parametrize("name", list(REFUSED))
async def test_a_check_or_sink_beside_a_yielded_wait_is_refused_and_records_no_loss(
    leases: Leases, name: str
) -> None:
    async def check(ctx: ExecutionContext, leases: Leases) -> Any:
        refused: list[BaseException] = []
        for _ in range(2):
            try:
                await REFUSED[name](ctx, leases)
            except Exception as exc:
                refused.append(exc)
            # Past the parent's lease TTL (30 s): a yielded lease is no lost one.
            leases.advance(31.0)
        return refused

    beside, out, marks = await run_beside_a_yield(leases, check)
    assert out["results"] == ["A"]  # no lease loss was recorded: the run ended done
    assert beside.yielded_then
    assert beside.error is None, repr(beside.error)
    assert [type(e) for e in beside.outcome] == [ExecutionContextUnavailableError] * 2
    said = str(beside.outcome[0])
    assert said.startswith(f"{name} under the fence of node 'wait'")
    assert "wait for remote children" in said
    assert "yielded it at token 1" in said
    assert "side_effect()" in said  # what to do
    assert marks[0] == ("yielded", 1)
    assert await applied(leases.engine) == {}  # nothing written under the yielded token


# -- item 2: an ancestor's fence inside a child step


async def ancestor_acts(
    leases: Leases, ancestor: ExecutionFence, refused: list[BaseException]
) -> None:
    """Use ``ancestor`` in the running child step: each use must be refused."""

    async def assert_held() -> None:
        ancestor.assert_held()

    async def confirm_now() -> None:
        await ancestor.confirm_now()

    uses: list[Callable[[], Awaitable[Any]]] = [
        assert_held,
        confirm_now,
        lambda: sink_write(leases.engine, ancestor, "by-ancestor"),
    ]
    for use in uses:
        try:
            await use()
        except Exception as exc:
            refused.append(exc)


def assert_refused_inside(refused: list[BaseException], child_node: str) -> None:
    assert [type(e) for e in refused] == [ExecutionContextUnavailableError] * 3, refused
    for error in refused:
        said = str(error)
        assert "node 'parent'" in said
        assert f"inside another step, node {child_node!r}" in said
        assert "get_execution_context().fence" in said  # what to do


async def test_a_parents_fence_is_refused_inside_a_parent_instance_child(
    leases: Leases,
) -> None:
    instance = leases.instance("parent")
    refused: list[BaseException] = []
    kept: dict[str, ExecutionFence] = {}
    own: list[int] = []

    async def inner(state: Job) -> dict[str, Any]:
        ctx = get_execution_context()
        ancestor = kept["parent"]
        assert ancestor.token == ctx.fence.token  # the root's lease and token, yet not its frame
        await ancestor_acts(leases, ancestor, refused)
        own.append(await sink_write(leases.engine, ctx.fence, "by-child"))  # its own works
        return {"out": "done"}

    local_graph = one_step(Job, "inner", inner, name="local")

    async def parent(state: Fan) -> dict[str, Any]:
        ctx = get_execution_context()
        kept["parent"] = ctx.fence
        child = await ctx.spawn_child(
            "local", {}, placement=ChildPlacement.PARENT_INSTANCE, key="c0", graph=local_graph
        )
        [result] = await ctx.wait_children([child], timeout=30)
        ctx.fence.assert_held()  # in its own step, the parent's fence works
        return {"results": [result["out"]]}

    graph = one_step(Fan, "parent", parent, checkpointer=instance.checkpointer, name="tree")
    thread = unique("tree")
    out = await instance.ainvoke(graph, {"items": []}, cfg(thread), tenant_id=TENANT)
    assert out["results"] == ["done"]
    assert_refused_inside(refused, "inner")
    # Nothing was written under the parent's fence: only the child's own write landed.
    assert await applied(leases.engine) == {"by-child": (scope_key(TENANT, thread), own[0])}


async def test_a_parents_fence_is_refused_inside_an_any_instance_child_while_yielded(
    leases: Leases,
) -> None:
    parent = leases.instance("parent")
    worker = leases.instance("worker", lease_ttl=120.0)
    heard, _ = hear_yields(parent)
    refused: list[BaseException] = []
    kept: dict[str, ExecutionFence] = {}
    used = asyncio.Event()

    async def shout(state: Job) -> dict[str, Any]:
        ctx = get_execution_context()
        await heard.wait()  # the parent waits for this child with its lease yielded
        await ancestor_acts(leases, kept["parent"], refused)
        await sink_write(leases.engine, ctx.fence, "by-child")  # its own fence works
        used.set()
        return {"out": state["text"].upper()}

    child_graph_ = one_step(Job, "shout", shout, checkpointer=worker.checkpointer, name="shout")

    async def fan(state: Fan) -> dict[str, Any]:
        ctx = get_execution_context()
        kept["parent"] = ctx.fence
        spawned = await ctx.spawn_child(
            "shout", {"text": "a"}, placement=ChildPlacement.ANY_INSTANCE, key="c0"
        )
        results = await ctx.wait_children([spawned], timeout=30)
        return {"results": [r["out"] for r in results]}

    graph = one_step(Fan, "parent", fan, checkpointer=parent.checkpointer, name="fan")
    thread = unique("fan")

    async def child_done() -> bool:
        leases.advance(0.05)  # wakes the worker's poll
        return used.is_set()

    async with serving(worker, {"shout": child_graph_}):
        run = asyncio.create_task(  # durability="sync": see run_beside_a_yield
            parent.ainvoke(graph, {"items": []}, cfg(thread), tenant_id=TENANT, durability="sync")
        )
        try:
            await eventually(child_done, what="the child to use the parent's fence")
            out = await asyncio.wait_for(run, 30)
        finally:
            if not run.done():
                run.cancel()
    assert out["results"] == ["A"]
    assert_refused_inside(refused, "shout")
    # Nothing was written under the parent's key and token; the child's own write was made
    # under its own scope key.
    child_scope = scope_key(TENANT, child_execution_id(LeaseKey(TENANT, thread), "c0"))
    assert await applied(leases.engine) == {"by-child": (child_scope, 1)}

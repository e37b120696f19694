"""The remote-children wait's yield (issue 11): while a step waits for ANY_INSTANCE children,
the root lease is given up ONLY while no other step of the tree runs, and taken again (epoch
+ 1) before any step of the tree runs or the wait returns.

In-process instances on the ``leases`` fixture (SQLite, a ManualClock); a second instance
serves the children. The order of what happened is read from the parent instance's events
(``yielded``, ``retaken``) and marks the steps leave, never from sleeps.
"""

from __future__ import annotations

import asyncio
import operator
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from typing import Annotated, Any, TypedDict

import pytest
from langgraph.graph import END, START, StateGraph

from langgraph_fence import (
    ChildPlacement,
    ExecutionBusyError,
    ExecutionFencedError,
    ExecutionLeaseHeldError,
    Instance,
    LeaseKey,
    LeaseStatus,
    fence_graph,
    get_execution_context,
)
from langgraph_fence.events import EventKind, FenceEvent
from langgraph_fence.execution.children import child_execution_id
from langgraph_fence.lease.transitions import is_yielded
from langgraph_fence.testing import Leases
from tests.support.children import Job, Work, child_graph
from tests.support.databases import unique
from tests.support.graphs import one_step
from tests.support.polling import eventually
from tests.support.serving import cfg, serving

TENANT = "acme"
ITEMS = ["a", "b", "c"]


class Tree(TypedDict, total=False):
    items: list[str]
    results: list[str]
    local: Annotated[list[str], operator.add]


@dataclass
class Timeline:
    """What happened, in order: ``(what, token)``; the parent's lease events among them."""

    marks: list[tuple[str, int]] = field(default_factory=list)

    def mark(self, what: str) -> None:
        self.marks.append((what, get_execution_context().fence.token))

    def listen(self, instance: Instance) -> None:
        def heard(event: FenceEvent) -> None:
            if event.kind in (EventKind.YIELDED, EventKind.RETAKEN):
                self.marks.append((event.kind.value, event.token))

        instance.add_listener(heard)

    def index(self, what: str) -> int:
        return [m[0] for m in self.marks].index(what)


async def spawn_all(items: list[str]) -> list[Any]:
    ctx = get_execution_context()
    return [
        await ctx.spawn_child(
            "shout", {"text": item}, placement=ChildPlacement.ANY_INSTANCE, key=f"c{i}"
        )
        for i, item in enumerate(items)
    ]


def two_branches(instance: Instance, timeline: Timeline, b_go: asyncio.Event) -> Any:
    """Branch A waits on three ANY_INSTANCE children; branch B (same superstep) runs a slow
    local step whose writes are checkpointed."""

    async def a(state: Tree) -> dict[str, Any]:
        timeline.mark("a-start")
        children = await spawn_all(state["items"])
        results = await get_execution_context().wait_children(children, timeout=30)
        timeline.mark("a-continues")
        return {"results": [r["out"] for r in results]}

    async def b(state: Tree) -> dict[str, Any]:
        timeline.mark("b-start")
        await b_go.wait()
        get_execution_context().fence.assert_held()
        timeline.mark("b-end")
        return {"local": ["b"]}

    builder = StateGraph(Tree)
    builder.add_node("a", a)
    builder.add_node("b", b)
    builder.add_edge(START, "a")
    builder.add_edge(START, "b")
    builder.add_edge("a", END)
    builder.add_edge("b", END)
    return fence_graph(builder).compile(checkpointer=instance.checkpointer, name="branches")


async def lease_of(leases: Leases, key: LeaseKey) -> Any:
    lease = await leases.store.get(key)
    assert lease is not None
    return lease


async def children_running(leases: Leases, root: LeaseKey) -> bool:
    """All three children held by the worker (the worker's poll is woken by the clock)."""
    leases.advance(0.05)
    for i in range(len(ITEMS)):
        lease = await leases.store.get(LeaseKey(TENANT, child_execution_id(root, f"c{i}")))
        if lease is None or lease.status is not LeaseStatus.RUNNING:
            return False
    return True


@dataclass
class Scene:
    """A parent instance running ``graph`` on a new thread, a worker serving the children
    (each held in its node until its gate opens), and what the test watches."""

    leases: Leases
    parent: Instance
    root: LeaseKey
    work: Work
    timeline: Timeline
    b_go: asyncio.Event
    run: asyncio.Task[Any]
    graph: Any

    def open_gates(self) -> None:
        for item in ITEMS:
            self.work.gates[item].set()


@asynccontextmanager
async def scene(
    leases: Leases, make: Callable[[Instance, Timeline, asyncio.Event], Any]
) -> AsyncIterator[Scene]:
    parent = leases.instance("parent")
    worker = leases.instance("worker", lease_ttl=120.0)  # outlasts the clock jumps here
    work, timeline, b_go = Work(), Timeline(), asyncio.Event()
    timeline.listen(parent)
    for item in ITEMS:
        work.gates[item] = asyncio.Event()
    thread = unique("tree")
    graph = make(parent, timeline, b_go)
    async with serving(worker, {"shout": child_graph(worker, work)}):
        run = asyncio.create_task(
            parent.ainvoke(graph, {"items": ITEMS}, cfg(thread), tenant_id=TENANT)
        )
        root = LeaseKey(TENANT, thread)
        try:
            await eventually(lambda: children_running(leases, root))
            yield Scene(leases, parent, root, work, timeline, b_go, run, graph)
        finally:
            if not run.done():
                run.cancel()


async def test_the_lease_is_held_through_a_sibling_step_then_yielded_and_retaken(
    leases: Leases,
) -> None:
    async with scene(leases, two_branches) as seen:
        # A waits, B's step runs: the lease stays held (running, epoch 1) for B.
        lease = await lease_of(leases, seen.root)
        assert (lease.status, lease.holder, lease.epoch) == (LeaseStatus.RUNNING, "parent", 1)
        assert "yielded" not in [m[0] for m in seen.timeline.marks]
        seen.b_go.set()  # B ends (its writes are checkpointed under token 1)
        yielded = await eventually(
            lambda: _yielded(leases, seen.root), what="the root lease to be yielded"
        )
        assert yielded.epoch == 1
        # The keeper let go of it: nothing renews or watches a yielded lease, so the wait
        # outlasts the parent's TTL (30 s) many times over unharmed.
        assert seen.parent.host.keeper.held == 0
        leases.advance(100.0)
        # Yielded, its run still goes on: listed among the runs, and busy for a submit.
        assert seen.root in [r.key for r in await seen.parent._run_queue().runs()]
        with pytest.raises(ExecutionBusyError):
            await seen.parent.submit(
                "branches", {"items": ["z"]}, cfg(seen.root.execution_id), tenant_id=TENANT
            )
        # Yielded is held: a start on the thread (new input, or a resume) takes nothing.
        for start in ({"items": ["z"]}, None):
            with pytest.raises(ExecutionLeaseHeldError):
                await seen.parent.ainvoke(
                    seen.graph, start, cfg(seen.root.execution_id), tenant_id=TENANT
                )
        assert await _yielded(leases, seen.root) == yielded
        # An input queued behind it waits for the tree's end: no worker begins it meanwhile.
        queued = await seen.parent.submit(
            "branches",
            {"items": ["q"]},
            cfg(seen.root.execution_id),
            tenant_id=TENANT,
            on_busy="enqueue",
        )
        assert (await queued.state()).queued
        assert await seen.parent._run_queue().promote() == 0
        assert await _yielded(leases, seen.root) == yielded
        # Cancelled while queued: once the tree ends, no look of a server begins it.
        assert await queued.cancel()
        seen.open_gates()
        out = await asyncio.wait_for(seen.run, 30)
    assert out["results"] == ["A", "B", "C"]
    assert out["local"] == ["b"]  # B's checkpointed writes landed
    assert sorted(seen.work.ran) == ITEMS  # each child ran once
    timeline, marks = seen.timeline, seen.timeline.marks
    # B ran whole under token 1; the yield came only after B's step; the re-take at epoch
    # 2 came before A went on, and A went on under token 2.
    assert ("b-start", 1) in marks
    assert ("b-end", 1) in marks
    assert timeline.index("b-end") < timeline.index("yielded")
    assert marks[timeline.index("yielded")] == ("yielded", 1)
    assert marks[timeline.index("retaken")] == ("retaken", 2)
    assert timeline.index("retaken") < timeline.index("a-continues")
    assert marks[timeline.index("a-continues")] == ("a-continues", 2)
    final = await lease_of(leases, seen.root)
    assert (final.status, final.epoch) == (LeaseStatus.DONE, 2)


async def _yielded(leases: Leases, key: LeaseKey) -> Any:
    lease = await leases.store.get(key)
    if lease is not None and is_yielded(lease.status, lease.holder):
        return lease
    return None


def late_local_step(instance: Instance, timeline: Timeline, b_go: asyncio.Event) -> Any:
    """A waits on three ANY_INSTANCE children and, beside the wait, starts a local step B
    (a PARENT_INSTANCE child) only once the lease has been yielded."""

    async def b(state: Job) -> dict[str, Any]:
        timeline.mark("b-start")
        return {"out": "local"}

    local = StateGraph(Job)
    local.add_node("b", b)
    local.add_edge(START, "b")
    local.add_edge("b", END)
    local_graph = fence_graph(local).compile(name="local")

    async def a(state: Tree) -> dict[str, Any]:
        ctx = get_execution_context()
        children = await spawn_all(state["items"])

        async def later() -> Any:
            await b_go.wait()
            child = await ctx.spawn_child(
                "local",
                {"text": "x"},
                placement=ChildPlacement.PARENT_INSTANCE,
                key="b",
                graph=local_graph,
            )
            return (await ctx.wait_children([child]))[0]

        results, here = await asyncio.gather(ctx.wait_children(children, timeout=30), later())
        timeline.mark("a-continues")
        return {"results": [r["out"] for r in results], "local": [here["out"]]}

    return one_step(instance, Tree, "a", a, name="late")


async def test_a_step_that_starts_while_yielded_runs_after_the_retake(leases: Leases) -> None:
    async with scene(leases, late_local_step) as seen:
        await eventually(lambda: _yielded(leases, seen.root), what="the root lease to be yielded")
        seen.b_go.set()  # B starts while A is yielded
        # B's step runs (re-taken first: the order is checked below). Once it ends, A's wait
        # alone is left and the tree may yield again: the keeper's count is no witness here.
        await eventually(lambda: "b-start" in [m[0] for m in seen.timeline.marks])
        seen.open_gates()
        out = await asyncio.wait_for(seen.run, 30)
    assert out["results"] == ["A", "B", "C"]
    assert out["local"] == ["local"]
    assert sorted(seen.work.ran) == ITEMS
    timeline, marks = seen.timeline, seen.timeline.marks
    # B's step ran only after a re-take, under the token that re-take took. (Between the
    # spawn's own re-take and B's first step nothing of the tree runs, so the wait may yield
    # once more there: B then re-takes again, at the next token.)
    assert marks[timeline.index("yielded")] == ("yielded", 1)
    assert timeline.index("yielded") < timeline.index("retaken") < timeline.index("b-start")
    assert marks[timeline.index("retaken")] == ("retaken", 2)
    b_start = timeline.index("b-start")
    lease_events = [mark for mark in marks[:b_start] if mark[0] in ("yielded", "retaken")]
    assert lease_events[-1] == ("retaken", marks[b_start][1])
    # Every yield was re-taken before the tree went on: A continued under the last token.
    tokens = [token for what, token in marks if what == "retaken"]
    assert marks[timeline.index("a-continues")] == ("a-continues", tokens[-1])


async def test_a_waiter_stalled_while_a_sibling_holds_the_lease_is_taken_over(
    leases: Leases,
) -> None:
    # B's step keeps the lease held (no yield); the parent freezes past its lease; another
    # instance takes the tree over and re-runs both branches; A's re-run finds the three
    # children it spawned; each child runs once; the frozen parent stops fenced.
    async with scene(leases, two_branches) as seen:
        taker = leases.instance("taker")
        leases.stall(seen.parent)
        leases.advance(31.0)  # past the parent's lease TTL (30 s)
        graph = two_branches(taker, seen.timeline, seen.b_go)
        async with serving(taker, {"branches": graph}):
            await eventually(lambda: _held_by(leases, seen.root, "taker"))
            seen.b_go.set()
            seen.open_gates()
            await eventually(lambda: _status(leases, seen.root, LeaseStatus.DONE))
        leases.resume(seen.parent)
        with pytest.raises(ExecutionFencedError):
            await asyncio.wait_for(seen.run, 30)
    assert sorted(seen.work.ran) == ITEMS  # each child ran once
    # The stalled parent never yielded: B's step held the lease the whole time it ran.
    assert ("yielded", 1) not in seen.timeline.marks


async def _held_by(leases: Leases, key: LeaseKey, holder: str) -> bool:
    lease = await leases.store.get(key)
    return lease is not None and lease.holder == holder and lease.status is LeaseStatus.RUNNING


async def _status(leases: Leases, key: LeaseKey, status: LeaseStatus) -> bool:
    lease = await leases.store.get(key)
    return lease is not None and lease.status is status

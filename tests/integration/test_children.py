"""Child executions (issue 11): ANY_INSTANCE children spawned by a step, served by another
instance, waited for; on SQLite and PostgreSQL (the ``database`` fixture).

The worker is ``serve()`` of a second instance on the same database, in this process: what
a spawn leaves must be all another process needs.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import subprocess
import sys
from typing import Any

import pytest
from langgraph.graph import END, START, StateGraph
from sqlalchemy import text

from langgraph_fence import (
    ChildFailedError,
    ChildPlacement,
    ExecutionFencedError,
    ExecutionLeaseHeldError,
    Instance,
    LeaseKey,
    LeaseStatus,
    fence_graph,
    get_execution_context,
    parse_scope_key,
    scope_key,
)
from langgraph_fence.execution.children import (
    CHILD_ID_PREFIX,
    child_execution_id,
    parse_child_execution_id,
)
from langgraph_fence.lease.transitions import is_yielded
from langgraph_fence.sinks import setup_sink
from langgraph_fence.testing import Leases
from tests.support.children import Fan, Job, Work, child_graph, lease_rows
from tests.support.databases import Database, unique
from tests.support.graphs import one_step
from tests.support.polling import eventually
from tests.support.serving import cfg, opened, serving, until_status

TENANT = "acme"


def parent_graph(instance: Instance, work: Work, *, return_exceptions: bool = False) -> Any:
    async def fan_out(state: Fan) -> dict[str, Any]:
        ctx = get_execution_context()
        work.tokens.append((ctx.fence.scope_key, ctx.fence.token))
        await work.write_through_sink("parent")
        children = [
            await ctx.spawn_child(
                "shout", {"text": item}, placement=ChildPlacement.ANY_INSTANCE, key=f"c{i}"
            )
            for i, item in enumerate(state["items"])
        ]
        work.spawned.extend(child.spawned for child in children)
        results = await ctx.wait_children(children, timeout=30, return_exceptions=return_exceptions)
        return {"results": [r["out"] if isinstance(r, dict) else type(r).__name__ for r in results]}

    return one_step(instance, Fan, "fan_out", fan_out, name="fan")


async def is_yielded_by(leases: Leases, key: LeaseKey, holder: str) -> bool:
    """Whether ``holder`` has yielded the lease of ``key`` (waiting, its holder kept)."""
    lease = await leases.store.get(key)
    return lease is not None and lease.holder == holder and is_yielded(lease.status, lease.holder)


def test_child_ids_are_decodable_and_collision_free() -> None:
    parent = LeaseKey("t:1", "order:42")
    child = child_execution_id(parent, "a:b")
    assert parse_child_execution_id(child) == (parent, "a:b")
    # The separators of the parts are escaped: these never meet.
    assert child != child_execution_id(LeaseKey("t:1", "order"), "42:a:b")
    assert child_execution_id(parent, "x") != child_execution_id(parent, "y")
    grandchild = child_execution_id(LeaseKey("t:1", child), "g")
    assert parse_child_execution_id(grandchild) == (LeaseKey("t:1", child), "g")
    assert parse_child_execution_id("order-42") is None
    # An id of your own shaped like a child's (as child ids were before) is not a child.
    assert parse_child_execution_id(scope_key("t:1", "order:42", "a:b")) is None
    # The child's own scope key decodes to its tenant and its id.
    assert parse_scope_key(scope_key("t:1", child)) == ("t:1", child)


async def test_children_run_on_another_instance_once_each(database: Database) -> None:
    async with opened(database, "parent") as parent, opened(database, "worker") as worker:
        work = Work()
        thread = unique("fan")
        graph = parent_graph(parent, work)
        async with serving(worker, {"shout": child_graph(worker, work)}):
            out = await parent.ainvoke(
                graph, {"items": ["a", "b", "c"]}, cfg(thread), tenant_id=TENANT
            )
        assert out["results"] == ["A", "B", "C"]  # in the order given
        assert sorted(work.ran) == ["a", "b", "c"]  # each child ran once
        assert work.spawned == [True, True, True]
        # Each child is an execution of its own: the tenant's, a derived id, its own epoch,
        # ended done with its output stored.
        parent_key = LeaseKey(TENANT, thread)
        rows = await lease_rows(parent, child_execution_id(parent_key, "c")[:-1])
        assert [(r[0], r[1]) for r in rows] == [
            (child_execution_id(parent_key, f"c{i}"), "done") for i in range(3)
        ]
        state = parent.get_run(child_execution_id(parent_key, "c1"), tenant_id=TENANT)
        assert await state.result(timeout=5) == {"text": "b", "out": "B"}


async def test_a_rerun_of_the_parent_step_spawns_nothing_twice(database: Database) -> None:
    async with opened(database, "parent") as parent, opened(database, "worker") as worker:
        work = Work()
        thread = unique("fan")
        graph = parent_graph(parent, work)
        async with serving(worker, {"shout": child_graph(worker, work)}):
            await parent.ainvoke(graph, {"items": ["a", "b"]}, cfg(thread), tenant_id=TENANT)
            # The same step again on the thread (a new run of the same input): the children
            # of the same keys are found with their results, none spawned or run again.
            out = await parent.ainvoke(graph, {"items": ["a", "b"]}, cfg(thread), tenant_id=TENANT)
        assert out["results"] == ["A", "B"]
        assert sorted(work.ran) == ["a", "b"]
        assert work.spawned == [True, True, False, False]


async def test_a_stale_parent_spawns_nothing(database: Database) -> None:
    async with opened(database, "parent") as parent:
        work = Work()
        thread = unique("fan")
        caught: list[BaseException] = []

        async def stale(state: Fan) -> dict[str, Any]:
            ctx = get_execution_context()
            # Cancelling fences this run (its epoch moves on) while its own window of
            # confirmed hold still runs, and nothing else of the run writes meanwhile: only
            # the guard of the spawn's write can refuse it.
            assert await parent.get_run(thread, tenant_id=TENANT).cancel()
            try:
                await ctx.spawn_child(
                    "shout", {"text": "x"}, placement=ChildPlacement.ANY_INSTANCE, key="c0"
                )
            except BaseException as exc:
                caught.append(exc)
                raise
            return {}

        builder = StateGraph(Fan)
        builder.add_node("stale", stale)
        builder.add_edge(START, "stale")
        builder.add_edge("stale", END)
        graph = fence_graph(builder).compile(checkpointer=parent.checkpointer, name="stale")
        key = LeaseKey(TENANT, thread)
        with pytest.raises(ExecutionFencedError):
            # durability="sync": the checkpoint before the step has landed when it runs,
            # so no write of the run is in flight to see the fence first.
            await parent.ainvoke(
                graph, {"items": []}, cfg(thread), tenant_id=TENANT, durability="sync"
            )
        # The spawn was refused by its guard (ExecutionFencedError), or the run learned of the
        # fence first from a checkpoint write of its own in flight and cancelled the step
        # (test_the_spawn_is_one_write_guarded_by_the_parents_hold tests the guard alone).
        assert caught
        assert isinstance(caught[0], ExecutionFencedError | asyncio.CancelledError)
        assert await lease_rows(parent, child_execution_id(key, "c0")) == []
        assert work.ran == []


async def test_a_failed_child_and_a_dead_lettered_one_are_named(database: Database) -> None:
    async with opened(database, "parent") as parent, opened(database, "worker") as worker:
        work = Work()
        thread = unique("fan")
        graph = parent_graph(parent, work)
        async with serving(worker, {"shout": child_graph(worker, work)}):
            with pytest.raises(ChildFailedError) as failed:
                await parent.ainvoke(graph, {"items": ["a", "boom"]}, cfg(thread), tenant_id=TENANT)
        child = child_execution_id(LeaseKey(TENANT, thread), "c1")
        error = failed.value
        assert error.code == "execution.run-failed.child"
        assert error.status == "failed"
        assert error.scope_key == scope_key(TENANT, child)
        assert "cannot shout 'boom'" in (error.reason or "")
        assert child in str(error) or scope_key(TENANT, child) in str(error)


async def test_a_dead_lettered_child_is_returned_in_its_place(database: Database) -> None:
    async with opened(database, "parent") as parent, opened(database, "worker") as worker:
        work = Work()
        thread = unique("fan")
        graph = parent_graph(parent, work, return_exceptions=True)
        gate = work.gates["b"] = asyncio.Event()
        run = asyncio.create_task(
            parent.ainvoke(graph, {"items": ["a", "b"]}, cfg(thread), tenant_id=TENANT)
        )
        async with serving(worker, {"shout": child_graph(worker, work)}):
            child = LeaseKey(TENANT, child_execution_id(LeaseKey(TENANT, thread), "c1"))

            async def child_held() -> bool:
                lease = await worker.repository.get(child)
                return lease is not None and lease.status is LeaseStatus.RUNNING

            await eventually(child_held, timeout=20, what="the child's lease to be running")
            lease = await worker.repository.get(child)
            assert lease is not None
            await worker.repository.dead_letter(child, "an operator gave up", epoch=lease.epoch)
            out = await asyncio.wait_for(run, 20)
            gate.set()
        assert out["results"] == ["A", "ChildFailedError"]


async def test_a_childs_fence_has_its_own_scope_key_and_epoch(database: Database) -> None:
    async with opened(database, "parent") as parent, opened(database, "worker") as worker:
        engine = parent._run_queue()._engine
        await setup_sink(engine)
        work = Work(sink=engine)
        thread = unique("fan")
        graph = parent_graph(parent, work)
        async with serving(worker, {"shout": child_graph(worker, work)}):
            # A first run of the thread takes token 1, the second token 2: the parent's
            # mark stands at 2 when its child writes under its own first token.
            await parent.ainvoke(graph, {"items": []}, cfg(thread), tenant_id=TENANT)
            await parent.ainvoke(graph, {"items": ["a"]}, cfg(thread), tenant_id=TENANT)
        parent_scope = scope_key(TENANT, thread)
        child_scope = scope_key(TENANT, child_execution_id(LeaseKey(TENANT, thread), "c0"))
        assert work.tokens == [(parent_scope, 1), (parent_scope, 2), (child_scope, 1)]
        async with engine.connect() as conn:
            rows = await conn.execute(text("SELECT scope_key, token FROM fence_high_water"))
            marks = {row.scope_key: row.token for row in rows}
        assert marks[parent_scope] == 2
        assert marks[child_scope] == 1


async def test_a_waiter_taken_over_stops_fenced_and_each_child_runs_once(
    leases: Leases,
) -> None:
    parent = leases.instance("parent", lease_ttl=10.0)
    worker = leases.instance("worker", lease_ttl=120.0)
    taker = leases.instance("taker", lease_ttl=120.0)
    work = Work()
    thread = unique("fan")
    items = ["a", "b", "c"]
    gates = [work.gates.setdefault(item, asyncio.Event()) for item in items]
    graph = parent_graph(parent, work)
    children = [
        LeaseKey(TENANT, child_execution_id(LeaseKey(TENANT, thread), f"c{i}")) for i in range(3)
    ]
    waiter = asyncio.create_task(
        parent.ainvoke(graph, {"items": items}, cfg(thread), tenant_id=TENANT)
    )
    root = LeaseKey(TENANT, thread)
    async with serving(worker, {"shout": child_graph(worker, work)}):
        for child in children:
            await until_status(leases, child, LeaseStatus.RUNNING)
        # Only the wait runs: the waiter has yielded the root lease (waiting, its holder kept).
        await eventually(lambda: is_yielded_by(leases, root, "parent"))
        # The waiter freezes; the children end, which wakes the yielded tree (pending); past
        # the waker's lease TTL, another instance takes the tree over and re-runs the
        # waiting step, which finds the three children (ended) instead of spawning new ones.
        leases.stall(parent)
        for gate in gates:
            gate.set()
        for child in children:
            await until_status(leases, child, LeaseStatus.DONE)
        await until_status(leases, root, LeaseStatus.PENDING)
        # Woken, it is left to its waiter for one TTL (of the waker), then free for anyone.
        assert root not in [c.key for c in await leases.store.takeover_candidates()]
        leases.advance(121.0)
        assert root in [c.key for c in await leases.store.takeover_candidates()]
        async with serving(taker, {"fan": parent_graph(taker, work)}):
            await until_status(leases, root, LeaseStatus.DONE)
    lease = await leases.store.get(root)
    assert lease is not None
    assert lease.epoch == 2  # taken once, by the taker (epoch 1 -> 2)
    assert work.spawned == [True, True, True, False, False, False]
    assert sorted(work.ran) == items  # each child ran once
    leases.resume(parent)
    with pytest.raises(ExecutionFencedError):
        await asyncio.wait_for(waiter, 20)
    saved = await taker.checkpointer.aget_tuple(
        cfg(thread) | {"configurable": {"thread_id": thread, "tenant_id": TENANT}}
    )
    assert saved is not None
    assert saved.checkpoint["channel_values"]["results"] == ["A", "B", "C"]


async def test_a_yielded_tree_whose_children_ended_without_waking_it_is_not_stranded(
    leases: Leases,
) -> None:
    # The children never run (no worker serves them) and are dead-lettered by an operator,
    # with no run of theirs to wake the tree; its waiter is frozen. A serve() look wakes it.
    parent = leases.instance("parent", lease_ttl=10.0)
    taker = leases.instance("taker", lease_ttl=120.0)
    work = Work()
    thread = unique("fan")
    root = LeaseKey(TENANT, thread)
    children = [LeaseKey(TENANT, child_execution_id(root, f"c{i}")) for i in range(2)]
    waiter = asyncio.create_task(
        parent.ainvoke(
            parent_graph(parent, work), {"items": ["a", "b"]}, cfg(thread), tenant_id=TENANT
        )
    )
    try:
        await eventually(lambda: is_yielded_by(leases, root, "parent"))
        leases.stall(parent)
        for child in children:
            lease = await leases.store.get(child)
            assert lease is not None
            await leases.store.dead_letter(child, "given up by an operator", epoch=lease.epoch)
        assert await is_yielded_by(leases, root, "parent")  # nothing woke it
        async with serving(taker, {"fan": parent_graph(taker, work, return_exceptions=True)}):
            await until_status(leases, root, LeaseStatus.PENDING)  # woken by the look
            # Woken, it is its waiter's until the not-before time: a start takes nothing.
            with pytest.raises(ExecutionLeaseHeldError):
                await taker.ainvoke(
                    parent_graph(taker, work), {"items": ["z"]}, cfg(thread), tenant_id=TENANT
                )
            leases.advance(121.0)  # past the waker's TTL: free for anyone
            await until_status(leases, root, LeaseStatus.DONE)
        assert work.spawned.count(True) == 2  # the taker found them, spawned none
    finally:
        leases.resume(parent)
        waiter.cancel()
        with contextlib.suppress(BaseException):
            await waiter


def local_parent_graph(instance: Instance, child: Any, items: list[str]) -> Any:
    async def fan_here(state: Fan) -> dict[str, Any]:
        ctx = get_execution_context()
        children = [
            await ctx.spawn_child(
                "shout",
                {"text": item},
                placement=ChildPlacement.PARENT_INSTANCE,
                key=f"c{i}",
                graph=child,
            )
            for i, item in enumerate(items)
        ]
        results = await ctx.wait_children(children, timeout=30, return_exceptions=True)
        return {"results": [r["out"] if isinstance(r, dict) else type(r).__name__ for r in results]}

    return one_step(instance, Fan, "fan_here", fan_here, name="fan_here")


async def test_parent_instance_children_run_here_under_the_roots_token(tmp_path: Any) -> None:
    async with Instance.open(f"sqlite+aiosqlite:///{tmp_path / 'here.db'}") as instance:
        work = Work()
        namespaces: list[str] = []
        child = child_graph(instance, work)

        async def shout_ns(state: Job) -> dict[str, Any]:
            namespaces.append(get_execution_context().checkpoint_ns)
            return {}

        builder = StateGraph(Job)
        builder.add_node("ns", shout_ns)
        builder.add_node("shout", child.builder.nodes["shout"].runnable)
        builder.add_edge(START, "ns")
        builder.add_edge("ns", "shout")
        builder.add_edge("shout", END)
        child = fence_graph(builder).compile(name="shout")
        thread = unique("here")
        out = await instance.ainvoke(
            local_parent_graph(instance, child, ["a", "b", "boom"]),
            {"items": []},
            cfg(thread),
            tenant_id=TENANT,
        )
        # In the order given; the failing one in its place, as itself (ValueError).
        assert out["results"] == ["A", "B", "ValueError"]
        # Every child step ran under the root's lease and token.
        assert set(work.tokens) == {(scope_key(TENANT, thread), 1)}
        assert sorted(work.ran) == ["a", "b", "boom"]
        # Each child in a checkpoint namespace of its own, under the spawning step's.
        assert len(set(namespaces)) == 3
        assert all(ns.startswith("fan_here:") for ns in namespaces)


async def test_executions_lists_each_child_under_its_parent(tmp_path: Any) -> None:
    db = f"sqlite+aiosqlite:///{tmp_path / 'tree.db'}"
    database = Database(db, "")
    async with opened(database, "parent") as parent, opened(database, "worker") as worker:
        work = Work()
        thread = unique("fan")
        async with serving(worker, {"shout": child_graph(worker, work)}):
            await parent.ainvoke(
                parent_graph(parent, work), {"items": ["a", "b"]}, cfg(thread), tenant_id=TENANT
            )
        # An execution of no tree, changed last: listed first, a root.
        other = LeaseKey(TENANT, unique("other"))
        assert await parent.repository.acquire(other, "w", 30.0) is not None

    def cli(*args: str) -> str:
        done = subprocess.run(
            [sys.executable, "-m", "langgraph_fence.cli", "executions", "--db", db, *args],
            capture_output=True,
            text=True,
            timeout=60,
            env={**os.environ, "COLUMNS": "250"},
        )
        assert done.returncode == 0, done.stderr
        return done.stdout

    root = scope_key(TENANT, thread)
    kids = [
        scope_key(TENANT, child_execution_id(LeaseKey(TENANT, thread), k)) for k in ("c0", "c1")
    ]
    listed = json.loads(cli("--json"))
    order = [entry["scope_key"] for entry in listed]
    assert order[0] == other.scope_key
    at = order.index(root)
    assert sorted(order[at + 1 : at + 3]) == kids  # right under their parent
    parents = {entry["scope_key"]: entry["parent"] for entry in listed}
    assert parents[root] is None
    assert all(parents[kid] == root for kid in kids)
    assert all(entry["status"] == "done" for entry in listed if entry["scope_key"] in kids)
    table = cli()
    assert all(f"└ {kid}" in table for kid in kids)


async def test_cancelling_the_parent_cancels_its_children_not_started(
    database: Database,
) -> None:
    async with opened(database, "parent") as parent:
        work = Work()
        thread = unique("fan")
        root = LeaseKey(TENANT, thread)
        children = [LeaseKey(TENANT, child_execution_id(root, f"c{i}")) for i in range(2)]
        waiter = asyncio.create_task(
            parent.ainvoke(
                parent_graph(parent, work), {"items": ["a", "b"]}, cfg(thread), tenant_id=TENANT
            )
        )

        async def spawned() -> bool:
            return all([await parent.repository.get(child) is not None for child in children])

        await eventually(spawned)  # no worker serves "shout": both stay pending
        assert await parent.get_run(thread, tenant_id=TENANT).cancel()
        with pytest.raises(ExecutionFencedError):
            await asyncio.wait_for(waiter, 20)
        for child in children:
            state = await parent.get_run(child.execution_id, tenant_id=TENANT).state()
            assert state.status is LeaseStatus.CANCELLED
            assert "was cancelled before it started" in (state.reason or "")
        assert work.ran == []


async def test_a_thread_of_your_own_named_like_a_child_is_never_adopted(
    database: Database,
) -> None:
    async with opened(database, "parent") as parent, opened(database, "worker") as worker:
        work = Work()
        thread = unique("fan")
        # A user thread named as a child of `thread` under the old rule (tenant:parent:key).
        lookalike = f"{TENANT}:{thread}:c0"
        async with serving(worker, {"shout": child_graph(worker, work)}):
            mine = await parent.submit("shout", {"text": "mine"}, cfg(lookalike), tenant_id=TENANT)
            assert await mine.result(timeout=20) == {"text": "mine", "out": "MINE"}
            out = await parent.ainvoke(
                parent_graph(parent, work), {"items": ["a"]}, cfg(thread), tenant_id=TENANT
            )
        assert out["results"] == ["A"]  # its own child's output, not the lookalike's
        assert work.spawned == [True]
        assert sorted(work.ran) == ["a", "mine"]


async def test_cancelling_a_parent_leaves_a_pending_run_named_like_its_child(
    database: Database,
) -> None:
    async with opened(database, "client") as client:
        thread = unique("order")
        # Neither graph is served: both runs stay pending.
        parent = await client.submit("fan", {"items": ["a"]}, cfg(thread), tenant_id=TENANT)
        lookalike = f"{TENANT}:{thread}:retry"
        mine = await client.submit("shout", {"text": "x"}, cfg(lookalike), tenant_id=TENANT)
        assert await parent.cancel()
        assert (await parent.state()).status is LeaseStatus.CANCELLED
        state = await mine.state()
        assert state.status is LeaseStatus.PENDING, state.reason  # not its child: untouched


@pytest.mark.parametrize("named", ["thread_id", "execution_id"])
async def test_a_run_of_your_own_with_a_child_id_is_refused_writing_nothing(
    database: Database, named: str
) -> None:
    async with opened(database, "client") as client:
        child_id = child_execution_id(LeaseKey(TENANT, unique("p")), "c0")
        config = cfg(child_id if named == "thread_id" else unique("t"))
        execution_id = child_id if named == "execution_id" else None
        refused = rf"{named}.*{CHILD_ID_PREFIX!r}.* reserved for child executions"
        with pytest.raises(ValueError, match=refused):
            await client.submit(
                "shout", {"text": "x"}, config, tenant_id=TENANT, execution_id=execution_id
            )
        with pytest.raises(ValueError, match=refused):
            await client.ainvoke(
                child_graph(client, Work()),
                {"text": "x"},
                config,
                tenant_id=TENANT,
                execution_id=execution_id,
            )
        assert await client.repository.get(LeaseKey(TENANT, child_id)) is None


async def test_the_spawn_is_one_write_guarded_by_the_parents_hold(database: Database) -> None:
    async with opened(database, "parent") as parent:
        queue = parent._run_queue()
        key = LeaseKey(TENANT, unique("p"))
        held = await parent.repository.acquire(key, parent.instance_id, 30.0)
        assert held is not None

        async def spawn(lease: Any, *child_keys: str) -> list[bool] | None:
            inputs = {child_key: {"text": child_key} for child_key in child_keys}
            children = [LeaseKey(TENANT, child_execution_id(key, k)) for k in child_keys]
            stored = queue.serialize_inputs(inputs)
            return await queue.submit_children(
                lease, "shout", list(zip(children, stored, strict=True))
            )

        assert await spawn(held, "c0") == [True]
        assert await spawn(held, "c0") == [False]  # the same key again: nothing written
        # Found keys and new ones together: only the new ones are written.
        assert await spawn(held, "c0", "c2", "c3") == [False, True, True]
        assert await parent.get_run(key.execution_id, tenant_id=TENANT).cancel()  # epoch + 1
        assert await spawn(held, "c1", "c4") is None  # the stale hold spawns nothing
        rows = await lease_rows(parent, child_execution_id(key, "c")[:-1])
        assert [row[0] for row in rows] == [child_execution_id(key, k) for k in ("c0", "c2", "c3")]
        # Each spawned child is a submitted run of its own input.
        for child_key in ("c0", "c3"):
            record = await parent._run_queue().state(
                LeaseKey(TENANT, child_execution_id(key, child_key))
            )
            assert record is not None
            assert record[0].graph == "shout"
            assert record[0].submitted


async def test_a_waiting_parent_is_handed_back_when_its_instance_stops(
    database: Database,
) -> None:
    """An instance that stops (SIGTERM, serve()'s stop) drains its runs; a parent waiting
    for children that have not ended must not hold that drain for as long as they take: it
    is handed back (pending), and the step run again later finds the child it spawned."""
    async with opened(database, "parent") as parent:
        work = Work()
        thread = unique("fan")
        run = await parent.submit("fan", {"items": ["a"]}, cfg(thread), tenant_id=TENANT)
        async with serving(parent, {"fan": parent_graph(parent, work)}):
            # No instance serves "shout": the child stays pending and the parent waits.
            await eventually(lambda: work.spawned == [True], timeout=20, what="the spawn")
        # Leaving the block stopped the loop (within serving's 20 s): the waiter was drained.
        state = await run.state()
        assert state.status is LeaseStatus.PENDING
        assert state.holder is None

"""A tree at scale (issue 31, item 7): children spawned together in one statement, and a
wait that reads every pending child in one read per look, on SQLite and PostgreSQL.

Counted, never timed: the statements are traced at the driver on the parent instance's
engine (:class:`tests.support.statements.Statements`), and the wait's looks are seen by a spy on
:meth:`SubmittedRuns.child_ends` that calls the real read. The timings (1 000 and 10 000
children) are in ``benchmarks/bench_children.py``.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable, Coroutine
from dataclasses import dataclass, field
from typing import Any, TypedDict

import pytest
from langgraph.graph import END, START, StateGraph

from langgraph_fence import (
    ChildPlacement,
    ExecutionFencedError,
    Instance,
    LeaseKey,
    LeaseStatus,
    fence_graph,
    get_execution_context,
)
from langgraph_fence.events import EventKind
from langgraph_fence.execution.children import Child, child_execution_id
from langgraph_fence.lease.transitions import is_yielded
from langgraph_fence.queue import SubmittedRuns
from tests.support.children import Work, child_graph, lease_rows
from tests.support.databases import Database, unique
from tests.support.polling import eventually
from tests.support.serving import cfg, opened, serving
from tests.support.statements import Statements

TENANT = "acme"
#: What a batch of children costs on the wire, whatever its size: the statements' first words.
SPAWN = {
    "postgresql": ["WITH PARENT AS"],
    "sqlite": [
        "BEGIN IMMEDIATE",
        "SELECT 1 FROM",
        "INSERT INTO FENCE_LEASES",
        "INSERT INTO FENCE_EXECUTIONS",
        "COMMIT",
    ],
}
#: ... and a batch whose keys were all spawned before (a re-run of the step): nothing new.
RESPAWN = {"postgresql": SPAWN["postgresql"], "sqlite": [*SPAWN["sqlite"][:3], "COMMIT"]}
#: A look of the wait: one read of every child it waits for (one statement, in autocommit).
LOOK = ["SELECT C.TENANT_ID, C.EXECUTION_ID,"]
#: Between two looks of a yielded wait: one read of the parent's own lease (it learns of a
#: takeover within one look); on SQLite in a read-only transaction.
LEASE_READ = "SELECT FENCE_LEASES.TENANT_ID, FENCE_LEASES.EXECUTION_ID,"
BETWEEN = {"postgresql": [LEASE_READ], "sqlite": ["BEGIN", LEASE_READ, "ROLLBACK"]}


#: What asyncpg itself sends once on a connection new to a type (its codec look-up), not a
#: statement of the code under test.
DRIVER_OWN = (
    "SELECT CURRENT_SETTING('JIT') AS",
    "WITH RECURSIVE TYPEINFO_TREE(",
    "SELECT SET_CONFIG('JIT',",
)


async def taken(statements: Statements) -> list[str]:
    """The statements sent since the last take, but the driver's own."""
    return [sql for sql in await statements.take() if not sql.startswith(DRIVER_OWN)]


class Tree(TypedDict, total=False):
    n: int
    spawned: list[bool]
    results: list[Any]


def one_step(instance: Instance, name: str, body: Callable[[Tree], Awaitable[Any]]) -> Any:
    async def step(state: Tree) -> dict[str, Any]:
        return dict(await body(state))

    builder = StateGraph(Tree)
    builder.add_node(name, step)
    builder.add_edge(START, name)
    builder.add_edge(name, END)
    return fence_graph(builder).compile(checkpointer=instance.checkpointer, name=name)


def run_step(
    instance: Instance, name: str, body: Callable[[Tree], Awaitable[Any]], thread: str
) -> Coroutine[Any, Any, Any]:
    """Run a one-step graph of ``body`` on ``thread``. durability="sync": the run's
    checkpoint writes are not in flight while the step runs (nor counted with it)."""
    return instance.ainvoke(
        one_step(instance, name, body), {"n": 0}, cfg(thread), tenant_id=TENANT, durability="sync"
    )


def backend_of(database: Database) -> str:
    return "postgresql" if database.schema else "sqlite"


@pytest.mark.parametrize("size", [3, 10_000])
async def test_a_batch_of_children_is_spawned_in_one_statement_whatever_its_size(
    database: Database, size: int
) -> None:
    async with opened(database, "parent", lease_ttl=600.0) as parent:
        statements = Statements(parent._run_queue()._engine, sqlalchemy=True)
        sent: list[list[str]] = []
        inputs = {f"c{i}": {"text": f"t{i}"} for i in range(size)}

        async def spawn(state: Tree) -> dict[str, Any]:
            ctx = get_execution_context()
            await statements.take()
            first = await ctx.spawn_children("shout", inputs, placement=ChildPlacement.ANY_INSTANCE)
            sent.append(await taken(statements))
            # The step again (as a retry or a takeover would run it): every key is found.
            again = await ctx.spawn_children("shout", inputs, placement=ChildPlacement.ANY_INSTANCE)
            sent.append(await taken(statements))
            # One more, with spawn_child: the same statement.
            await ctx.spawn_child(
                "shout", {"text": "z"}, placement=ChildPlacement.ANY_INSTANCE, key="z"
            )
            sent.append(await taken(statements))
            assert [c.key for c in first] == list(inputs)  # in the order given
            return {"spawned": [c.spawned for c in first] + [c.spawned for c in again]}

        thread = unique("batch")
        out = await run_step(parent, "spawn", spawn, thread)
        backend = backend_of(database)
        assert sent == [SPAWN[backend], RESPAWN[backend], SPAWN[backend]]
        assert out["spawned"] == [True] * size + [False] * size
        root = LeaseKey(TENANT, thread)
        rows = await lease_rows(parent, child_execution_id(root, "c")[:-1])
        assert len(rows) == size + 1  # and "z"
        assert {status for _, status, _ in rows} == {"pending"}
        # Each child is a submitted run of its own input, as spawn_child records one.
        last = LeaseKey(TENANT, child_execution_id(root, f"c{size - 1}"))
        found = await parent._run_queue().state(last)
        assert found is not None
        assert found[0].graph == "shout"
        assert found[0].thread_id == last.execution_id
        assert found[0].submitted


async def test_spawn_child_calls_gathered_together_are_one_statement(database: Database) -> None:
    async with opened(database, "parent", lease_ttl=600.0) as parent:
        statements = Statements(parent._run_queue()._engine, sqlalchemy=True)
        sent: list[list[str]] = []
        refused: list[BaseException] = []

        async def gather(state: Tree) -> dict[str, Any]:
            ctx = get_execution_context()

            def spawn(key: str, input: Any) -> Awaitable[Child]:
                return ctx.spawn_child(
                    "shout", input, placement=ChildPlacement.ANY_INSTANCE, key=key
                )

            await taken(statements)
            children = await asyncio.gather(*(spawn(f"c{i}", {"text": "x"}) for i in range(40)))
            sent.append(await taken(statements))
            # A bad input is refused to its own call; the others are spawned, together; a
            # key given twice at once is spawned once (the second call finds it).
            more = await asyncio.gather(
                spawn("d0", {"text": "x"}),
                spawn("bad", object()),
                spawn("d1", {"text": "x"}),
                spawn("d0", {"text": "x"}),
                return_exceptions=True,
            )
            sent.append(await taken(statements))
            refused.extend(m for m in more if isinstance(m, BaseException))
            assert [c.key for c in children] == [f"c{i}" for i in range(40)]
            assert [c.spawned for c in children] == [True] * 40
            assert [m.spawned for m in more if isinstance(m, Child)] == [True, True, False]
            return {}

        thread = unique("gather")
        await run_step(parent, "gather", gather, thread)
        assert sent == [SPAWN[backend_of(database)]] * 2
        assert len(refused) == 1
        assert "child 'bad' cannot be recorded" in str(refused[0])
        root = LeaseKey(TENANT, thread)
        rows = await lease_rows(parent, child_execution_id(root, "c")[:-1])
        assert len(rows) == 42


async def test_a_stale_parent_spawns_no_child_of_its_batch(database: Database) -> None:
    async with opened(database, "parent") as parent:
        thread = unique("stale")
        caught: list[BaseException] = []

        async def stale(state: Tree) -> dict[str, Any]:
            ctx = get_execution_context()
            # Fenced while its own window of confirmed hold still runs (see
            # test_a_stale_parent_spawns_nothing): only the batch's guard can refuse it.
            assert await parent.get_run(thread, tenant_id=TENANT).cancel()
            try:
                await ctx.spawn_children(
                    "shout",
                    {f"c{i}": {"text": "x"} for i in range(50)},
                    placement=ChildPlacement.ANY_INSTANCE,
                )
            except BaseException as exc:
                caught.append(exc)
                raise
            return {}

        with pytest.raises(ExecutionFencedError):
            await run_step(parent, "stale", stale, thread)
        assert caught
        assert isinstance(caught[0], ExecutionFencedError | asyncio.CancelledError)
        root = LeaseKey(TENANT, thread)
        assert await lease_rows(parent, child_execution_id(root, "c")[:-1]) == []


async def test_bad_batches_are_refused_before_anything_is_written(database: Database) -> None:
    async with opened(database, "parent") as parent:
        thread = unique("bad")
        refused: list[BaseException] = []

        async def bad(state: Tree) -> dict[str, Any]:
            ctx = get_execution_context()
            for attempt in (
                lambda: ctx.spawn_children(
                    "shout",
                    {"c0": {"text": "x"}, "c1": object()},
                    placement=ChildPlacement.ANY_INSTANCE,
                ),
                lambda: ctx.spawn_children(
                    "shout", [("c0", {})], placement=ChildPlacement.ANY_INSTANCE
                ),
                lambda: ctx.spawn_children(
                    "shout", {"": {"text": "x"}}, placement=ChildPlacement.ANY_INSTANCE
                ),
            ):
                with pytest.raises((ValueError, TypeError)) as error:
                    await attempt()
                refused.append(error.value)
            assert (
                await ctx.spawn_children("shout", {}, placement=ChildPlacement.ANY_INSTANCE) == []
            )
            return {}

        await parent.ainvoke(one_step(parent, "bad", bad), {"n": 0}, cfg(thread), tenant_id=TENANT)
        assert "child 'c1' cannot be recorded" in str(refused[0])
        assert "dict of child key" in str(refused[1])
        root = LeaseKey(TENANT, thread)
        assert await lease_rows(parent, child_execution_id(root, "c")[:-1]) == []


@dataclass
class Looks:
    """Each look of a wait: the statements its read of the children sent (``during``), and
    those the parent's engine sent since the look before (``between``)."""

    during: list[list[str]] = field(default_factory=list)
    between: list[list[str]] = field(default_factory=list)
    asked: list[list[str]] = field(default_factory=list)  # the children each look read
    # (what, n): "look" when a look starts, "ended" when the last child's end is committed.
    timeline: list[str] = field(default_factory=list)
    found: list[set[str]] = field(default_factory=list)  # the children each look found ended
    enough: asyncio.Event = field(default_factory=asyncio.Event)


def spy_on_looks(queue: SubmittedRuns, statements: Statements, looks: Looks, enough: int) -> None:
    real = queue.child_ends

    async def child_ends(children: Any) -> Any:
        looks.timeline.append("look")
        looks.asked.append(sorted(child.execution_id for child in children))
        looks.between.append(await taken(statements))
        found = await real(children)
        looks.found.append({key.execution_id for key in found})
        looks.during.append(await taken(statements))
        if len(looks.during) >= enough:
            looks.enough.set()
        return found

    queue.child_ends = child_ends  # type: ignore[method-assign]


@pytest.mark.parametrize("size", [3, 10_000])
async def test_the_wait_reads_every_pending_child_in_one_read_per_look(
    database: Database, size: int
) -> None:
    async with opened(database, "parent", lease_ttl=600.0) as parent:
        queue = parent._run_queue()
        statements = Statements(queue._engine, sqlalchemy=True)
        looks = Looks()
        spy_on_looks(queue, statements, looks, enough=4)
        thread = unique("wait")
        yielded_before: list[int] = []  # how many looks had begun when the wait yielded
        parent.add_listener(
            lambda event: (
                yielded_before.append(len(looks.between))
                if event.kind is EventKind.YIELDED
                else None
            )
        )

        async def fan(state: Tree) -> dict[str, Any]:
            ctx = get_execution_context()
            children = await ctx.spawn_children(
                "shout",
                {f"c{i}": {"text": "x"} for i in range(size)},
                placement=ChildPlacement.ANY_INSTANCE,
            )
            return {"results": await ctx.wait_children(children, timeout=300)}

        # No worker serves "shout": every child stays pending while the wait looks.
        run = asyncio.create_task(run_step(parent, "fan", fan, thread))
        await asyncio.wait_for(looks.enough.wait(), 120)
        await eventually(
            lambda: len(looks.between) >= (yielded_before or [10**9])[0] + 3,
            timeout=120,
            what="two looks after the yield",
        )
        # A cancel of the parent ends the wait (and fails the children not started); sent
        # from another instance, so its statements are not the parent engine's.
        async with opened(database, "operator") as operator:
            assert await operator.get_run(thread, tenant_id=TENANT).cancel()
        with pytest.raises(ExecutionFencedError):
            await asyncio.wait_for(run, 60)
    # Every look read all the pending children in ONE statement, whatever their number.
    assert all(during == LOOK for during in looks.during), looks.during
    # Between two looks of the yielded wait, the same statements whatever the number of
    # children (the look right after the yield also sees the yield and the wake).
    assert yielded_before, "the wait never yielded"
    steady = looks.between[yielded_before[0] + 1 :]
    assert steady
    assert all(between == BETWEEN[backend_of(database)] for between in steady), steady


async def test_the_parent_resumes_within_one_look_of_its_last_childs_end(
    database: Database,
) -> None:
    async with opened(database, "parent") as parent, opened(database, "worker") as worker:
        queue = parent._run_queue()
        looks = Looks()
        spy_on_looks(queue, Statements(queue._engine), looks, enough=1)
        work = Work()
        size = 12
        last = f"t{size - 1}"
        gate = work.gates[last] = asyncio.Event()
        thread = unique("resume")
        root = LeaseKey(TENANT, thread)
        last_child = LeaseKey(TENANT, child_execution_id(root, f"c{size - 1}"))
        # The worker says a run of serve() ended right after its lease was released:
        # the last child's end is committed when that one is said.
        told = worker._run_queue()
        real_notify = told.notify

        async def notify(channel: str, payload: str) -> None:
            if payload == last_child.scope_key:
                looks.timeline.append("ended")
            await real_notify(channel, payload)

        told.notify = notify  # type: ignore[method-assign]

        async def fan(state: Tree) -> dict[str, Any]:
            ctx = get_execution_context()
            children: list[Child] = await ctx.spawn_children(
                "shout",
                {f"c{i}": {"text": f"t{i}"} for i in range(size)},
                placement=ChildPlacement.ANY_INSTANCE,
            )
            results = await ctx.wait_children(children, timeout=120)
            looks.timeline.append("resumed")
            return {"results": [r["out"] for r in results]}

        run = asyncio.create_task(
            parent.ainvoke(one_step(parent, "fan", fan), {"n": 0}, cfg(thread), tenant_id=TENANT)
        )
        async with serving(worker, {"shout": child_graph(worker, work)}):

            async def all_but_the_last_ended() -> bool:
                rows = await lease_rows(parent, child_execution_id(root, "c")[:-1])
                done = [r for r in rows if r[1] == LeaseStatus.DONE.value]
                lease = await parent.repository.get(root)
                yielded = lease is not None and is_yielded(lease.status, lease.holder)
                return len(rows) == size and len(done) == size - 1 and yielded

            await eventually(all_but_the_last_ended, timeout=60, what="all children but one")
            gate.set()
            out = await asyncio.wait_for(run, 60)
    assert out["results"] == [f"T{i}" for i in range(size)]
    timeline = looks.timeline
    ended, resumed = timeline.index("ended"), timeline.index("resumed")
    # The first look that found the last child's end was the wait's last: it returned at once.
    finders = [n for n, found in enumerate(looks.found) if last_child.execution_id in found]
    assert finders, looks.found
    assert finders[0] == len(looks.found) - 1, (finders, timeline)
    if ended < resumed:
        assert timeline[-1] == "resumed"
        # The first look that began after the last child's end found it.
        assert timeline[ended + 1 :].count("look") <= 1, timeline[ended:]
    else:
        # The worker says the end a few awaits after it committed it: a look that began in
        # between found it and the wait returned before it was said. No look came after.
        assert timeline[resumed:].count("look") == 0, timeline


@pytest.mark.parametrize("database", ["postgresql"], indirect=True)
async def test_a_wait_woken_by_an_end_reads_the_children_heard_of(database: Database) -> None:
    """On PostgreSQL a child's end wakes the wait (the NOTIFY serve() sends at a run's end),
    and that look reads the children whose ends it heard of, not every pending one."""
    async with opened(database, "parent") as parent, opened(database, "worker") as worker:
        queue = parent._run_queue()
        looks = Looks()
        spy_on_looks(queue, Statements(queue._engine), looks, enough=1)
        work = Work()
        gates = [work.gates.setdefault(text, asyncio.Event()) for text in ("t0", "t2")]
        thread = unique("heard")
        root = LeaseKey(TENANT, thread)
        keys = [child_execution_id(root, f"c{i}") for i in range(3)]

        async def fan(state: Tree) -> dict[str, Any]:
            ctx = get_execution_context()
            children = await ctx.spawn_children(
                "shout",
                {f"c{i}": {"text": f"t{i}"} for i in range(3)},
                placement=ChildPlacement.ANY_INSTANCE,
            )
            results = await ctx.wait_children(children, timeout=120)
            return {"results": [r["out"] for r in results]}

        run = asyncio.create_task(
            parent.ainvoke(one_step(parent, "fan", fan), {"n": 0}, cfg(thread), tenant_id=TENANT)
        )
        async with serving(worker, {"shout": child_graph(worker, work)}):
            # c1 runs to its end; c0 and c2 wait at their gates.
            await eventually(lambda: [keys[1]] in looks.asked, timeout=60, what="a look at c1")
            for gate in gates:
                gate.set()
            out = await asyncio.wait_for(run, 60)
    assert out["results"] == ["T0", "T1", "T2"]
    assert looks.asked[0] == sorted(keys)  # the first look reads every child

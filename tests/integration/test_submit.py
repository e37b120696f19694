"""Runs any worker can take (issue 17): submit, result, get_run, cancel, fairness, a busy
thread, bad input, on SQLite and PostgreSQL (the ``database`` fixture: a database of the
test's own).

The worker is ``serve()`` of another instance on the same database, in this process: what
a submit leaves must be all another process needs.
"""

from __future__ import annotations

import asyncio
from typing import Any

import pytest
from langgraph.graph import END, START, StateGraph
from sqlalchemy import text

from langgraph_fence import (
    EventKind,
    ExecutionBusyError,
    Instance,
    LeaseKey,
    LeaseStatus,
    RunFailedError,
    fence_graph,
)
from langgraph_fence.testing import Leases
from tests.support.databases import Database, unique
from tests.support.polling import eventually
from tests.support.serving import cfg, look, opened, serving, stepped
from tests.support.shout import SUBMIT_TABLES, State, Work, build, rows, within


async def test_submit_returns_at_once_and_any_worker_runs_it(database: Database) -> None:
    async with opened(database, "client") as client, opened(database, "worker") as worker:
        work = Work()
        thread = unique("t")
        run = await client.submit("shout", {"text": "hello"}, cfg(thread), tenant_id="acme")
        # Returned before any worker serves: recorded pending, nothing ran.
        assert (await run.state()).status is LeaseStatus.PENDING
        assert work.started == []
        async with serving(worker, {"shout": build(worker, work)}):
            assert await run.result(timeout=20) == {"text": "hello", "out": "HELLO"}
        state = await run.state()
        assert state.status is LeaseStatus.DONE
        assert state.epoch == 1  # claimed at the next token, once
        assert work.started == [("acme", "hello")]
        # A handle from another instance (another process would do the same).
        other = worker.get_run(thread, tenant_id="acme")
        assert await other.result(timeout=5) == {"text": "hello", "out": "HELLO"}
        # A new submit on the finished thread is a new turn at the next token.
        again = await client.submit("shout", {"text": "again"}, cfg(thread), tenant_id="acme")
        async with serving(worker, {"shout": build(worker, work)}):
            assert (await again.result(timeout=20))["out"] == "AGAIN"
        assert (await again.state()).epoch == 2


async def test_submit_is_idempotent_by_execution_key(database: Database) -> None:
    async with opened(database, "client") as client, opened(database, "worker") as worker:
        work = Work()
        thread = unique("t")
        first = await client.submit("shout", {"text": "once"}, cfg(thread), tenant_id="acme")
        before = await rows(client)
        second = await client.submit("shout", {"text": "once"}, cfg(thread), tenant_id="acme")
        assert second.key == first.key
        assert await rows(client) == before
        # Other input for the pending run: refused by default, nothing written.
        with pytest.raises(ExecutionBusyError) as busy:
            await client.submit("shout", {"text": "other"}, cfg(thread), tenant_id="acme")
        assert busy.value.code == "execution.busy"
        assert thread in str(busy.value)
        assert await rows(client) == before
        async with serving(worker, {"shout": build(worker, work)}):
            assert (await first.result(timeout=20))["out"] == "ONCE"
        assert work.started == [("acme", "once")]


async def test_cancel_a_pending_run_and_a_running_one(database: Database) -> None:
    async with opened(database, "client") as client, opened(database, "worker") as worker:
        work = Work()
        pending = await client.submit("shout", {"text": "never"}, cfg(unique()), tenant_id="a")
        assert await pending.cancel()
        with pytest.raises(RunFailedError) as ended:
            await pending.result(timeout=5)
        assert ended.value.status == "cancelled"
        assert "cancelled" in (ended.value.reason or "")
        assert ended.value.code == "execution.run-failed"

        work.gates["slow"] = asyncio.Event()
        thread = unique("t")
        running = await client.submit("shout", {"text": "slow"}, cfg(thread), tenant_id="a")
        fenced = asyncio.Event()
        worker.add_listener(lambda e: fenced.set() if e.kind is EventKind.FENCED else None)
        graph = build(worker, work)
        async with serving(worker, {"shout": graph}):
            await within(work.entered.setdefault("slow", asyncio.Event()))
            assert await running.cancel()
            work.gates["slow"].set()  # the node ends after the cancel: its write is late
            await within(fenced)
            with pytest.raises(RunFailedError, match="cancelled"):
                await running.result(timeout=5)
        # The late write was refused: the thread never got the cancelled run's output.
        config = {"configurable": {"thread_id": thread, "tenant_id": "a"}}
        history = [s.values async for s in graph.aget_state_history(config)]
        assert all(values.get("out") != "SLOW" for values in history)
        assert work.started.count(("a", "never")) == 0


def build_two_steps(instance: Instance, work: Work) -> Any:
    """``first`` then ``second``, each recording its input; ``second`` waits at its gate."""

    async def first(state: State) -> dict[str, Any]:
        work.started.append(("first", state["text"]))
        return {"text": state["text"] + "+1"}

    async def second(state: State) -> dict[str, Any]:
        work.started.append(("second", state["text"]))
        work.entered.setdefault("second", asyncio.Event()).set()
        gate = work.gates.get("second")
        if gate is not None:
            await gate.wait()
        return {"out": state["text"].upper()}

    builder = StateGraph(State)
    builder.add_node("first", first)
    builder.add_node("second", second)
    builder.add_edge(START, "first")
    builder.add_edge("first", "second")
    builder.add_edge("second", END)
    return fence_graph(builder).compile(checkpointer=instance.checkpointer, name="two")


@pytest.mark.processes
@pytest.mark.parametrize("resume", ["cli", "api"])
async def test_a_cancelled_run_is_its_own_end_and_resumes_from_its_last_checkpoint(
    database: Database, resume: str
) -> None:
    """A run cancelled on purpose ends ``cancelled``: no worker takes it over, and it is
    resumed, from the checkpoint its cancel left, by ``resolve --retry`` (an operator) or by
    a new run of its thread (the API)."""
    async with opened(database, "client") as client, opened(database, "worker") as worker:
        work = Work(gates={"second": asyncio.Event()})
        graph = build_two_steps(worker, work)
        thread = unique("t")
        run = await client.submit("two", {"text": "x"}, cfg(thread), tenant_id="a")
        fenced = asyncio.Event()
        worker.add_listener(lambda e: fenced.set() if e.kind is EventKind.FENCED else None)
        config = {"configurable": {"thread_id": thread, "tenant_id": "a"}}

        async def after_first() -> bool:
            return (await graph.aget_state(config)).next == ("second",)

        async with serving(worker, {"two": graph}):
            await within(work.entered.setdefault("second", asyncio.Event()))
            # The checkpoint ``first`` left is stored (durability "async" writes it beside
            # ``second``): the cancel comes after it, as a cancel mid-run usually does.
            await eventually(after_first, what="the checkpoint after first")
            assert await run.cancel()
            work.gates["second"].set()
            await within(fenced)
            with pytest.raises(RunFailedError) as ended:
                await run.result(timeout=5)
            assert ended.value.status == "cancelled"
            # The worker serving its graph goes on, and leaves it alone: another run is
            # claimed and ends while the cancelled one stays cancelled.
            other = await client.submit("two", {"text": "y"}, cfg(unique("t")), tenant_id="a")
            assert (await other.result(timeout=20))["out"] == "Y+1"
            assert (await run.state()).status is LeaseStatus.CANCELLED
            assert work.started.count(("second", "x+1")) == 1

            if resume == "cli":
                from tests.support.cli import cli, schema_args

                key = ["--db", database.url, *schema_args(database.schema), f"a:{thread}"]
                # In a thread: the worker in this loop goes on (a SQLite writer mid-statement
                # must not be frozen while the CLI waits for the file's lock).
                done = await asyncio.to_thread(cli, "resolve", "--retry", *key)
                assert done.returncode == 0, done.stderr
                assert "pending again" in done.stdout
                assert (await run.result(timeout=20))["out"] == "X+1"
            else:
                assert (await graph.ainvoke(None, config))["out"] == "X+1"
        # Resumed from the checkpoint after ``first``: it ran once, ``second`` again.
        assert work.started.count(("first", "x")) == 1
        assert work.started.count(("second", "x+1")) == 2
        assert (await run.state()).status is LeaseStatus.DONE


async def test_one_tenants_burst_does_not_starve_another(database: Database) -> None:
    async with opened(database, "client") as client, opened(database, "worker") as worker:
        work = Work()
        for i in range(500):
            await client.submit("shout", {"text": f"a{i}"}, cfg(unique("a")), tenant_id="A")
        b_runs = [
            await client.submit("shout", {"text": f"b{i}"}, cfg(unique("b")), tenant_id="B")
            for i in range(5)
        ]
        async with serving(worker, {"shout": build(worker, work)}, concurrency=2):
            for run in b_runs:
                await run.result(timeout=60)
        order = [tenant for tenant, _ in work.started]
        # Round-robin by tenant: B's five start within the first claims, not after A's 500.
        last_b = max(i for i, tenant in enumerate(order) if tenant == "B")
        assert last_b < 20, order[:30]
        assert order.count("A") < 50


async def test_a_busy_thread_rejects_or_interrupts(database: Database) -> None:
    async with opened(database, "client") as client, opened(database, "worker") as worker:
        work = Work()
        work.gates["first"] = asyncio.Event()
        thread = unique("t")
        fenced = asyncio.Event()
        worker.add_listener(lambda e: fenced.set() if e.kind is EventKind.FENCED else None)
        graph = build(worker, work)
        first = await client.submit("shout", {"text": "first"}, cfg(thread), tenant_id="a")
        async with serving(worker, {"shout": graph}, concurrency=2):
            await within(work.entered.setdefault("first", asyncio.Event()))
            with pytest.raises(ExecutionBusyError, match="running"):
                await client.submit("shout", {"text": "second"}, cfg(thread), tenant_id="a")
            second = await client.submit(
                "shout", {"text": "second"}, cfg(thread), tenant_id="a", on_busy="interrupt"
            )
            assert (await second.result(timeout=20))["out"] == "SECOND"
            work.gates["first"].set()  # the interrupted run's step ends now: a late write
            await within(fenced)
        assert [text for _, text in work.started] == ["first", "second"]
        config = {"configurable": {"thread_id": thread, "tenant_id": "a"}}
        state = await graph.aget_state(config)
        assert state.values == {"text": "second", "out": "SECOND"}
        history = [s.values async for s in graph.aget_state_history(config)]
        assert all(values.get("out") != "FIRST" for values in history)
        assert first.key == second.key  # one thread, one execution


async def test_bad_input_is_refused_before_anything_is_written(database: Database) -> None:
    async with opened(database, "client") as client:
        before = await rows(client)
        with pytest.raises(ValueError, match="input"):
            await client.submit("shout", {"text": object()}, cfg(unique()), tenant_id="a")
        with pytest.raises(ValueError, match="on_busy"):
            await client.submit(
                "shout", {"text": "x"}, cfg(unique()), tenant_id="a", on_busy="enqueue-later"
            )
        with pytest.raises(ValueError, match="thread_id"):
            await client.submit("shout", {"text": "x"}, {}, tenant_id="a")
        with pytest.raises(ValueError, match="graph_name"):
            await client.submit("", {"text": "x"}, cfg(unique()), tenant_id="a")
        assert await rows(client) == before
        # An unknown graph name is accepted, and shown waiting with its name.
        thread = unique("t")
        run = await client.submit("nobody-serves-this", {"text": "x"}, cfg(thread), tenant_id="a")
        waiting = {r.key: r for r in await client._run_queue().runs()}
        assert waiting[LeaseKey("a", thread)].graph == "nobody-serves-this"
        assert waiting[LeaseKey("a", thread)].status is LeaseStatus.PENDING
        with pytest.raises(TimeoutError, match="nobody-serves-this"):
            await run.result(timeout=0.2)


@pytest.mark.parametrize("database", ["postgresql"], indirect=True)  # SQLite polls
async def test_on_postgresql_a_submit_wakes_a_waiting_server(database: Database) -> None:
    async with opened(database, "client") as client, opened(database, "worker") as worker:
        work = Work()
        stop = asyncio.Event()
        # Polls once, then waits a minute: only the submit's NOTIFY can wake it in time.
        task = asyncio.create_task(
            worker.serve(
                {"shout": build(worker, work)}, poll_interval=60, stop=stop, handle_signals=False
            )
        )
        try:
            queue = client._run_queue()

            async def looked() -> bool:  # its first look is done
                return "shout" in await queue.served()

            await eventually(looked, timeout=20, what="the server's first look")
            run = await client.submit("shout", {"text": "wake"}, cfg(unique()), tenant_id="a")
            assert (await run.result(timeout=10))["out"] == "WAKE"
        finally:
            stop.set()
            await asyncio.wait_for(task, 20)


async def test_a_start_with_new_input_while_a_submitted_run_waits_is_refused(
    database: Database,
) -> None:
    """A submitted run waiting for a worker holds no lease, yet it is the thread's run in
    flight: ``ainvoke`` with new input on that thread is refused, nothing written, and the
    submitted input still runs, its result its own (before: the start took the pending
    lease, overwrote the recorded input, and the submitted run was lost)."""
    async with opened(database, "client") as client, opened(database, "worker") as worker:
        work = Work()
        thread = unique("t")
        run = await client.submit("shout", {"text": "queued"}, cfg(thread), tenant_id="a")
        before = await rows(client)
        with pytest.raises(ExecutionBusyError, match="waiting for a worker"):
            await client.ainvoke(build(client, work), {"text": "now"}, cfg(thread), tenant_id="a")
        assert await rows(client) == before
        assert work.started == []
        async with serving(worker, {"shout": build(worker, work)}):
            assert await run.result(timeout=20) == {"text": "queued", "out": "QUEUED"}
        assert work.started == [("a", "queued")]


async def test_each_strategy_on_one_thread_with_a_slow_run_in_flight(database: Database) -> None:
    """One thread, one slow run in flight: ``reject`` refuses (nothing written),
    ``enqueue`` queues after it, ``interrupt`` fences it and runs next, before the queued
    one; every handle reads its own end."""
    async with opened(database, "client") as client, opened(database, "worker") as worker:
        work = Work()
        work.gates["slow"] = asyncio.Event()
        thread = unique("t")
        graph = build(worker, work)
        slow = await client.submit("shout", {"text": "slow"}, cfg(thread), tenant_id="a")
        async with serving(worker, {"shout": graph}):
            await within(work.entered.setdefault("slow", asyncio.Event()))
            queued = await client.submit(
                "shout", {"text": "queued"}, cfg(thread), tenant_id="a", on_busy="enqueue"
            )
            before = await rows(client, SUBMIT_TABLES)
            with pytest.raises(ExecutionBusyError, match="1 run\\(s\\) queued"):
                await client.submit("shout", {"text": "refused"}, cfg(thread), tenant_id="a")
            assert await rows(client, SUBMIT_TABLES) == before
            assert (await queued.state()).queued
            now = await client.submit(
                "shout", {"text": "now"}, cfg(thread), tenant_id="a", on_busy="interrupt"
            )
            assert (await now.result(timeout=20))["out"] == "NOW"
            assert (await queued.result(timeout=20))["out"] == "QUEUED"
            work.gates["slow"].set()  # the interrupted step ends late: its write is refused
            with pytest.raises(RunFailedError, match="interrupted") as ended:
                await slow.result(timeout=5)
            assert ended.value.status == "failed"
        assert [text for _, text in work.started] == ["slow", "now", "queued"]
        assert len({slow.run_id, queued.run_id, now.run_id}) == 3
        config = {"configurable": {"thread_id": thread, "tenant_id": "a"}}
        history = [s.values async for s in graph.aget_state_history(config)]
        assert history
        assert all(values.get("out") != "SLOW" for values in history)


async def test_enqueued_inputs_run_in_order_each_once_with_its_own_output(
    database: Database,
) -> None:
    async with opened(database, "client") as client, opened(database, "worker") as worker:
        work = Work()
        work.gates["first"] = asyncio.Event()
        thread = unique("t")
        first = await client.submit("shout", {"text": "first"}, cfg(thread), tenant_id="a")
        async with serving(worker, {"shout": build(worker, work)}, concurrency=4):
            await within(work.entered.setdefault("first", asyncio.Event()))
            queued = [
                await client.submit(
                    "shout", {"text": f"q{i}"}, cfg(thread), tenant_id="a", on_busy="enqueue"
                )
                for i in range(3)
            ]
            # The same submit again is that queued run (idempotent), nothing written.
            before = await rows(client, SUBMIT_TABLES)
            again = await client.submit(
                "shout", {"text": "q1"}, cfg(thread), tenant_id="a", on_busy="enqueue"
            )
            assert again.run_id == queued[1].run_id
            assert await rows(client, SUBMIT_TABLES) == before
            # Cancelled while queued: it never begins.
            extra = await client.submit(
                "shout", {"text": "never"}, cfg(thread), tenant_id="a", on_busy="enqueue"
            )
            assert await extra.cancel()
            work.gates["first"].set()
            outputs = [(await run.result(timeout=20))["out"] for run in [first, *queued]]
        assert outputs == ["FIRST", "Q0", "Q1", "Q2"]
        assert [text for _, text in work.started] == ["first", "q0", "q1", "q2"]
        with pytest.raises(RunFailedError, match="cancelled"):
            await extra.result(timeout=5)
        # Each handle still reads its own end after later runs of the thread (from any
        # process: get_run with the run id), and the execution's handle reads the latest.
        again_first = worker.get_run(thread, tenant_id="a", run_id=first.run_id)
        assert (await again_first.result(timeout=5))["out"] == "FIRST"
        assert (await worker.get_run(thread, tenant_id="a").result(timeout=5))["out"] == "Q2"
        epochs = [(await run.state()).epoch for run in [first, *queued]]
        assert epochs == sorted(set(epochs))  # each claimed at a token of its own, in order


async def test_a_worker_gone_between_queued_runs_loses_and_repeats_none(
    database: Database,
) -> None:
    """Worker A runs the first run and is gone before it begins the next; worker B begins
    the next (promotes it) and is gone before it claims it; worker C runs the rest. Each
    queued run runs once, in order, with its own output."""
    async with (
        opened(database, "client") as client,
        opened(database, "a") as a,
        opened(database, "b") as b,
        opened(database, "c") as c,
    ):
        work = Work()
        thread = unique("t")
        runs = [await client.submit("shout", {"text": "r0"}, cfg(thread), tenant_id="a")]
        for i in (1, 2):
            runs.append(
                await client.submit(
                    "shout", {"text": f"r{i}"}, cfg(thread), tenant_id="a", on_busy="enqueue"
                )
            )

        def server(instance: Instance) -> Any:
            return stepped(instance, {"shout": build(instance, work)})

        await look(server(a))  # runs r0; A looks no more
        assert (await runs[0].state()).status is LeaseStatus.DONE
        assert (await runs[1].state()).queued
        assert await b._run_queue().promote() == 1  # B begins r1, then is gone
        assert await b._run_queue().promote() == 0  # begun once: r1 is not done yet
        survivor = server(c)
        await look(survivor)  # r1
        await look(survivor)  # r2
        assert [text for _, text in work.started] == ["r0", "r1", "r2"]
        outputs = [(await run.result(timeout=5))["out"] for run in runs]
        assert outputs == ["R0", "R1", "R2"]


async def test_a_resume_beside_waiting_submitted_runs_is_refused(database: Database) -> None:
    """A resume (``None``, or a ``Command``) of a thread whose submitted run waits for a
    worker is refused, nothing written (before: it took the run's pending lease); and any
    start is refused while submitted runs are queued on the thread, its last run ended."""
    from langgraph.types import Command

    from langgraph_fence.execution.serve import Server

    async with opened(database, "client") as client, opened(database, "worker") as worker:
        work = Work()
        thread = unique("t")
        graph = build(client, work)
        run = await client.submit("shout", {"text": "queued"}, cfg(thread), tenant_id="a")
        queue = client._run_queue()
        before = (await rows(client), await run.state())
        for resume in (None, Command(resume="go")):
            with pytest.raises(ExecutionBusyError, match="waiting for a worker"):
                await client.ainvoke(graph, resume, cfg(thread), tenant_id="a")
            assert (await rows(client), await run.state()) == before
        # Its last run ended and one is queued: a start runs after it, or not at all.
        later = await client.submit(
            "shout", {"text": "later"}, cfg(thread), tenant_id="a", on_busy="enqueue"
        )
        graphs = {"shout": build(worker, work)}
        look = Server(
            worker.host, graphs, concurrency=1, poll_interval=0.02, max_takeovers=3, kwargs={}
        )
        await look.take_work(1)  # the first run only: it is pending, the next still queued
        await asyncio.wait_for(asyncio.gather(*look.running), 20)
        assert (await run.state()).status is LeaseStatus.DONE
        assert (await later.state()).queued
        before = (await rows(client), await run.state())
        for start in ({"text": "now"}, None):
            with pytest.raises(ExecutionBusyError, match="queued"):
                await client.ainvoke(graph, start, cfg(thread), tenant_id="a")
            assert (await rows(client), await run.state()) == before
        assert await queue.promote() == 1
        async with serving(worker, graphs):
            assert (await later.result(timeout=20))["out"] == "LATER"
        assert await run.result(timeout=5) == {"text": "queued", "out": "QUEUED"}
        assert [text for _, text in work.started] == ["queued", "later"]


async def test_the_queues_lease_writes_use_the_stores_clock(leases: Leases) -> None:
    """A submit, an interrupt and a cancel stamp the lease row by the lease store's clock
    (here the ``leases`` fixture's ManualClock), as every other lease write does, never the
    submitting process's ``time.time()``: the claim order by age reads one clock."""
    client = leases.instance("client")
    thread = unique("t")
    key = LeaseKey("a", thread)

    async def updated_at() -> float:
        async with leases.engine.connect() as conn:
            row = await conn.execute(
                text("SELECT updated_at FROM fence_leases WHERE execution_id = :e"), {"e": thread}
            )
            return float(row.scalar_one())

    await client.submit("shout", {"text": "one"}, cfg(thread), tenant_id="a")
    assert await updated_at() == leases.clock()
    leases.advance(5.0)
    await client.submit("shout", {"text": "two"}, cfg(thread), tenant_id="a", on_busy="interrupt")
    assert await updated_at() == leases.clock()
    leases.advance(5.0)
    assert await client.get_run(thread, tenant_id="a").cancel()
    assert await updated_at() == leases.clock()
    lease = await leases.store.get(key)
    assert lease is not None
    assert lease.status is LeaseStatus.CANCELLED

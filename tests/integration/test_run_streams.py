"""A submitted run's stream from any process (issue 37): ``submit(stream_mode=...)`` records
the run's events under its lease, and ``get_run(...).astream()`` in another instance yields
what an in-process ``graph.astream`` of the run yields, event for event, through an
interrupt and a takeover in the middle of a step, on SQLite and PostgreSQL."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest
from langgraph.store.memory import InMemoryStore
from langgraph.types import Command

from langgraph_fence import Instance, LeaseStatus
from langgraph_fence.lease.faults import arm_fault
from langgraph_fence.queue import SubmittedRun, SubmittedRuns
from langgraph_fence.testing import Leases
from tests.support.databases import SQL_BACKENDS, unique
from tests.support.polling import eventually
from tests.support.serving import cfg, look, stepped
from tests.support.stream_graphs import MODES, Hold, noted, orders, plain

RUNS_ON = SQL_BACKENDS


async def reference(instance: Instance, graph: Any) -> list[list[Any]]:
    """The in-process streams of the same two runs (to the interrupt, then resumed) on a
    thread of their own."""
    config = cfg(unique("reference"))
    first = [e async for e in graph.astream({"item": "book"}, config, stream_mode=MODES)]
    resume = Command(resume="yes")
    second = [e async for e in graph.astream(resume, config, stream_mode=MODES)]
    return [plain(first), plain(second)]


async def streamed(elsewhere: Instance, run: SubmittedRun, **options: Any) -> list[Any]:
    """The run's stream as another instance reads it (its own handle, by run id)."""
    handle = elsewhere.get_run(run.key.execution_id, tenant_id="a", run_id=run.run_id)
    return plain([e async for e in handle.astream(**options)])


class Waiting:
    """A thread at the interrupt (its first run served by the ``first`` worker, unrecorded),
    its resume submitted recording its stream, and the in-process streams to compare."""

    def __init__(self, db: Leases) -> None:
        self.db = db
        self.client, self.first = db.instance("client"), db.instance("first")
        self.second, self.reader = db.instance("second"), db.instance("reader")
        self.thread = unique("t")
        self.loop = stepped(self.first, {"orders": orders(self.first)})

    async def resume(self, **options: Any) -> tuple[SubmittedRun, list[Any]]:
        expected = await reference(self.first, orders(self.first))
        config = cfg(self.thread)
        await self.client.submit("orders", {"item": "book"}, config, tenant_id="a")
        await look(self.loop)
        resumed = await self.client.submit(
            "orders", Command(resume="yes"), config, tenant_id="a", stream_mode=MODES, **options
        )
        return resumed, expected[1]

    async def take_over(self, go: asyncio.Event) -> None:
        """The first worker frozen past its lease, the second takes the run over; then the
        first goes on (``go``) and its writes are refused."""
        self.db.stall(self.first)
        self.db.advance(31.0)
        await look(stepped(self.second, {"orders": orders(self.second)}))
        self.db.resume(self.first)
        go.set()
        await asyncio.wait_for(asyncio.gather(*self.loop.running), 20)


async def test_a_stream_read_elsewhere_equals_the_in_process_stream(db: Leases) -> None:
    client, worker, reader = db.instance("client"), db.instance("worker"), db.instance("reader")
    graph = orders(worker)
    expected = await reference(worker, graph)
    thread = unique("t")
    run = await client.submit(
        "orders", {"item": "book"}, cfg(thread), tenant_id="a", stream_mode=MODES
    )
    # Read while the run is pending and running: the stream waits, then ends with the run.
    live = asyncio.create_task(streamed(reader, run, poll_interval=0.01))
    loop = stepped(worker, {"orders": graph})
    await look(loop)
    assert (await run.state()).status is LeaseStatus.WAITING
    assert await asyncio.wait_for(live, 20) == expected[0]
    assert await streamed(reader, run) == expected[0]  # and after it ended
    resumed = await client.submit(
        "orders", Command(resume="yes"), cfg(thread), tenant_id="a", stream_mode=MODES
    )
    await look(loop)
    assert await streamed(reader, resumed) == expected[1]
    # One mode of those recorded, in LangGraph's shape for one mode (the payload alone).
    custom = await streamed(reader, resumed, stream_mode="custom")
    assert custom == [e for mode, e in expected[1] if mode == "custom"]


async def test_a_takeover_in_the_middle_of_a_step_streams_each_step_once(db: Leases) -> None:
    client, first, second = db.instance("client"), db.instance("first"), db.instance("second")
    reader = db.instance("reader")
    thread = unique("t")
    hold = Hold(thread)
    expected = await reference(first, orders(first))
    run = await client.submit(
        "orders", {"item": "book"}, cfg(thread), tenant_id="a", stream_mode=MODES
    )
    loop_a = stepped(first, {"orders": orders(first, hold)})
    await look(loop_a)
    resumed = await client.submit(
        "orders", Command(resume="yes"), cfg(thread), tenant_id="a", stream_mode=MODES
    )
    # The first worker streams `approve` and stores its checkpoint, then freezes in
    # `charge` past its lease. (Frozen before that checkpoint is stored, `approve` would
    # not run again: the limit docs/time.md states.)
    await loop_a.poll_once()
    await asyncio.to_thread(hold.entered.wait, 20)

    async def approved() -> bool:
        config = {"configurable": {"thread_id": thread, "tenant_id": "a"}}
        latest = await reader.checkpointer.aget_tuple(config)
        return latest is not None and "approve" in latest.checkpoint["channel_values"]["log"]

    await eventually(approved, timeout=20, what="approve's checkpoint")
    db.stall(first)
    db.advance(31.0)
    loop_b = stepped(second, {"orders": orders(second, hold)})
    await look(loop_b)  # resumes from approve's checkpoint, runs charge and notify
    assert (await resumed.state()).status is LeaseStatus.DONE
    db.resume(first)
    hold.release()
    await asyncio.wait_for(asyncio.gather(*loop_a.running), 20)  # its writes refused
    assert await streamed(reader, run) == expected[0]
    assert await streamed(reader, resumed) == expected[1]


async def test_events_recorded_before_a_takeover_are_withdrawn_when_their_steps_run_again(
    db: Leases,
) -> None:
    at = Waiting(db)
    # With durability="exit" the run's one checkpoint is its last: the first worker writes
    # every event of the run, then stalls before that checkpoint.
    resumed, expected = await at.resume(durability="exit")
    blocked, go = asyncio.Event(), asyncio.Event()

    def stall_once(context: dict[str, Any]) -> Any:
        if context["config"]["configurable"]["thread_id"] != at.thread or blocked.is_set():
            return None
        blocked.set()
        return go.wait()

    with arm_fault("checkpoint.before", stall_once):
        await at.loop.poll_once()
        await asyncio.wait_for(blocked.wait(), 20)
        seen: list[Any] = []

        async def read() -> None:
            handle = at.reader.get_run(at.thread, tenant_id="a", run_id=resumed.run_id)
            async for event in handle.astream(poll_interval=0.01):
                seen.append(plain(event))

        live = asyncio.create_task(read())
        # The second runs the resume again from the checkpoint it followed: the first
        # worker's events are withdrawn, never shown beside the second's.
        await at.take_over(go)
        await asyncio.wait_for(live, 20)
    assert seen == expected
    assert await streamed(at.reader, resumed) == expected


@pytest.mark.parametrize("finished", ["approve", "charge"])
async def test_a_task_finished_before_a_takeover_keeps_its_events_and_runs_once(
    db: Leases, finished: str
) -> None:
    """The first worker stores ``finished``'s writes, then stalls before the checkpoint of
    its step: the taker applies those writes and does not run the task again, so the
    stream keeps the first worker's events of it (``approve``: the taker begins from the
    resume's input again; ``charge``: from approve's checkpoint)."""
    at = Waiting(db)
    resumed, expected = await at.resume()
    written, blocked, go = asyncio.Event(), asyncio.Event(), asyncio.Event()

    def task_written(context: dict[str, Any]) -> None:
        if context["config"]["configurable"]["thread_id"] != at.thread:
            return
        if any(channel == "log" and value == [finished] for channel, value in context["writes"]):
            written.set()

    def stall_its_step(context: dict[str, Any]) -> Any:
        # The checkpoint that ends `finished`'s step, the first time it is written.
        ours = context["config"]["configurable"]["thread_id"] == at.thread
        log = context["checkpoint"]["channel_values"].get("log") or []
        if not ours or log[-1:] != [finished] or blocked.is_set():
            return None
        blocked.set()
        return go.wait()

    with arm_fault("writes.after", task_written), arm_fault("checkpoint.before", stall_its_step):
        await at.loop.poll_once()
        await asyncio.wait_for(asyncio.gather(blocked.wait(), written.wait()), 20)
        await at.take_over(go)
    assert (await resumed.state()).status is LeaseStatus.DONE
    assert await streamed(at.reader, resumed) == expected


@pytest.mark.parametrize("mode", [*MODES, ["custom"]], ids=str)
async def test_each_mode_alone_is_the_in_process_stream_in_its_shape(
    db: Leases, mode: str | list[str]
) -> None:
    client, worker, reader = db.instance("client"), db.instance("worker"), db.instance("reader")
    graph = orders(worker)
    reference = cfg(unique("reference"))
    expected = plain([e async for e in graph.astream({"item": "b"}, reference, stream_mode=mode)])
    run = await client.submit(
        "orders", {"item": "b"}, cfg(unique("t")), tenant_id="a", stream_mode=mode
    )
    await look(stepped(worker, {"orders": graph}))
    assert (await run.state()).status is LeaseStatus.WAITING
    assert await streamed(reader, run) == expected  # ["custom"]: (mode, payload) pairs


async def test_a_recorded_run_keeps_its_graphs_store(db: Leases) -> None:
    client, worker, reader = db.instance("client"), db.instance("worker"), db.instance("reader")
    run = await client.submit(
        "noted", {"item": "b"}, cfg(unique("t")), tenant_id="a", stream_mode="custom"
    )
    await look(stepped(worker, {"noted": noted(worker, InMemoryStore())}))
    assert (await run.state()).status is LeaseStatus.DONE
    assert await streamed(reader, run) == [{"noted": {"seen": True}}]


async def test_a_tasks_writes_wait_for_its_events(db: Leases, monkeypatch: Any) -> None:
    """LangGraph starts saving a task's writes before it streams the task's update: the
    update is written first, whatever the order (else a loss between the two would leave a
    finished task with no update to show)."""
    at = Waiting(db)
    resumed, expected = await at.resume(durability="sync")
    holding, go = asyncio.Event(), asyncio.Event()
    record = SubmittedRuns.record_stream

    async def held(self: SubmittedRuns, lease: Any, rows: Any) -> bool:
        if any(row["node"] == "charge" for row in rows) and not go.is_set():
            holding.set()
            await go.wait()
        return await record(self, lease, rows)

    monkeypatch.setattr(SubmittedRuns, "record_stream", held)
    await at.loop.poll_once()
    await asyncio.wait_for(holding.wait(), 20)
    config = {"configurable": {"thread_id": at.thread, "tenant_id": "a"}}
    latest = await at.reader.checkpointer.aget_tuple(config)  # type: ignore[arg-type]
    assert latest is not None
    assert not [w for w in latest.pending_writes or [] if w[1] == "log" and w[2] == ["charge"]]
    go.set()
    await asyncio.wait_for(asyncio.gather(*at.loop.running), 20)
    assert await streamed(at.reader, resumed) == expected


async def test_a_stream_is_read_only_where_it_was_recorded(db: Leases) -> None:
    client, worker = db.instance("client"), db.instance("worker")
    thread = unique("t")
    with pytest.raises(ValueError, match="stream_mode has 'debug'"):
        await client.submit(
            "orders", {"item": "b"}, cfg(thread), tenant_id="a", stream_mode="debug"
        )
    run = await client.submit("orders", {"item": "b"}, cfg(thread), tenant_id="a")
    with pytest.raises(ValueError, match="records no stream: submit it with stream_mode"):
        await anext(run.astream())
    await look(stepped(worker, {"orders": orders(worker)}))
    again = await client.submit(
        "orders", Command(resume="y"), cfg(thread), tenant_id="a", stream_mode="custom"
    )
    with pytest.raises(ValueError, match="records custom, not values"):
        await anext(again.astream(stream_mode="values"))
    latest = client.get_run(thread, tenant_id="a")
    with pytest.raises(ValueError, match="stream one run"):
        await anext(latest.astream())

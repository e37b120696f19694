"""A submitted run's stream from any process (issue 37): ``submit(stream_mode=...)`` records
the run's events under its lease, and ``get_run(...).astream()`` in another instance yields
what an in-process ``graph.astream`` of the run yields, event for event, through an
interrupt and a takeover in the middle of a step, on SQLite and PostgreSQL."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest
from langgraph.types import Command

from langgraph_fence import Instance, LeaseStatus
from langgraph_fence.lease.faults import arm_fault
from langgraph_fence.queue import SubmittedRun
from langgraph_fence.testing import Leases
from tests.support.databases import SQL_BACKENDS, unique
from tests.support.polling import eventually
from tests.support.serving import cfg, look, stepped
from tests.support.stream_graphs import MODES, Hold, orders, plain

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
    client, first, second = db.instance("client"), db.instance("first"), db.instance("second")
    reader = db.instance("reader")
    thread = unique("t")
    expected = await reference(first, orders(first))
    await client.submit("orders", {"item": "book"}, cfg(thread), tenant_id="a")
    loop_a = stepped(first, {"orders": orders(first)})
    await look(loop_a)
    # With durability="exit" the run's one checkpoint is its last: the first worker writes
    # every event of the run, then stalls before that checkpoint.
    resumed = await client.submit(
        "orders",
        Command(resume="yes"),
        cfg(thread),
        tenant_id="a",
        stream_mode=MODES,
        durability="exit",
    )
    blocked, go = asyncio.Event(), asyncio.Event()

    def stall_once(context: dict[str, Any]) -> Any:
        if context["config"]["configurable"]["thread_id"] != thread or blocked.is_set():
            return None
        blocked.set()
        return go.wait()

    with arm_fault("checkpoint.before", stall_once):
        await loop_a.poll_once()
        await asyncio.wait_for(blocked.wait(), 20)
        seen: list[Any] = []

        async def read() -> None:
            handle = reader.get_run(thread, tenant_id="a", run_id=resumed.run_id)
            async for event in handle.astream(poll_interval=0.01):
                seen.append(plain(event))

        live = asyncio.create_task(read())
        db.stall(first)
        db.advance(31.0)
        # Runs the resume again from the checkpoint it followed: the first worker's events
        # are withdrawn, never shown beside the second's.
        await look(stepped(second, {"orders": orders(second)}))
        db.resume(first)
        go.set()
        await asyncio.wait_for(asyncio.gather(*loop_a.running), 20)  # its checkpoint refused
        await asyncio.wait_for(live, 20)
    assert seen == expected[1]
    assert await streamed(reader, resumed) == expected[1]


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

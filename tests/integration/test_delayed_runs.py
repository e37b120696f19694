"""Delayed runs (issue 37): ``submit(..., not_before=...)`` starts no earlier than its time,
judged by the lease store's clock (the database's, or the ``leases`` fixture's ManualClock),
listed with its time while it waits, and refused up front when the time is malformed."""

from __future__ import annotations

import math
from datetime import UTC, datetime, timedelta
from typing import Any

import pytest

from langgraph_fence import Instance, LeaseStatus
from langgraph_fence.queue import list_runs
from langgraph_fence.testing import Leases
from tests.support.databases import Database, unique
from tests.support.serving import cfg, look, opened, stepped
from tests.support.shout import SUBMIT_TABLES, Work, build, rows


def server(instance: Instance, work: Work) -> Any:
    """A worker's serve loop, driven one look at a time (no wall clock)."""
    return stepped(instance, {"shout": build(instance, work)}, concurrency=4)


async def test_a_delayed_run_starts_at_its_time_on_the_stores_clock(leases: Leases) -> None:
    client, worker = leases.instance("client"), leases.instance("worker")
    work = Work()
    loop = server(worker, work)
    thread, at_thread = unique("t"), unique("t")
    submitted = leases.clock()
    run = await client.submit("shout", {"text": "later"}, cfg(thread), tenant_id="a", not_before=60)
    when = datetime.fromtimestamp(submitted + 30, UTC)
    at = await client.submit(
        "shout", {"text": "at"}, cfg(at_thread), tenant_id="a", not_before=when
    )
    state = await run.state()
    assert state.status is LeaseStatus.PENDING
    assert state.not_before == submitted + 60
    assert (await at.state()).not_before == when.timestamp()
    listed = {r.key.execution_id: r.not_before for r in await list_runs(leases.engine)}
    assert listed == {thread: submitted + 60, at_thread: when.timestamp()}

    await look(loop)
    assert work.started == []  # neither is due
    leases.advance(30)
    await look(loop)
    assert work.started == [("a", "at")]  # due at its time, not the other
    leases.advance(29.9)
    await look(loop)
    assert (await run.state()).status is LeaseStatus.PENDING
    leases.advance(0.1)
    await look(loop)
    assert await run.result(timeout=5) == {"text": "later", "out": "LATER"}
    assert work.started == [("a", "at"), ("a", "later")]


async def test_a_queued_run_keeps_its_time_when_it_begins(leases: Leases) -> None:
    """``on_busy="enqueue"`` with ``not_before``: the run begins behind the thread's run,
    then waits for its own time, and the run after it waits behind it."""
    client, worker = leases.instance("client"), leases.instance("worker")
    work = Work()
    loop = server(worker, work)
    thread = unique("t")
    first = await client.submit("shout", {"text": "now"}, cfg(thread), tenant_id="a")
    delayed = await client.submit(
        "shout", {"text": "delayed"}, cfg(thread), tenant_id="a", on_busy="enqueue",
        not_before=timedelta(minutes=10),
    )  # fmt: skip
    after = await client.submit(
        "shout", {"text": "after"}, cfg(thread), tenant_id="a", on_busy="enqueue"
    )
    queued = await delayed.state()
    assert queued.queued
    assert queued.not_before == leases.clock() + 600
    await look(loop)
    assert await first.result(timeout=5) == {"text": "now", "out": "NOW"}
    leases.advance(100)
    assert await client._run_queue().promote() == 1
    began = await delayed.state()
    assert not began.queued
    assert began.not_before == queued.not_before
    await look(loop)
    assert [text for _, text in work.started] == ["now"]
    leases.advance(500)
    await look(loop)  # its time: it runs
    await client._run_queue().promote()
    await look(loop)
    assert [text for _, text in work.started] == ["now", "delayed", "after"]
    assert (await after.result(timeout=5))["out"] == "AFTER"


async def test_a_delay_is_counted_on_the_databases_clock_and_a_scheduled_run_cancels(
    database: Database,
) -> None:
    async with opened(database, "client") as client:
        thread = unique("t")
        run = await client.submit(
            "shout", {"text": "x"}, cfg(thread), tenant_id="a", not_before=3600
        )
        now = await client.repository.now()  # the database's clock
        state = await run.state()
        assert state.not_before is not None
        assert 3598 < state.not_before - now <= 3600
        candidates = await client.repository.takeover_candidates(limit=100)
        assert thread not in {c.key.execution_id for c in candidates}
        assert await run.cancel()
        assert (await run.state()).status is LeaseStatus.CANCELLED


@pytest.mark.parametrize(
    ("not_before", "error", "says"),
    [
        (datetime(2030, 1, 1), ValueError, "naive datetime"),
        (-1, ValueError, "delay of 0 to"),
        (math.nan, ValueError, "delay of 0 to"),
        (math.inf, ValueError, "delay of 0 to"),
        (timedelta(days=-1), ValueError, "delay of 0 to"),
        ("in an hour", TypeError, "aware datetime"),
        (True, TypeError, "aware datetime"),
    ],
)
async def test_a_bad_not_before_is_refused_naming_it_before_anything_is_written(
    database: Database, not_before: Any, error: type[Exception], says: str
) -> None:
    async with opened(database, "client") as client:
        before = await rows(client, SUBMIT_TABLES)
        with pytest.raises(error, match="not_before") as refused:
            await client.submit(
                "shout", {"text": "x"}, cfg(unique("t")), tenant_id="a", not_before=not_before
            )
        assert says in str(refused.value)
        assert await rows(client, SUBMIT_TABLES) == before

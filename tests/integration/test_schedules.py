"""Schedules (issue 37): a cron in a time zone that submits one run per tick, each tick fired
once by whichever worker looks first, on the store's clock (the ``leases`` fixture's
ManualClock, or the database's); overlap, missed ticks, pause, resume, end, bad input.

The multi-process proof (workers SIGKILLed, the database restarted, every tick counted once)
is ``tests/chaos/test_schedules_chaos.py``."""

from __future__ import annotations

import asyncio
import re
import time
from collections import Counter
from datetime import UTC, datetime
from typing import Any, TypedDict

import pytest
from langchain_core.runnables import RunnableConfig
from sqlalchemy import text

from langgraph_fence import Instance, LeaseStatus
from langgraph_fence.errors import ExecutionThreadBoundError
from langgraph_fence.queue import Schedule
from langgraph_fence.queue._ticks import next_tick
from langgraph_fence.testing import Leases
from tests.support.databases import Database, unique
from tests.support.graphs import one_step
from tests.support.serving import cfg, look, opened, stepped

MINUTE = 60.0


class Tick(TypedDict, total=False):
    text: str
    tick: str


def ticked(
    instance: Instance,
    seen: list[str],
    gate: asyncio.Event | None = None,
    entered: asyncio.Event | None = None,
) -> Any:
    """``tick``: records the tick its run was fired for (``config["metadata"]``), says it
    ``entered``, then waits for ``gate``."""

    async def node(state: Tick, config: RunnableConfig) -> dict[str, Any]:
        scheduled_for = config["metadata"]["scheduled_for"]
        seen.append(scheduled_for)
        if entered is not None:
            entered.set()
        if gate is not None:
            await gate.wait()
        return {"tick": scheduled_for}

    return one_step(instance, Tick, "tick", node, name="tick")


def iso(at: float) -> str:
    return datetime.fromtimestamp(at, UTC).isoformat()


async def runs_of(instance: Instance, thread: str) -> list[str]:
    """The statuses of the thread's submitted runs, in submit order."""
    engine = instance._run_queue()._engine
    async with engine.connect() as conn:
        found = await conn.execute(
            text("SELECT status FROM fence_runs WHERE thread_id = :t ORDER BY seq"), {"t": thread}
        )
        return [row.status for row in found]


async def _ticks(instance: Any, thread: str) -> list[str]:
    engine = instance._run_queue()._engine
    serde = instance._run_queue().serde
    async with engine.connect() as conn:
        rows = await conn.execute(
            text("SELECT run_type, run FROM fence_runs WHERE thread_id = :t ORDER BY seq"),
            {"t": thread},
        )
        return [
            serde.loads_typed((row.run_type, bytes(row.run)))["config"]["metadata"]["scheduled_for"]
            for row in rows
        ]


async def create(instance: Instance, thread: str, **options: Any) -> Schedule:
    options.setdefault("cron", "* * * * *")
    return await instance.schedules.create(
        unique("s"), "tick", {"text": "hi"}, cfg(thread), tenant_id="a", **options
    )


async def test_each_tick_fires_once_whichever_worker_looks(leases: Leases) -> None:
    a, b = leases.instance("a"), leases.instance("b")
    seen: list[str] = []
    loops = [stepped(w, {"tick": ticked(w, seen)}, concurrency=4) for w in (a, b)]
    thread = unique("t")
    schedule = await create(a, thread, overlap="enqueue", grace=600)
    first = schedule.next_tick
    assert first == 1_000_020.0  # the next whole minute after the clock's 1_000_000
    assert (schedule.fired, schedule.paused, schedule.last_tick) == (0, False, None)
    for loop in loops:
        await look(loop)
    assert seen == []  # not due yet
    leases.advance(first - leases.clock())
    for loop in loops:
        await look(loop)  # a fires it and runs it; b finds it fired
    assert seen == [iso(first)]
    leases.advance(3 * MINUTE)  # three more ticks due at once
    await asyncio.gather(*(look(loop) for loop in loops))
    for _ in range(3):
        for loop in loops:
            await b._run_queue().promote()
            await look(loop)
    assert seen == [iso(first + n * MINUTE) for n in range(4)]
    now = await b.schedules.get(schedule.schedule_id, tenant_id="a")
    assert now is not None
    assert (now.fired, now.skipped) == (4, 0)
    assert now.last_tick == first + 3 * MINUTE
    assert now.next_tick == first + 4 * MINUTE
    # The thread's latest run is its execution's (current); the ones before ended done.
    assert await runs_of(a, thread) == ["done"] * 3 + ["current"]
    assert (await a.get_run(thread, tenant_id="a").state()).status is LeaseStatus.DONE


async def test_the_tick_is_in_the_runs_metadata_beside_the_users(leases: Leases) -> None:
    worker = leases.instance("w")
    metadata: list[dict[str, Any]] = []

    async def node(state: Tick, config: RunnableConfig) -> dict[str, Any]:
        metadata.append(dict(config["metadata"]))
        return {}

    graphs = {"tick": one_step(worker, Tick, "tick", node, name="tick")}
    config = {**cfg(unique("t")), "metadata": {"team": "billing"}}
    schedule = await worker.schedules.create(
        unique("s"), "tick", {"text": "x"}, config, tenant_id="a", cron="*/5 * * * *"
    )
    assert schedule.next_tick is not None
    leases.advance(schedule.next_tick - leases.clock())
    await look(stepped(worker, graphs))
    [seen] = metadata
    assert seen["team"] == "billing"
    assert seen["schedule_id"] == schedule.schedule_id
    assert seen["scheduled_for"] == iso(schedule.next_tick)


@pytest.mark.parametrize(("missed", "fired"), [("skip", 1), ("run_one", 2)])
async def test_ticks_later_than_their_grace_are_skipped_or_run_once(
    leases: Leases, missed: str, fired: int
) -> None:
    """The fleet was down for ten ticks: those more than ``grace`` late are skipped, or one
    run stands for them (``run_one``); the tick within the grace fires."""
    worker = leases.instance("w")
    seen: list[str] = []
    schedule = await create(worker, unique("t"), missed=missed, grace=90, overlap="enqueue")
    assert schedule.next_tick is not None
    leases.advance(schedule.next_tick - leases.clock() + 10 * MINUTE + 45)
    loop = stepped(worker, {"tick": ticked(worker, seen)})
    for _ in range(3):
        await worker._run_queue().promote()
        await look(loop)
    last = schedule.next_tick + 10 * MINUTE
    expected = [iso(last)] if missed == "skip" else [iso(last - MINUTE), iso(last)]
    assert seen == expected
    now = await worker.schedules.get(schedule.schedule_id, tenant_id="a")
    assert now is not None
    assert (now.fired, now.skipped) == (fired, 11 - fired)
    assert now.next_tick == last + MINUTE


@pytest.mark.parametrize("overlap", ["skip", "enqueue", "cancel_previous"])
async def test_a_tick_beside_a_run_still_going_follows_the_overlap_policy(
    leases: Leases, overlap: str
) -> None:
    worker = leases.instance("w", lease_ttl=600)  # holds its run past the next tick
    seen: list[str] = []
    gate, entered = asyncio.Event(), asyncio.Event()
    loop = stepped(worker, {"tick": ticked(worker, seen, gate, entered)}, concurrency=2)
    thread = unique("t")
    schedule = await create(worker, thread, overlap=overlap)
    assert schedule.next_tick is not None
    leases.advance(schedule.next_tick - leases.clock())
    await loop.poll_once()  # fires the first tick and starts its run, held by the gate
    await asyncio.wait_for(entered.wait(), 20)  # in its node, held there by the gate
    leases.advance(MINUTE)
    await loop.poll_once()  # the second tick, beside the first run
    gate.set()
    await asyncio.gather(*loop.running)
    await worker._run_queue().promote()
    await look(loop)
    now = await worker.schedules.get(schedule.schedule_id, tenant_id="a")
    assert now is not None
    statuses = await runs_of(worker, thread)
    if overlap == "skip":
        assert (now.fired, now.skipped, statuses) == (1, 1, ["current"])
    elif overlap == "enqueue":
        assert (now.fired, now.skipped, statuses) == (2, 0, ["done", "current"])
        assert seen == [iso(schedule.next_tick), iso(schedule.next_tick + MINUTE)]
    else:
        assert (now.fired, now.skipped, statuses) == (2, 0, ["failed", "current"])
    assert (await worker.get_run(thread, tenant_id="a").state()).status is LeaseStatus.DONE


async def test_pause_resume_end_and_delete(leases: Leases) -> None:
    worker = leases.instance("w")
    seen: list[str] = []
    loop = stepped(worker, {"tick": ticked(worker, seen)})
    start = leases.clock()
    end = datetime.fromtimestamp(start + 10 * MINUTE, UTC)
    schedule = await create(worker, unique("t"), end_at=end, overlap="enqueue")
    sid = schedule.schedule_id
    assert await worker.schedules.pause(sid, tenant_id="a")
    leases.advance(3 * MINUTE)
    await look(loop)
    assert seen == []  # paused: nothing fires
    assert await worker.schedules.resume(sid, tenant_id="a")
    assert not await worker.schedules.resume(sid, tenant_id="a")  # not paused
    resumed = await worker.schedules.get(sid, tenant_id="a")
    assert resumed is not None
    assert resumed.next_tick is not None
    assert resumed.next_tick > leases.clock()  # the ticks while paused are not fired
    leases.advance(resumed.next_tick - leases.clock())
    await look(loop)
    assert seen == [iso(resumed.next_tick)]
    leases.advance(30 * MINUTE)  # past its end: the ticks before the end only
    for _ in range(10):
        await worker._run_queue().promote()
        await look(loop)
    ended = await worker.schedules.get(sid, tenant_id="a")
    assert ended is not None
    assert ended.next_tick is None
    assert ended.last_tick is not None
    assert ended.last_tick <= end.timestamp()
    assert len(seen) == ended.fired
    assert [s.schedule_id for s in await worker.schedules.list(tenant_id="a")] == [sid]
    assert await worker.schedules.delete(sid, tenant_id="a")
    assert await worker.schedules.get(sid, tenant_id="a") is None
    assert not await worker.schedules.delete(sid, tenant_id="a")


async def test_racing_workers_fire_each_due_tick_once_on_the_databases_clock(
    database: Database,
) -> None:
    """Four instances fire the same due ticks at once (a schedule's next tick set back five
    seconds by hand, every second a tick): each tick submits exactly one run."""
    async with (
        opened(database, "a") as a,
        opened(database, "b") as b,
        opened(database, "c") as c,
        opened(database, "d") as d,
    ):
        thread = unique("t")
        schedule = await create(a, thread, cron="* * * * * *", overlap="enqueue", grace=600)
        engine = a._run_queue()._engine
        async with engine.begin() as conn:
            await conn.execute(
                text(
                    "UPDATE fence_schedules SET next_tick = floor(next_tick) - 5 "
                    "WHERE schedule_id = :s"
                ),
                {"s": schedule.schedule_id},
            )
        fired = await asyncio.gather(*(i.schedules.fire_due() for i in (a, b, c, d)))
        now = await a.schedules.get(schedule.schedule_id, tenant_id="a")
        assert now is not None
        assert sum(fired) == now.fired >= 5
        async with engine.connect() as conn:
            rows = await conn.execute(
                text("SELECT run FROM fence_runs WHERE thread_id = :t"), {"t": thread}
            )
            serde = a._run_queue().serde
            ticks = [
                serde.loads_typed(("msgpack", bytes(row.run)))["config"]["metadata"][
                    "scheduled_for"
                ]
                for row in rows
            ]
        assert len(ticks) == now.fired
        assert Counter(ticks).most_common(1)[0][1] == 1  # none twice
        assert (await a.get_run(thread, tenant_id="a").state()).status is LeaseStatus.PENDING


@pytest.mark.parametrize(
    ("options", "says"),
    [
        ({"cron": "every minute"}, "cron must be a cron expression"),
        ({"cron": "* * *"}, "cron must be a cron expression"),
        ({"cron": "61 * * * *"}, "cron must be a cron expression"),
        ({"timezone": "Mars/Olympus"}, "timezone must be an IANA time zone"),
        ({"overlap": "drop"}, "overlap must be one of"),
        ({"missed": "all"}, "missed must be one of"),
        ({"grace": -1}, "grace must be"),
        ({"end_at": datetime(2030, 1, 1)}, "end_at must be an aware datetime"),
        ({"cron": "* * * * *", "durability": object()}, "durability= cannot be recorded"),
    ],
)
async def test_a_bad_schedule_is_refused_naming_it_before_anything_is_written(
    database: Database, options: dict[str, Any], says: str
) -> None:
    async with opened(database, "client") as client:
        with pytest.raises(ValueError, match=re.escape(says)):
            await create(client, unique("t"), **options)
        assert await client.schedules.list() == []


async def test_an_existing_schedule_is_refused_unless_replaced_and_a_bound_thread_too(
    database: Database,
) -> None:
    async with opened(database, "client") as client:
        thread = unique("t")
        made = await create(client, thread)
        with pytest.raises(ValueError, match="exists: nothing written"):
            await client.schedules.create(
                made.schedule_id, "tick", {"text": "x"}, cfg(thread), tenant_id="a",
                cron="0 * * * *",
            )  # fmt: skip
        replaced = await client.schedules.create(
            made.schedule_id, "tick", {"text": "x"}, cfg(thread), tenant_id="a",
            cron="0 * * * *", replace=True,
        )  # fmt: skip
        assert replaced.cron == "0 * * * *"
        with pytest.raises(ValueError, match="reserved for child executions"):
            await client.schedules.create(
                unique("s"), "tick", {"text": "x"}, cfg("lgf-child:x"), tenant_id="a",
                cron="* * * * *",
            )  # fmt: skip
        with pytest.raises(ExecutionThreadBoundError):
            await client.schedules.create(
                unique("s"), "tick", {"text": "x"}, cfg(thread), tenant_id="a",
                cron="* * * * *", execution_id="another",
            )  # fmt: skip


async def test_a_replace_that_straddles_a_tick_never_fires_it_again(database: Database) -> None:
    """create(replace=True) computes the first tick after the store's clock; a firing of
    that tick by another worker between the replace's read of the clock and its write
    (injected: the replace's client pauses there, as a GC pause or a lock wait would) must
    not be undone, or the tick fires twice. The replace locks the row first and starts after
    the last tick fired."""
    if "sqlite" in database.url:
        pytest.skip("SQLite's BEGIN IMMEDIATE serialises the replace with the firing")
    async with opened(database, "a") as a, opened(database, "b") as b:
        thread = unique("t")
        sid = unique("s")
        options: dict[str, Any] = {
            "tenant_id": "a",
            "cron": "* * * * * *",
            "overlap": "enqueue",
            "grace": 600,
        }
        await a.schedules.create(sid, "tick", {"text": "hi"}, cfg(thread), **options)
        schedules = a.schedules
        queue_db = schedules._db  # where the replace reads the store's clock
        read, go = asyncio.Event(), asyncio.Event()
        real = queue_db.store_now
        seen: list[float] = []

        async def paused_store_now(conn: Any) -> float:
            now = await real(conn)
            seen.append(now)
            read.set()
            await go.wait()
            return now

        queue_db.store_now = paused_store_now  # type: ignore[method-assign]
        replacing = asyncio.create_task(
            schedules.create(sid, "tick", {"text": "hi"}, cfg(thread), replace=True, **options)
        )
        await read.wait()
        tick = next_tick("* * * * * *", "UTC", seen[0])
        await asyncio.sleep(max(0.0, tick - time.time()) + 0.2)
        await b.schedules.fire_due()  # fires T (and any before it)
        # T's run ends (a worker ran it in milliseconds; here: cancelled), so a second
        # submit of T is not folded into it as "the same submit again".
        await b.get_run(thread, tenant_id="a").cancel()
        go.set()
        await replacing
        queue_db.store_now = real  # type: ignore[method-assign]
        await asyncio.sleep(0.2)
        await b.schedules.fire_due()
        ticks = await _ticks(b, thread)
        t_iso = datetime.fromtimestamp(tick, UTC).isoformat()
        assert Counter(ticks)[t_iso] == 1, (
            f"tick {t_iso} fired {Counter(ticks)[t_iso]} times: {ticks}"
        )


def test_a_daily_schedule_at_an_ambiguous_local_time_fires_once_that_day() -> None:
    """'30 2 * * *' in Europe/Paris: on 2026-10-25 02:30 happens twice (CEST, then CET); a
    daily job (a digest, a payment run) fires once that day, as cron fires it. An hourly
    job fires once in the repeated hour, one of every 30 minutes at each local time."""
    start = datetime(2026, 10, 24, 12, tzinfo=UTC).timestamp()
    first = next_tick("30 2 * * *", "Europe/Paris", start)
    second = next_tick("30 2 * * *", "Europe/Paris", first)
    gap_hours = (second - first) / 3600
    assert gap_hours >= 23, f"two daily ticks {gap_hours:.0f} h apart on the fall-back day"
    hourly = [next_tick("0 * * * *", "Europe/Paris", start)]
    while len(hourly) < 20:
        hourly.append(next_tick("0 * * * *", "Europe/Paris", hourly[-1]))
    fall = datetime(2026, 10, 25, 0, 30, tzinfo=UTC).timestamp()  # 02:30 CEST
    # 02:00 CEST is at 00:00 UTC, and 03:00 CET at 02:00 UTC: 02:00 CET (01:00 UTC) is skipped.
    assert fall - 1800 in hourly
    assert fall + 5400 in hourly
    assert fall + 1800 not in hourly

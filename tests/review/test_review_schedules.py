"""Review reproducers (issue 37, schedules). Each fails on 1826fbd."""

from __future__ import annotations

import asyncio
import time
from collections import Counter
from datetime import UTC, datetime
from typing import Any

import pytest
from sqlalchemy import text

from langgraph_fence.queue._ticks import next_tick
from tests.support.databases import Database, unique
from tests.support.serving import cfg, opened


async def _ticks(instance: Any, thread: str) -> list[str]:
    engine = instance._run_queue()._engine
    serde = instance._run_queue().serde
    async with engine.connect() as conn:
        rows = await conn.execute(
            text("SELECT run_type, run FROM fence_runs WHERE thread_id = :t ORDER BY seq"),
            {"t": thread},
        )
        return [
            serde.loads_typed((row.run_type, bytes(row.run)))["config"]["metadata"][
                "scheduled_for"
            ]
            for row in rows
        ]


async def test_review_a_replace_that_straddles_a_tick_fires_it_again(database: Database) -> None:
    """create(replace=True) reads the store's clock, computes the first tick after it (T),
    then upserts next_tick = T. A firing of T that commits between the two (another worker;
    on PostgreSQL the replace's upsert even waits for the firing's row lock) is undone: T is
    due again and fires a second time. Here the replace's client pauses between its read of
    the clock and its upsert (a GC pause, a slow event loop, a lock wait)."""
    if "sqlite" in database.url:
        pytest.skip("SQLite's BEGIN IMMEDIATE serialises the replace with the firing")
    async with opened(database, "a") as a, opened(database, "b") as b:
        thread = unique("t")
        sid = unique("s")
        options: dict[str, Any] = {
            "tenant_id": "a", "cron": "* * * * * *", "overlap": "enqueue", "grace": 600,
        }
        await a.schedules.create(sid, "tick", {"text": "hi"}, cfg(thread), **options)
        schedules = a.schedules
        read, go = asyncio.Event(), asyncio.Event()
        real = schedules._store_now
        seen: list[float] = []

        async def paused_store_now(conn: Any) -> float:
            now = await real(conn)
            seen.append(now)
            read.set()
            await go.wait()
            return now

        schedules._store_now = paused_store_now  # type: ignore[method-assign]
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
        schedules._store_now = real  # type: ignore[method-assign]
        await asyncio.sleep(0.2)
        await b.schedules.fire_due()
        ticks = await _ticks(b, thread)
        t_iso = datetime.fromtimestamp(tick, UTC).isoformat()
        assert Counter(ticks)[t_iso] == 1, f"tick {t_iso} fired {Counter(ticks)[t_iso]} times: {ticks}"


def test_review_a_daily_schedule_at_an_ambiguous_local_time_fires_once_that_day() -> None:
    """'30 2 * * *' in Europe/Paris: on 2026-10-25 02:30 happens twice (CEST, then CET).
    A daily job (a digest, a payment run) fires twice that day; cron, systemd timers and
    most schedulers fire a fixed-time job once across a fall-back."""
    start = datetime(2026, 10, 24, 12, tzinfo=UTC).timestamp()
    first = next_tick("30 2 * * *", "Europe/Paris", start)
    second = next_tick("30 2 * * *", "Europe/Paris", first)
    gap_hours = (second - first) / 3600
    assert gap_hours >= 23, f"two daily ticks {gap_hours:.0f} h apart on the fall-back day"

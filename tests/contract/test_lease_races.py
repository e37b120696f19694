"""Races on the SQL stores, each contender on an engine (a connection) of its own.

The engines of one test share one database (one SQLite file, one PostgreSQL schema), as
separate processes would. Every test runs under a deadline; nothing waits on a sleep.
"""

from __future__ import annotations

import asyncio
import logging
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from functools import partial
from pathlib import Path
from typing import Any, TypeVar

import pytest
from sqlalchemy import text
from sqlalchemy.ext.asyncio import AsyncEngine

from langgraph_fence import ExecutionFencedError, Lease, LeaseKey, SqlLeaseRepository
from langgraph_fence.database import create_engine
from langgraph_fence.lease.records import EXECUTION_MIGRATIONS
from langgraph_fence.lease.schema import LEASE_MIGRATIONS
from langgraph_fence.testing import ManualClock
from tests.support.databases import SQL_BACKENDS, pg_admin_async, pg_engine_options, unique

T = TypeVar("T")
TTL = 10.0
DEADLINE = 60.0

RUNS_ON = SQL_BACKENDS


async def bounded(awaitable: Awaitable[T], seconds: float = DEADLINE) -> T:
    async with asyncio.timeout(seconds):
        return await awaitable


async def stores(
    make_engine: Callable[[str], AsyncEngine], backend: str, clock: ManualClock, count: int
) -> list[SqlLeaseRepository]:
    """``count`` stores, each on an engine of its own with its connection already open."""
    result = [SqlLeaseRepository(make_engine(backend), clock=clock) for _ in range(count)]
    await result[0].setup()

    async def warm(store: SqlLeaseRepository) -> None:
        async with store.engine.connect() as conn:
            await conn.execute(text("SELECT 1"))

    await asyncio.gather(*(warm(store) for store in result))
    return result


async def dispose(all_stores: list[SqlLeaseRepository]) -> None:
    await asyncio.gather(*(store.engine.dispose() for store in all_stores))


async def race(calls: list[Callable[[], Awaitable[T]]]) -> list[T | BaseException]:
    """Start every call at the same moment (after one shared event) and gather them all."""
    go = asyncio.Event()
    waiting = 0
    all_waiting = asyncio.Event()

    async def contender(call: Callable[[], Awaitable[T]]) -> T:
        nonlocal waiting
        waiting += 1
        if waiting == len(calls):
            all_waiting.set()
        await go.wait()
        return await call()

    tasks = [asyncio.ensure_future(contender(call)) for call in calls]
    await all_waiting.wait()  # every contender is at the event: none has a head start
    go.set()
    return await asyncio.gather(*tasks, return_exceptions=True)


async def test_fifty_concurrent_acquires_one_winner(
    backend: str, make_engine: Callable[[str], AsyncEngine], clock: ManualClock
) -> None:
    contenders = await bounded(stores(make_engine, backend, clock, 50))
    try:
        key = LeaseKey(unique("t"), unique("e"))
        for expected_epoch in (1, 2):
            results = await bounded(
                race(
                    [
                        partial(store.acquire, key, f"worker-{i}", TTL)
                        for i, store in enumerate(contenders)
                    ]
                )
            )
            errors = [r for r in results if isinstance(r, BaseException)]
            assert errors == []
            winners = [r for r in results if isinstance(r, Lease)]
            assert len(winners) == 1, winners
            assert results.count(None) == 49
            winner = winners[0]
            assert winner.epoch == expected_epoch
            assert await contenders[0].get(key) == winner
            clock.advance(TTL)  # the next round races for the expired lease
    finally:
        await dispose(contenders)


async def test_twenty_takeovers_count_one_to_twenty(
    backend: str, make_engine: Callable[[str], AsyncEngine], clock: ManualClock
) -> None:
    contenders = await bounded(stores(make_engine, backend, clock, 5))
    try:
        key = LeaseKey(unique("t"), unique("e"))
        taken: list[Lease] = []
        for round_no in range(20):
            results = await bounded(
                race(
                    [
                        partial(store.acquire, key, f"w{round_no}-{i}", TTL)
                        for i, store in enumerate(contenders)
                    ]
                )
            )
            winners = [r for r in results if isinstance(r, Lease)]
            assert len(winners) == 1, results
            assert results.count(None) == 4, results
            taken.append(winners[0])
            clock.advance(TTL)
        assert [lease.epoch for lease in taken] == list(range(1, 21))
        # Every superseded holder is fenced, with the newest epoch as the one seen.
        for stale in taken[:-1]:
            with pytest.raises(ExecutionFencedError) as caught:
                await contenders[stale.epoch % 5].renew(stale, TTL)
            assert caught.value.token_seen == 20
        # The epoch counts per key: a key of its own starts again at 1.
        fresh = await contenders[0].acquire(LeaseKey(key.tenant_id, unique("e")), "w", TTL)
        assert fresh is not None
        assert fresh.epoch == 1
    finally:
        await dispose(contenders)


async def test_renew_racing_a_takeover_never_both_succeed(
    backend: str, make_engine: Callable[[str], AsyncEngine], clock: ManualClock
) -> None:
    holder_store, taker_store = await bounded(stores(make_engine, backend, clock, 2))
    outcomes = {"renew first": 0, "takeover first": 0}
    try:
        key = LeaseKey(unique("t"), unique("e"))
        lease = await holder_store.acquire(key, "A", TTL)
        assert lease is not None
        rounds = 0
        async with asyncio.timeout(DEADLINE):
            # Enough rounds, alternating who starts first, until both orders were seen.
            while rounds < 60 or (min(outcomes.values()) == 0 and rounds < 400):
                rounds += 1
                clock.advance(TTL)  # expired: either may now win
                renew = partial(holder_store.renew, lease, TTL)
                take = partial(taker_store.acquire, key, "B", TTL)
                calls: list[Callable[[], Awaitable[Any]]] = (
                    [renew, take] if rounds % 2 else [take, renew]
                )
                results = await race(calls)
                renewed, taken = results if rounds % 2 else results[::-1]
                current = await holder_store.get(key)
                assert current is not None
                if isinstance(renewed, Lease):
                    assert taken is None, "a renew and a takeover both succeeded"
                    assert renewed.epoch == lease.epoch
                    assert current == renewed
                    outcomes["renew first"] += 1
                else:
                    assert isinstance(renewed, ExecutionFencedError), renewed
                    assert isinstance(taken, Lease), taken
                    assert taken.epoch == lease.epoch + 1
                    assert renewed.token_seen == taken.epoch
                    assert current == taken
                    outcomes["takeover first"] += 1
                # Hand the key back to "A" for the next round, at a new epoch.
                clock.advance(TTL)
                again = await holder_store.acquire(key, "A", TTL)
                assert again is not None
                lease = again
        assert min(outcomes.values()) > 0, f"only one order was ever seen: {outcomes}"
    finally:
        await dispose([holder_store, taker_store])


@pytest.fixture
async def fresh_database(
    backend: str, request: pytest.FixtureRequest, tmp_path: Path
) -> AsyncIterator[Callable[[], AsyncEngine]]:
    """Engines on a database no migration has touched yet (a new file or a new schema)."""
    engines: list[AsyncEngine] = []
    if backend == "sqlite":
        url, options = f"sqlite+aiosqlite:///{tmp_path / 'fresh.db'}", {}
        schema = None
    else:
        url, _ = request.getfixturevalue("pg_schema")
        schema = f"lgf_mig_{uuid.uuid4().hex[:12]}"
        options = pg_engine_options(schema)
        await pg_admin_async(url, f'CREATE SCHEMA "{schema}"')

    def make() -> AsyncEngine:
        engine = create_engine(url, **options)
        engines.append(engine)
        return engine

    yield make
    await asyncio.gather(*(engine.dispose() for engine in engines))
    if schema is not None:
        await pg_admin_async(url, f'DROP SCHEMA IF EXISTS "{schema}" CASCADE')


async def test_concurrent_setup_migrates_once(
    backend: str, fresh_database: Callable[[], AsyncEngine], caplog: pytest.LogCaptureFixture
) -> None:
    repos = [SqlLeaseRepository(fresh_database(), clock=ManualClock()) for _ in range(8)]
    caplog.set_level(logging.INFO, logger="langgraph_fence.migrations")
    results = await bounded(race([repo.setup for repo in repos]))
    assert [r for r in results if isinstance(r, BaseException)] == []
    migrations = [r for r in caplog.records if r.getMessage().startswith("migrating leases")]
    assert [r.getMessage().split(":")[0] for r in migrations] == [
        f"migrating leases to version {m.version}" for m in LEASE_MIGRATIONS
    ]
    async with repos[0].engine.connect() as conn:
        rows = (
            await conn.execute(text("SELECT component, version FROM fence_schema_versions"))
        ).all()
    # The lease store's setup creates the execution records' tables beside its own.
    assert dict(tuple(row) for row in rows) == {
        "leases": len(LEASE_MIGRATIONS),
        "executions": len(EXECUTION_MIGRATIONS),
    }
    if backend == "sqlite":
        # Racing first connections may defer WAL; a later one turns it on for good.
        async with fresh_database().connect() as conn:
            mode = (await conn.exec_driver_sql("PRAGMA journal_mode")).scalar_one()
        assert mode == "wal"
    # Every store works on the migrated table, and setup again is a no-op.
    lease = await repos[-1].acquire(LeaseKey(unique("t"), unique("e")), "A", TTL)
    assert lease is not None
    assert lease.epoch == 1
    caplog.clear()
    await bounded(asyncio.gather(*(repo.setup() for repo in repos)))
    assert not [r for r in caplog.records if r.getMessage().startswith("migrating")]


async def test_first_takes_racing_on_new_keys_never_error(
    backend: str, make_engine: Callable[[str], AsyncEngine], clock: ManualClock
) -> None:
    # Racing first inserts are where a unique index other than the upsert's conflict target
    # turns a lost race into an IntegrityError instead of None.
    contenders = await bounded(stores(make_engine, backend, clock, 20))
    try:
        for _ in range(80):
            key = LeaseKey(unique("t"), unique("e"))
            results = await bounded(
                race(
                    [
                        partial(store.acquire, key, f"w{i}", TTL)
                        for i, store in enumerate(contenders)
                    ]
                )
            )
            assert [r for r in results if isinstance(r, BaseException)] == []
            assert sum(isinstance(r, Lease) for r in results) == 1
    finally:
        await dispose(contenders)

"""``renew_many``: one statement renews many holds and tells which were refused.

The keeper renews every lease an instance holds with it (``langgraph_fence.execution.keeper``), so
its answer must be, lease by lease, the one ``renew`` gives: renewed to store-now + TTL
while the hold is current, an ``ExecutionFencedError`` naming the epoch seen (and nothing
changed) once it is not. Run on every store (memory, SQLite, PostgreSQL); the guard itself
is held to the other guarded statements in ``test_guard.py``.
"""

from __future__ import annotations

from typing import Any

import pytest
from sqlalchemy import event
from sqlalchemy.ext.asyncio import create_async_engine

from langgraph_fence import (
    ExecutionFencedError,
    ExecutionLeaseRepository,
    Lease,
    LeaseKey,
    LeaseStatus,
    MemoryLeaseRepository,
    SqlLeaseRepository,
)
from langgraph_fence.database import create_engine, normalize_url
from langgraph_fence.testing import ManualClock
from tests.support.databases import pg_engine_options, unique

TTL = 10.0


async def held(store: ExecutionLeaseRepository, holder: str = "A") -> Lease:
    lease = await store.acquire(LeaseKey(unique("tenant"), unique("exec")), holder, TTL)
    assert lease is not None
    return lease


async def test_renews_every_current_hold_and_refuses_each_stale_one_on_its_own(
    lease_store: ExecutionLeaseRepository, clock: ManualClock
) -> None:
    kept = await held(lease_store)
    lapsed = await held(lease_store)  # expired, nobody took it: still current
    taken = await held(lease_store)
    ended = await held(lease_store)
    clock.advance(TTL + 1)
    newer = await lease_store.acquire(taken.key, "B", TTL)
    assert newer is not None
    done = await lease_store.release(ended, LeaseStatus.DONE)
    kept = await lease_store.renew(kept, TTL)
    clock.advance(2.0)

    answers = await lease_store.renew_many([kept, taken, lapsed, ended], 20.0)

    assert [type(a) for a in answers] == [Lease, ExecutionFencedError, Lease, ExecutionFencedError]
    for lease, answer in zip([kept, lapsed], [answers[0], answers[2]], strict=True):
        assert isinstance(answer, Lease)
        assert (answer.key, answer.epoch, answer.holder) == (lease.key, lease.epoch, "A")
        assert answer.expires_at == clock() + 20.0
        assert await lease_store.get(lease.key) == answer
    refused_taken, refused_ended = answers[1], answers[3]
    assert isinstance(refused_taken, ExecutionFencedError)
    assert (refused_taken.scope_key, refused_taken.token_held) == (taken.scope_key, 1)
    assert refused_taken.token_seen == 2
    assert isinstance(refused_ended, ExecutionFencedError)
    assert refused_ended.token_seen == 1  # same epoch, but done: not the hold any more
    # A refused renewal changed nothing.
    assert await lease_store.get(taken.key) == newer
    assert await lease_store.get(ended.key) == done


async def test_nothing_to_renew_is_no_statement(lease_store: ExecutionLeaseRepository) -> None:
    assert await lease_store.renew_many([], TTL) == []


async def test_refuses_what_it_cannot_renew_naming_the_argument(
    lease_store: ExecutionLeaseRepository,
) -> None:
    lease = await held(lease_store)
    with pytest.raises(ValueError, match=r"^leases holds execution .* twice"):
        await lease_store.renew_many([lease, lease], TTL)
    foreign = await held(MemoryLeaseRepository())
    with pytest.raises(ValueError, match="comes from another store"):
        await lease_store.renew_many([lease, foreign], TTL)
    with pytest.raises(ValueError, match=r"^leases must be a list"):
        await lease_store.renew_many(lease, TTL)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="ttl"):
        await lease_store.renew_many([lease], 0)


async def test_a_thousand_holds_renew_in_one_statement(
    lease_store: ExecutionLeaseRepository, clock: ManualClock
) -> None:
    leases = [await held(lease_store) for _ in range(1000)]
    clock.advance(1.0)
    statements: list[str] = []

    def count(_c: Any, _cur: Any, statement: str, *_: Any) -> None:
        statements.append(statement)

    # The store's engine, and the pool of its own its renewals go through on PostgreSQL.
    engines = []
    if isinstance(lease_store, SqlLeaseRepository):
        engines = [lease_store.engine]
        if lease_store._renewals.sync_engine.pool is not lease_store.engine.sync_engine.pool:
            engines.append(lease_store._renewals)
    for engine in engines:
        event.listen(engine.sync_engine, "before_cursor_execute", count)
    try:
        answers = await lease_store.renew_many(leases, TTL)
    finally:
        for engine in engines:
            event.remove(engine.sync_engine, "before_cursor_execute", count)
    assert all(isinstance(a, Lease) and a.expires_at == clock() + TTL for a in answers)
    assert [a.key for a in answers if isinstance(a, Lease)] == [lease.key for lease in leases]
    if isinstance(lease_store, SqlLeaseRepository):
        assert len(statements) == 1, statements


async def test_postgres_renews_many_on_its_own_clock_on_a_plain_engine(
    pg_schema: tuple[str, str],
) -> None:
    """The database's ``now()`` (no clock passed), and an engine the user made without
    ``create_engine`` (no autocommit): the renewals are committed, seen by another engine."""
    url, schema = pg_schema
    options = pg_engine_options(schema)
    plain = create_async_engine(normalize_url(url), **options)
    other = create_engine(url, **options)
    try:
        store = SqlLeaseRepository(plain)
        await store.setup()
        leases = [await held(store) for _ in range(3)]
        before = await store.now()
        answers = await store.renew_many(leases, 600.0)
        seen = SqlLeaseRepository(other)
        for answer in answers:
            assert isinstance(answer, Lease)
            assert answer.expires_at is not None
            assert before + 600.0 <= answer.expires_at <= await store.now() + 600.0
            stored = await seen.get(answer.key)
            assert stored is not None
            assert stored.expires_at == answer.expires_at
    finally:
        await plain.dispose()
        await other.dispose()

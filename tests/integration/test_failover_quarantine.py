"""The quarantine after a failover, on the shared PostgreSQL: the failover is the ledger put
back behind the server's timeline (what a promoted standby shows: the ledger row replicated
from the old primary, the server on a new timeline). The real promotion, with replication
cut and a takeover lost, is ``tests/chaos/test_failover.py``.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable

import pytest
from sqlalchemy import text
from sqlalchemy.ext.asyncio import AsyncEngine

from langgraph_fence import (
    Effect,
    EventKind,
    ExecutionFencedError,
    FenceEvent,
    Instance,
    LeaseKey,
    LeaseStatus,
    PendingEffect,
    SqlLeaseRepository,
)
from langgraph_fence.database import create_engine
from langgraph_fence.lease.timeline import token_parts
from tests.support.databases import pg_engine_options, unique

TTL = 60.0


@pytest.fixture
async def engine(own_schema: tuple[str, str]) -> AsyncIterator[AsyncEngine]:
    url, schema = own_schema
    made = create_engine(url, **pg_engine_options(schema))
    try:
        yield made
    finally:
        await made.dispose()


async def store_on(engine: AsyncEngine, **options: object) -> SqlLeaseRepository:
    store = SqlLeaseRepository(engine, **options)  # type: ignore[arg-type]
    await store.setup()
    return store


async def fail_over(engine: AsyncEngine) -> None:
    """The promoted server's view: executions last classified on an earlier timeline."""
    async with engine.connect() as conn:
        await conn.execute(text("UPDATE fence_timeline SET timeline = timeline - 1"))


Make = Callable[[str], LeaseKey]


async def every_state(store: SqlLeaseRepository) -> dict[str, LeaseKey]:
    """One execution in each state a failover can find: in flight (running, pending,
    yielded) and not (interrupted, done)."""
    keys = {name: LeaseKey(unique("t"), unique(name)) for name in
            ("running", "pending", "yielded", "interrupted", "done")}  # fmt: skip
    running = await store.acquire(keys["running"], "A", TTL)
    assert running is not None
    pending = await store.acquire(keys["pending"], "A", TTL)
    assert pending is not None
    await store.release(pending, LeaseStatus.PENDING)
    yielded = await store.acquire(keys["yielded"], "A", TTL)
    assert yielded is not None
    await store.yield_lease(yielded)
    for name, status in (("interrupted", LeaseStatus.WAITING), ("done", LeaseStatus.DONE)):
        lease = await store.acquire(keys[name], "A", TTL)
        assert lease is not None
        await store.release(lease, status)
    return keys


async def test_a_take_after_a_failover_dead_letters_every_execution_in_flight_first(
    engine: AsyncEngine,
) -> None:
    a = await store_on(engine)
    keys = await every_state(a)
    held = await a.get(keys["running"])
    assert held is not None
    await fail_over(engine)

    b = await store_on(engine)
    fresh = LeaseKey(unique("t"), unique("fresh"))
    taken = await b.acquire(fresh, "B", TTL)

    # The take landed, after B classified the failover's executions.
    assert taken is not None
    assert taken.holder == "B"
    [report] = b.failovers
    assert report.on_failover == "quarantine"
    assert report.timeline == report.previous + 1  # type: ignore[operator]
    assert {q.key for q in report.quarantined} == {
        keys["running"],
        keys["pending"],
        keys["yielded"],
    }
    for name in ("running", "pending", "yielded"):
        lease = await b.get(keys[name])
        assert lease is not None
        assert lease.status is LeaseStatus.DEAD_LETTERED, name
        assert lease.reason is not None
        assert "after a database failover" in lease.reason
        assert "resolve --retry" in lease.reason
    running = await b.get(keys["running"])
    assert running is not None
    assert running.epoch == held.epoch + 1
    assert "held by A at token 1" in (running.reason or "")
    for name, status in (("interrupted", LeaseStatus.WAITING), ("done", LeaseStatus.DONE)):
        lease = await b.get(keys[name])
        assert lease is not None
        assert lease.status is status, name
    # A, whose hold was in flight on the old primary, is fenced.
    with pytest.raises(ExecutionFencedError):
        await a.renew(held, TTL)
    # Settled once: the next check finds nothing to do.
    assert await b.settle_failover() is None
    assert await a.settle_failover() is None


async def test_no_stamp_lands_before_the_failover_is_classified(engine: AsyncEngine) -> None:
    a = await store_on(engine)
    key = LeaseKey(unique("t"), unique("charge"))
    lease = await a.acquire(key, "A", TTL)
    assert lease is not None
    await fail_over(engine)
    stamp = PendingEffect(Effect.NON_IDEMPOTENT_WRITE, "charge", "task-1", lease.epoch)

    # The holder may be the one whose takeover the failover lost: its write must not start.
    with pytest.raises(ExecutionFencedError):
        await a.mark_pending_effect(lease, stamp, TTL)
    report = await a.settle_failover()
    assert report is not None
    assert [q.key for q in report.quarantined] == [key]
    found = await a.get(key)
    assert found is not None
    assert found.pending_effects == ()


async def test_trust_moves_on_and_dead_letters_nothing(engine: AsyncEngine) -> None:
    a = await store_on(engine, on_failover="trust")
    keys = await every_state(a)
    held = await a.get(keys["running"])
    assert held is not None
    await fail_over(engine)

    # No take waits for a classification under trust.
    taken = await a.acquire(LeaseKey(unique("t"), unique("fresh")), "A", TTL)
    assert taken is not None
    assert a.failovers == []
    stamp = PendingEffect(Effect.NON_IDEMPOTENT_WRITE, "charge", "task-1", held.epoch)
    assert await a.mark_pending_effect(held, stamp, TTL)
    report = await a.settle_failover()
    assert report is not None
    assert report.on_failover == "trust"
    assert report.quarantined == ()
    assert (await a.get(keys["pending"])).status is LeaseStatus.PENDING  # type: ignore[union-attr]


async def test_instances_that_classify_at_once_classify_each_execution_once(
    engine: AsyncEngine,
) -> None:
    a = await store_on(engine)
    keys = await every_state(a)
    await fail_over(engine)
    stores = [await store_on(engine) for _ in range(4)]

    reports = await asyncio.gather(*(store.settle_failover() for store in stores))

    found = [report for report in reports if report is not None]
    assert len(found) == 1
    assert len(found[0].quarantined) == 3
    running = await a.get(keys["running"])
    assert running is not None
    assert running.epoch == 2


async def test_an_instance_classifies_at_open_and_tells_its_listeners_after(
    own_schema: tuple[str, str], engine: AsyncEngine
) -> None:
    url, schema = own_schema
    a = await store_on(engine)
    before = await every_state(a)
    await fail_over(engine)
    events: list[FenceEvent] = []

    async with Instance.open(url, schema=schema, journal=False) as instance:
        repository = instance.repository
        assert isinstance(repository, SqlLeaseRepository)
        # Opened on the promoted server: it classified before it took anything.
        [at_open] = repository.failovers
        assert len(at_open.quarantined) == 3
        assert {q.key for q in at_open.quarantined} == {
            before[name] for name in ("running", "pending", "yielded")
        }
        instance.add_listener(events.append)
        during = await every_state(repository)
        await fail_over(engine)  # a second failover, while it runs
        fresh = LeaseKey(unique("t"), unique("fresh"))
        assert await repository.acquire(fresh, instance.instance_id, TTL) is not None

    told = {event.scope_key: event for event in events if event.kind is EventKind.DEAD_LETTERED}
    assert set(told) == {during[name].scope_key for name in ("running", "pending", "yielded")}
    for event in told.values():
        assert event.reason is not None
        assert "after a database failover" in event.reason


async def test_on_failover_is_checked(own_schema: tuple[str, str], engine: AsyncEngine) -> None:
    with pytest.raises(ValueError, match=r"on_failover must be 'quarantine'.*'trust'"):
        SqlLeaseRepository(engine, on_failover="ignore")  # type: ignore[arg-type]
    url, schema = own_schema
    with pytest.raises(ValueError, match="on_failover"):
        async with Instance.open(url, schema=schema, on_failover="later"):  # type: ignore[arg-type]
            pass


def test_token_parts() -> None:
    assert token_parts(7) == (1, 7)
    assert token_parts(2**32 + 1) == (2, 1)
    assert token_parts(2 * 2**32 + 5) == (3, 5)
    with pytest.raises(ValueError, match="token"):
        token_parts(-1)

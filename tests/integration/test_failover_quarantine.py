"""The quarantine after a failover, store by store: a primary and a streaming standby of
the test's own (``tests/support/pg_replica.py``), the standby promoted after the executions
were set up, then the stores on the multi-host URL. The failover that loses a takeover is
``tests/chaos/test_failover.py``.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable

import pytest
import sqlalchemy as sa
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
from langgraph_fence.database.retry import retry_connection_errors
from langgraph_fence.lease.timeline import TIMELINE_SPAN, token_parts
from tests.support.databases import unique
from tests.support.pg_cluster import PgCluster, find_bindir
from tests.support.pg_replica import ReplicatedPair

pytestmark = pytest.mark.postgres

TTL = 60.0


class Failover:
    """The pair, and the engine on its multi-host URL."""

    def __init__(self, pair: ReplicatedPair) -> None:
        self.pair = pair
        self.url = pair.url
        self.engine = create_engine(pair.url)

    async def __call__(self) -> None:
        """The standby caught up, the primary killed, the standby promoted; the engine's
        connections to the dead primary dropped."""
        await asyncio.to_thread(self.pair.caught_up)
        await asyncio.to_thread(self.pair.fail_over)
        await self.engine.dispose()


@pytest.fixture
async def fail_over() -> AsyncIterator[Failover]:
    bindir = find_bindir()
    if bindir is None:
        pytest.skip("no PostgreSQL server binaries under /usr/lib/postgresql/*/bin")
    pair = await asyncio.to_thread(ReplicatedPair.create, bindir)
    made = Failover(pair)
    try:
        yield made
    finally:
        await made.engine.dispose()
        await asyncio.to_thread(pair.remove)


@pytest.fixture
def engine(fail_over: Failover) -> AsyncEngine:
    return fail_over.engine


async def store_on(engine: AsyncEngine, **options: object) -> SqlLeaseRepository:
    store = SqlLeaseRepository(engine, **options)  # type: ignore[arg-type]
    await store.setup()
    return store


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
    engine: AsyncEngine, fail_over: Failover
) -> None:
    a = await store_on(engine)
    keys = await every_state(a)
    held = await a.get(keys["running"])
    assert held is not None
    await fail_over()

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
    # Moved to the new timeline's first token: above any token the old one could issue.
    assert running.epoch == TIMELINE_SPAN + 1
    assert token_parts(running.epoch) == (2, 1)
    assert "held by A at token 1" in (running.reason or "")
    assert taken.epoch == TIMELINE_SPAN + 1
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


async def test_no_stamp_lands_before_the_failover_is_classified(
    engine: AsyncEngine, fail_over: Failover
) -> None:
    a = await store_on(engine)
    key = LeaseKey(unique("t"), unique("charge"))
    lease = await a.acquire(key, "A", TTL)
    assert lease is not None
    await fail_over()
    stamp = PendingEffect(Effect.NON_IDEMPOTENT_WRITE, "charge", "task-1", lease.epoch)

    # The holder may be the one whose takeover the failover lost: its write must not start.
    with pytest.raises(ExecutionFencedError, match="failover"):
        await a.mark_pending_effect(lease, stamp, TTL)
    # The refusal classified the failover: it names it, and the stamp never landed.
    [report] = a.failovers
    assert [q.key for q in report.quarantined] == [key]
    found = await a.get(key)
    assert found is not None
    assert found.pending_effects == ()


async def test_trust_moves_on_and_dead_letters_nothing(
    engine: AsyncEngine, fail_over: Failover
) -> None:
    a = await store_on(engine, on_failover="trust")
    keys = await every_state(a)
    held = await a.get(keys["running"])
    assert held is not None
    await fail_over()

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
    engine: AsyncEngine, fail_over: Failover
) -> None:
    a = await store_on(engine)
    keys = await every_state(a)
    await fail_over()
    stores = [await store_on(engine) for _ in range(4)]

    reports = await asyncio.gather(*(store.settle_failover() for store in stores))

    found = [report for report in reports if report is not None]
    assert len(found) == 1
    assert len(found[0].quarantined) == 3
    running = await a.get(keys["running"])
    assert running is not None
    assert running.epoch == TIMELINE_SPAN + 1  # moved on once, by one of them


async def test_an_instance_opened_after_a_failover_classifies_before_it_takes(
    engine: AsyncEngine, fail_over: Failover
) -> None:
    before = await every_state(await store_on(engine))
    await fail_over()

    async with Instance.open(fail_over.url, journal=False) as instance:
        repository = instance.repository
        assert isinstance(repository, SqlLeaseRepository)
        [at_open] = repository.failovers
    assert {q.key for q in at_open.quarantined} == {
        before[name] for name in ("running", "pending", "yielded")
    }


async def test_a_running_instance_tells_its_listeners_of_each_execution_quarantined(
    fail_over: Failover,
) -> None:
    events: list[FenceEvent] = []
    async with Instance.open(fail_over.url, journal=False) as instance:
        instance.add_listener(events.append)
        repository = instance.repository
        assert isinstance(repository, SqlLeaseRepository)
        during = await every_state(repository)
        await fail_over()
        # A submit between the promotion and the classification is new work: it is kept.
        submitted = LeaseKey(unique("t"), unique("submitted"))
        await instance.submit(
            "shop",
            {"order": 1},
            {"configurable": {"thread_id": submitted.execution_id}},
            tenant_id=submitted.tenant_id,
        )
        fresh = LeaseKey(unique("t"), unique("fresh"))
        # The instance's connections died with the primary: a take is not repeated by the
        # store (one that landed unheard would be refused), its caller takes again.
        taken = await retry_connection_errors(
            lambda: repository.acquire(fresh, instance.instance_id, TTL), what="test take"
        )
        assert taken is not None
        kept = await repository.get(submitted)

    told = {event.scope_key: event for event in events if event.kind is EventKind.DEAD_LETTERED}
    assert set(told) == {during[name].scope_key for name in ("running", "pending", "yielded")}
    for event in told.values():
        assert event.reason is not None
        assert "after a database failover (timeline 1 to 2)" in event.reason
    assert kept is not None
    assert kept.status is LeaseStatus.PENDING


async def test_on_failover_is_checked(own_schema: tuple[str, str]) -> None:
    url, schema = own_schema
    with pytest.raises(ValueError, match=r"on_failover must be 'quarantine'.*'trust'"):
        SqlLeaseRepository(create_engine(url), on_failover="ignore")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="on_failover"):
        async with Instance.open(url, schema=schema, on_failover="later"):  # type: ignore[arg-type]
            pass


def test_token_parts() -> None:
    assert token_parts(7) == (1, 7)
    assert token_parts(2**32 + 1) == (2, 1)
    assert token_parts(2 * 2**32 + 5) == (3, 5)
    with pytest.raises(ValueError, match="token"):
        token_parts(-1)


async def test_an_erasure_in_the_window_waits_for_the_classification(
    fail_over: Failover,
) -> None:
    async with Instance.open(fail_over.url, journal=False) as instance:
        repository = instance.repository
        assert isinstance(repository, SqlLeaseRepository)
        keys = await every_state(repository)
        await fail_over()
        # Erased (an admin's hold, given back done), it would end out of the
        # classification's way: the erasure classifies first.
        pending = keys["pending"]
        await retry_connection_errors(
            lambda: instance.checkpointer.adelete_thread(
                pending.execution_id, tenant_id=pending.tenant_id
            ),
            what="test erasure",
        )
        [report] = repository.failovers
        assert pending in {q.key for q in report.quarantined}
        assert keys["running"] in {q.key for q in report.quarantined}


async def test_a_cancel_in_the_window_waits_for_the_classification(fail_over: Failover) -> None:
    async with Instance.open(fail_over.url, journal=False) as instance:
        repository = instance.repository
        assert isinstance(repository, SqlLeaseRepository)
        keys = await every_state(repository)
        await fail_over()
        running = keys["running"]
        # Cancelled, it would end out of the classification's way, and new input would
        # take it up again: the cancel classifies first, and finds it dead-lettered.
        cancelled = await instance.get_run(
            running.execution_id, tenant_id=running.tenant_id
        ).cancel()
        assert cancelled is False
        lease = await repository.get(running)
        assert lease is not None
        assert lease.status is LeaseStatus.DEAD_LETTERED
        assert "after a database failover" in (lease.reason or "")


async def test_a_server_behind_its_ledger_is_a_new_lineage(own_schema: tuple[str, str]) -> None:
    """A ledger ahead of the server (a pg_upgrade or a restore into a new cluster resets
    the timeline; the rows come with their epochs): classified as a failover, and the
    tokens go on above every epoch of the table."""
    url, schema = own_schema
    engine = create_engine(url, schema=schema)
    try:
        store = await store_on(engine)
        restored = LeaseKey(unique("t"), unique("restored"))
        assert await store.acquire(restored, "A", TTL) is not None
        async with engine.connect() as conn:
            # The ledger and the rows of a cluster that had been promoted three times.
            await conn.execute(
                sa.text("UPDATE fence_timeline SET timeline = timeline + 3"),
            )
            await conn.execute(
                sa.text("UPDATE fence_leases SET epoch = :epoch WHERE execution_id = :e"),
                {"epoch": 3 * TIMELINE_SPAN + 7, "e": restored.execution_id},
            )
        fresh = await store.acquire(LeaseKey(unique("t"), unique("fresh")), "B", TTL)
        assert fresh is not None
        assert fresh.epoch == 4 * TIMELINE_SPAN + 1
        [report] = store.failovers
        assert report.timeline == 1
        assert report.previous == 4
        assert [(q.key, q.token) for q in report.quarantined] == [(restored, 4 * TIMELINE_SPAN + 1)]
    finally:
        await engine.dispose()


async def test_a_server_that_refuses_the_timeline_is_named_with_the_grant(
    pg_cluster: PgCluster,
) -> None:
    role = unique("app").replace("-", "_")
    pg_cluster.sql(f"CREATE ROLE {role} LOGIN")
    pg_cluster.sql("REVOKE EXECUTE ON FUNCTION pg_current_wal_lsn() FROM PUBLIC")
    engine = create_engine(f"postgresql://{role}@127.0.0.1:{pg_cluster.port}/postgres")
    try:
        with pytest.raises(RuntimeError, match=r"refused it: permission denied.*GRANT EXECUTE"):
            await SqlLeaseRepository(engine).setup()
    finally:
        await engine.dispose()
        pg_cluster.sql("GRANT EXECUTE ON FUNCTION pg_current_wal_lsn() TO PUBLIC")
        pg_cluster.sql(f"DROP ROLE {role}")


async def test_a_parent_spawns_no_child_before_the_classification(
    engine: AsyncEngine, fail_over: Failover
) -> None:
    """Children inserted while the classification runs would not be seen by it: a parent
    of the old primary spawns nothing until it ran, and nothing after (it is quarantined)."""
    from langgraph.checkpoint.serde.jsonplus import JsonPlusSerializer

    from langgraph_fence.queue import SubmittedRuns

    a = await store_on(engine)
    parent = await a.acquire(LeaseKey(unique("t"), unique("parent")), "A", TTL)
    assert parent is not None
    await fail_over()
    runs = SubmittedRuns(a, JsonPlusSerializer())
    child = LeaseKey(parent.key.tenant_id, unique("child"))
    inputs = runs.serialize_inputs({child.execution_id: {"n": 1}})

    spawned = await runs.submit_children(parent, "child", [(child, inputs[0])])

    assert spawned is None  # the parent no longer holds: nothing written
    assert await a.get(child) is None
    lease = await a.get(parent.key)
    assert lease is not None
    # Not settled by the spawn: classified by the next take or the watch.
    assert lease.status is LeaseStatus.RUNNING
    assert await a.settle_failover() is not None
    lease = await a.get(parent.key)
    assert lease is not None
    assert lease.status is LeaseStatus.DEAD_LETTERED

"""The takeover window: what a worker's look reads, and what it costs.

A look reads the first ``limit`` candidates, fair across tenants (each tenant's oldest
first, then each one's second, ...; within a round, the longest waiting first). Every
store picks that window in every shape (one tenant's backlog, fewer tenants than the
window, as many, more), and the SQL stores read it without reading the backlog behind it:
a queue of 2 000 runs must not cost every look of every worker a sort of 2 000 rows.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import pytest
from sqlalchemy import event, insert, text
from sqlalchemy.ext.asyncio import AsyncEngine

from langgraph_fence import LeaseKey, LeaseStatus
from langgraph_fence.lease.schema import HELD_BACK, LEASES
from langgraph_fence.lease.stores import MemoryLeaseRepository, SqlLeaseRepository
from langgraph_fence.testing import ManualClock
from tests.support.databases import SQL_BACKENDS
from tests.support.leases import Store

TTL = 10.0
LIMIT = 8


class Queue:
    """A lease store whose rows are the test's alone (a SQL store on a database of its own),
    on a clock of its own."""

    def __init__(self, store: Callable[[ManualClock], Store]) -> None:
        self.clock = ManualClock()
        self.store = store(self.clock)
        self.count = 0

    async def pending(self, tenant: str, runs: int = 1) -> None:
        """``runs`` executions of ``tenant`` handed back, one clock tick apart."""
        for _ in range(runs):
            self.count += 1
            lease = await self.store.acquire(LeaseKey(tenant, f"e{self.count:05d}"), "A", TTL)
            assert lease is not None
            await self.store.release(lease, LeaseStatus.PENDING)
            self.clock.advance(0.001)

    async def running(self, tenant: str, ttl: float) -> None:
        """An execution of ``tenant`` held for ``ttl`` from now."""
        self.count += 1
        key = LeaseKey(tenant, f"e{self.count:05d}")
        assert await self.store.acquire(key, "A", ttl) is not None

    async def window(self, limit: int = LIMIT) -> list[LeaseKey]:
        """The window, in claim order (by round, then by tenant)."""
        found = [c.key for c in await self.store.takeover_candidates(limit)]
        assert len(found) == len(set(found))
        return found


@pytest.fixture
def stores(backend: str, request: pytest.FixtureRequest) -> Callable[[ManualClock], Store]:
    """Makes the backend's store on a clock (a SQL store on a database of its own)."""
    if backend == "memory":
        return lambda clock: MemoryLeaseRepository(clock=clock)
    engine = request.getfixturevalue("fresh_engine")
    return lambda clock: SqlLeaseRepository(engine, clock=clock)


@pytest.fixture
async def queue(stores: Callable[[ManualClock], Store]) -> Queue:
    made = Queue(stores)
    if isinstance(made.store, SqlLeaseRepository):
        await made.store.setup()
    return made


async def test_one_tenant_s_backlog_leaves_room_for_another_s_run(queue: Queue) -> None:
    await queue.pending("burst", 30)
    await queue.pending("single")
    found = await queue.window()
    assert [k.tenant_id for k in found] == ["burst", "single"] + ["burst"] * (LIMIT - 2)


async def test_as_many_tenants_as_the_window_holds_each_one_s_oldest(queue: Queue) -> None:
    """With ``limit`` tenants waiting, the window is each one's oldest run and no second
    run of any; with one tenant fewer, a second run of the oldest fills the last place."""
    tenants = [f"t{i:02d}" for i in range(LIMIT)]
    for _ in range(3):
        for tenant in tenants:
            await queue.pending(tenant)
    found = await queue.window()
    assert sorted(k.tenant_id for k in found) == tenants

    fewer = await queue.window(LIMIT + 1)
    assert [k.tenant_id for k in fewer] == [*tenants, tenants[0]]


async def test_more_tenants_than_the_window_the_oldest_heads(queue: Queue) -> None:
    """Twelve tenants, room for eight: the eight whose oldest run waited longest."""
    tenants = [f"t{i:02d}" for i in range(12)]
    for tenant in reversed(tenants):  # t11 waits longest, t00 least
        await queue.pending(tenant, 2)
    found = await queue.window()
    assert [k.tenant_id for k in found] == tenants[-LIMIT:]


async def test_tenants_with_nothing_to_take_count_for_nothing(queue: Queue) -> None:
    """A tenant whose runs are all held still (or ended, or yielded) is not one of the
    window's tenants: it takes no place the others' second runs should have."""
    for i in range(6):
        await queue.running(f"busy{i}", ttl=100.0)
    for tenant in ("a", "b"):
        await queue.pending(tenant, 5)
    expired = "late"
    await queue.running(expired, ttl=1.0)
    queue.clock.advance(1.0)  # its hold ends exactly now: a candidate
    found = await queue.window()
    assert len(found) == LIMIT
    assert {k.tenant_id for k in found} == {"a", "b", expired}


@contextmanager
def sent(engine: AsyncEngine) -> Iterator[list[tuple[str, Any]]]:
    """The statements ``engine`` sends while the block runs, with their parameters."""
    seen: list[tuple[str, Any]] = []

    def record(conn: Any, cursor: Any, statement: str, parameters: Any, *_: Any) -> None:
        seen.append((statement, parameters))

    event.listen(engine.sync_engine, "before_cursor_execute", record)
    try:
        yield seen
    finally:
        event.remove(engine.sync_engine, "before_cursor_execute", record)


def _row(
    tenant: str,
    index: int,
    status: LeaseStatus,
    updated_at: float,
    expires_at: float | None = None,
) -> dict[str, Any]:
    execution_id = f"r{index:05d}"
    return {
        "tenant_id": tenant,
        "execution_id": execution_id,
        "scope_key": f"{tenant}:{execution_id}",
        "epoch": 1,
        "status": status.value,
        "pending_effects": {},
        "updated_at": updated_at,
        "expires_at": expires_at,
    }


def _burst_among_others(now: float) -> list[dict[str, Any]]:
    """One tenant's burst of 2 000 queued runs, ten other tenants with one each."""
    rows = [_row("deep", i, LeaseStatus.PENDING, now - 5000 + i) for i in range(2000)]
    return rows + [_row(f"t{t:02d}", 0, LeaseStatus.PENDING, now - 100) for t in range(10)]


def _more_tenants_than_the_window(now: float) -> list[dict[str, Any]]:
    """Forty tenants with twenty queued runs each: the window holds one run of 32 of them."""
    return [
        _row(f"t{t:02d}", i, LeaseStatus.PENDING, now - 5000 + i * 40 + t)
        for t in range(40)
        for i in range(20)
    ]


def _held_back_before_the_others(now: float) -> list[dict[str, Any]]:
    """Forty tenants with twenty queued runs each, after a tenant whose 25 000 runs a flow
    key holds back (none due: the walk passes them)."""
    held = [_row("held", i, LeaseStatus.PENDING, now, expires_at=HELD_BACK) for i in range(25000)]
    return _more_tenants_than_the_window(now) + held


@pytest.mark.parametrize("backend", SQL_BACKENDS, indirect=True)
@pytest.mark.parametrize(
    "shape", [_burst_among_others, _more_tenants_than_the_window, _held_back_before_the_others]
)
async def test_a_look_reads_its_window_not_the_backlog(
    queue: Queue,
    fresh_engine: AsyncEngine,
    backend: str,
    shape: Callable[[float], list[dict[str, Any]]],
) -> None:
    """Behind the queued runs, 20 000 ended ones: the read of a 32-run window reads about
    32 rows from the index that holds each tenant's runs in order, never a tenant's whole
    backlog, nor the ended rows, nor more than one row of each tenant when 32 tenants wait.
    Checked on the database's own plan of the statement the store sends, with its
    parameters bound (PostgreSQL's custom plan), before and after the planner has
    statistics (langgraph-fence never analyses a SQLite database)."""
    now = queue.clock()
    ended = [_row(f"t{i % 50:02d}", 100 + i, LeaseStatus.DONE, now - 1e5 + i) for i in range(20000)]
    queued = shape(now)
    async with fresh_engine.begin() as conn:
        for rows in (ended, queued):
            for start in range(0, len(rows), 10000):
                await conn.execute(insert(LEASES), rows[start : start + 10000])
    due = [row for row in queued if row["expires_at"] is None]
    expected = sorted(due, key=lambda row: (row["updated_at"], row["scope_key"]))
    tenants = {row["tenant_id"] for row in due}
    for analysed in (False, True):
        if analysed:
            async with fresh_engine.begin() as conn:
                await conn.execute(text("ANALYZE"))
        with sent(fresh_engine) as statements:
            found = await queue.store.takeover_candidates(32)
        assert len(found) == 32
        if shape is not _burst_among_others:
            assert {c.key.execution_id for c in found} == {"r00000"}
            assert {c.key.tenant_id for c in found} == {r["tenant_id"] for r in expected[:32]}
        # The read, among whatever else the connection sent (SQLite's reader sets itself up).
        [(statement, parameters)] = [sent for sent in statements if "fence_leases" in sent[0]]
        async with fresh_engine.connect() as conn:
            if backend == "sqlite":
                await _reads_the_index(conn, statement, parameters)
            elif analysed:
                explain = "EXPLAIN (ANALYZE, FORMAT JSON) " + statement
                [[document]] = (await conn.exec_driver_sql(explain, parameters)).all()
                plan = document if isinstance(document, list) else json.loads(document)
                # A row or two per place in the window and per tenant waiting (the walk
                # visits each; the window's row numbers look one row ahead).
                read = max(_rows_read(plan[0]["Plan"]))
                assert read <= 2 * (32 + len(tenants)), json.dumps(plan, indent=1)


async def _reads_the_index(conn: Any, statement: str, parameters: Any) -> None:
    """SQLite's plan of the read: every read of the lease table goes through the index of
    the window (or, for the rows picked, their rowid); nothing scans the table."""
    plan = (await conn.exec_driver_sql("EXPLAIN QUERY PLAN " + statement, parameters)).all()
    steps = [row[-1] for row in plan]
    for step in steps:
        words = step.split()
        if words[0] == "SCAN":
            read_in_order = "USING INDEX fence_leases_takeable" in step  # the walk's start
            derived = words[1] in ("tenants", "ranked", "CONSTANT") or "subquery" in words[1]
            assert read_in_order or derived, steps
        if words[0] == "SEARCH":
            if words[1] == "lease":
                assert "INTEGER PRIMARY KEY (rowid=?)" in step, steps
            else:
                assert "INDEX fence_leases_takeable" in step, steps
    assert sum("fence_leases_takeable" in step for step in steps) == 3, steps


def _rows_read(node: dict[str, Any]) -> Iterator[int]:
    """Each plan node's rows, over all its loops, and what its filter removed."""
    loops = node.get("Actual Loops", 1)
    yield (node["Actual Rows"] + node.get("Rows Removed by Filter", 0)) * loops
    for child in node.get("Plans", ()):
        yield from _rows_read(child)


@pytest.mark.parametrize("backend", ["postgresql"], indirect=True)
async def test_a_look_is_not_planned_again_at_each_read(fresh_engine: AsyncEngine) -> None:
    """On the database's clock (the PostgreSQL default), a worker's reads of its window reuse
    one plan per connection from the first read on. With the window's size bound, the
    planner made a plan for each of the first five reads, and, on some queues (one tenant's
    backlog beside its running leases), for every read: 0.25 ms of the server's CPU per
    look, where the read itself takes a tenth of that."""
    store = SqlLeaseRepository(fresh_engine)
    await store.setup()
    now = await store.now()
    async with fresh_engine.begin() as conn:
        await conn.execute(insert(LEASES), _burst_among_others(now))
        await conn.execute(text("ANALYZE"))
    for _ in range(12):
        assert len(await store.takeover_candidates(32)) == 32
    assert fresh_engine.pool.checkedin() == 1  # type: ignore[attr-defined]  # one connection read
    async with fresh_engine.connect() as conn:
        plans = (
            await conn.execute(
                text(
                    "SELECT generic_plans, custom_plans FROM pg_prepared_statements "
                    "WHERE statement LIKE 'WITH RECURSIVE tenants%'"
                )
            )
        ).all()
    assert [tuple(row) for row in plans] == [(12, 0)]


@pytest.mark.parametrize("backend", ["postgresql"], indirect=True)
async def test_windows_of_any_size_share_a_few_statements(
    queue: Queue, fresh_engine: AsyncEngine
) -> None:
    """A worker's window follows its free slots and the backlog of graphs it does not serve,
    so it takes any size; on PostgreSQL each statement the read sends is prepared on every
    connection. 150 sizes send seven statements, and each window is the first runs of a
    larger one."""
    async with fresh_engine.begin() as conn:
        await conn.execute(insert(LEASES), _more_tenants_than_the_window(queue.clock()))
    largest = {c.key for c in await queue.store.takeover_candidates(800)}
    with sent(fresh_engine) as statements:
        for limit in range(1, 151):
            window = await queue.store.takeover_candidates(limit)
            assert len(window) == limit
            assert {c.key for c in window} <= largest
    texts = {statement for statement, _ in statements if "fence_leases" in statement}
    assert len(texts) == 7  # 4, 8, 16, 32, 64, 128 and 256 runs

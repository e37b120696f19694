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
from langgraph_fence.lease.schema import LEASES
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


@pytest.mark.parametrize("backend", SQL_BACKENDS, indirect=True)
async def test_a_look_reads_its_window_not_the_backlog(
    queue: Queue, fresh_engine: AsyncEngine, backend: str
) -> None:
    """2 000 runs of one tenant wait: the read of a 32-run window reads about 32 rows from
    the index that holds them in order, never the whole backlog (the database's own plan
    of the statement the store sends, executed)."""
    now = queue.clock()
    rows = [
        {
            "tenant_id": "deep",
            "execution_id": f"r{i:05d}",
            "scope_key": f"deep:r{i:05d}",
            "epoch": 1,
            "status": LeaseStatus.PENDING.value,
            "pending_effects": {},
            "updated_at": now - 2000 + i,
        }
        for i in range(2000)
    ]
    async with fresh_engine.begin() as conn:
        await conn.execute(insert(LEASES), rows)
        await conn.execute(text("ANALYZE"))
    with sent(fresh_engine) as statements:
        found = await queue.store.takeover_candidates(32)
    assert [c.key.execution_id for c in found] == [f"r{i:05d}" for i in range(32)]
    # The read, among whatever else the connection sent (SQLite's reader sets itself up).
    [(statement, parameters)] = [sent for sent in statements if "fence_leases" in sent[0]]

    async with fresh_engine.connect() as conn:
        if backend == "sqlite":
            plan = (await conn.exec_driver_sql("EXPLAIN QUERY PLAN " + statement, parameters)).all()
            steps = [row[-1] for row in plan]
            assert not [s for s in steps if s.startswith("SCAN") and "fence_leases" in s], steps
            assert any("USING INDEX fence_leases_takeable" in s for s in steps), steps
        else:
            explain = "EXPLAIN (ANALYZE, FORMAT JSON) " + statement
            [[document]] = (await conn.exec_driver_sql(explain, parameters)).all()
            plan = document if isinstance(document, list) else json.loads(document)
            read = max(_rows_read(plan[0]["Plan"]))
            assert read <= 2 * 32, plan


def _rows_read(node: dict[str, Any]) -> Iterator[int]:
    """Each plan node's rows, over all its loops, and what its filter removed."""
    loops = node.get("Actual Loops", 1)
    yield (node["Actual Rows"] + node.get("Rows Removed by Filter", 0)) * loops
    for child in node.get("Plans", ()):
        yield from _rows_read(child)

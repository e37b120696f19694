"""The lease table's migrations keep what a live execution depends on.

Version 3 moved the single pending-effect stamp (four columns) into the stamp set: a lease
stamped before the upgrade must still dead-letter its takeover afterwards, with the same
node and token named.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from typing import Any

import pytest
from sqlalchemy import CheckConstraint, inspect, text
from sqlalchemy.ext.asyncio import AsyncEngine

from langgraph_fence import Effect, LeaseKey, LeaseStatus, PendingEffect, SqlLeaseRepository
from langgraph_fence.database.migrations import migrate
from langgraph_fence.lease.schema import LEASE_MIGRATIONS, LEASES
from langgraph_fence.testing import ManualClock
from tests.support.databases import SQL_BACKENDS

RUNS_ON = SQL_BACKENDS
TTL = 10.0


async def old_stamped_lease(engine: AsyncEngine, key: LeaseKey, clock: Callable[[], float]) -> None:
    """A lease held at epoch 1 with a non-idempotent stamp, as version 2 stored it."""
    await migrate(engine, "leases", LEASE_MIGRATIONS[:2])
    async with engine.begin() as conn:
        await conn.execute(
            text(
                "INSERT INTO fence_leases (tenant_id, execution_id, scope_key, epoch, holder,"
                " expires_at, status, pending_effect, pending_node, pending_task,"
                " pending_token, updated_at) VALUES (:t, :e, :s, 1, 'A', :x, 'running',"
                " 'non_idempotent_write', 'charge', 'task-1', 1, :now)"
            ),
            {
                "t": key.tenant_id,
                "e": key.execution_id,
                "s": key.scope_key,
                "x": clock() + TTL,
                "now": clock(),
            },
        )


async def test_an_old_stamp_survives_the_move_to_the_stamp_set(fresh_engine: AsyncEngine) -> None:
    clock = ManualClock()
    key = LeaseKey("acme", "order-42")
    await old_stamped_lease(fresh_engine, key, clock)
    store = SqlLeaseRepository(fresh_engine, clock=clock)
    await store.setup()  # version 3
    lease = await store.get(key)
    assert lease is not None
    assert lease.pending_effects == (
        PendingEffect(Effect.NON_IDEMPOTENT_WRITE, "charge", "task-1", 1),
    )
    clock.advance(TTL)
    decided = await store.take_over(lease, "B", TTL)
    assert decided is not None
    assert decided.status is LeaseStatus.DEAD_LETTERED
    assert decided.reason is not None
    assert "node 'charge' at token 1" in decided.reason


async def test_an_unstamped_old_lease_has_an_empty_set(fresh_engine: AsyncEngine) -> None:
    clock = ManualClock()
    await migrate(fresh_engine, "leases", LEASE_MIGRATIONS[:2])
    async with fresh_engine.begin() as conn:
        await conn.execute(
            text(
                "INSERT INTO fence_leases (tenant_id, execution_id, scope_key, epoch, holder,"
                " expires_at, status, updated_at) VALUES ('t', 'e', 't:e', 3, NULL, NULL,"
                " 'done', 0)"
            )
        )
    store = SqlLeaseRepository(fresh_engine, clock=clock)
    await store.setup()
    lease = await store.get(LeaseKey("t", "e"))
    assert lease is not None
    assert lease.pending_effects == ()
    assert lease.epoch == 3


async def test_the_migrated_table_is_the_table_the_queries_are_built_from(
    fresh_engine: AsyncEngine,
) -> None:
    """``LEASES`` (what every query is built from) and the migrations (what a database gets)
    describe one table: same columns, nullability, primary key, and checks."""
    await SqlLeaseRepository(fresh_engine).setup()

    def reflect(conn: Any) -> dict[str, Any]:
        inspector = inspect(conn)
        return {
            "columns": {c["name"]: c["nullable"] for c in inspector.get_columns("fence_leases")},
            "key": inspector.get_pk_constraint("fence_leases")["constrained_columns"],
            "checks": checks_of(conn, inspector),
        }

    def checks_of(conn: Any, inspector: Any) -> list[str]:
        if conn.dialect.name != "sqlite":
            return [c["sqltext"] for c in inspector.get_check_constraints("fence_leases")]
        # SQLAlchemy 2.0.43 (our lowest bound) misses a CHECK that spans lines in SQLite's
        # reflection, which newer releases find:
        # read every CHECK (...) of the stored CREATE TABLE itself.
        ddl = conn.exec_driver_sql(
            "SELECT sql FROM sqlite_master WHERE type = 'table' AND name = 'fence_leases'"
        ).scalar_one()
        found = []
        for start in [m.end() for m in re.finditer(r"CHECK\s*\(", ddl)]:
            depth, end = 1, start
            while depth:
                depth += {"(": 1, ")": -1}.get(ddl[end], 0)
                end += 1
            found.append(ddl[start : end - 1])
        return found

    async with fresh_engine.connect() as conn:
        stored = await conn.run_sync(reflect)
    assert stored["columns"] == {c.name: c.nullable for c in LEASES.columns}
    assert stored["key"] == [c.name for c in LEASES.primary_key.columns]
    declared = [
        str(check.sqltext)
        for column in LEASES.columns
        for check in column.constraints
        if isinstance(check, CheckConstraint)
    ]

    # Each dialect prints a check back in its own way ("status = ANY (ARRAY['pending'::text,
    # ...])"): compare what each one tests, its column and its literals.
    def tested(check: str) -> tuple[str, tuple[str, ...], tuple[str, ...]]:
        column = re.findall(r"\b(epoch|status)\b", check)[0]
        return (
            column,
            tuple(sorted(re.findall(r"'([^']*)'", check))),
            tuple(re.findall(r"\d+", check)),
        )

    assert sorted(map(tested, stored["checks"])) == sorted(map(tested, declared))
    statuses = {s.value for s in LeaseStatus}
    status_check = next(c for c in declared if c.startswith("status IN"))
    assert set(re.findall(r"'([^']*)'", status_check)) == statuses, (
        "the status check must allow exactly the LeaseStatus values"
    )


async def test_children_spawned_before_version_5_keep_their_parent(
    fresh_engine: AsyncEngine, caplog: pytest.LogCaptureFixture
) -> None:
    """Child ids were ``scope_key(tenant, parent, key)`` before version 5: those rows get
    their parent recorded, so a cancel or a wake of the parent reaches them as before;
    nothing else gets one. A parent still in flight is named in a warning."""
    await migrate(fresh_engine, "leases", LEASE_MIGRATIONS[:4])
    rows = {
        "order-42": None,  # the parent
        "acme:order-42:c0": "order-42",  # its child, spawned under the old rule
        "acme:gone:c0": None,  # no row of that parent
        "beta:order-42:c0": None,  # another tenant's shape
        "acme:order-42": None,  # two parts: no child
        "acme:order 42:c0": None,  # not a scope key (unencoded)
    }
    async with fresh_engine.begin() as conn:
        for execution_id in rows:
            await conn.execute(
                text(
                    "INSERT INTO fence_leases (tenant_id, execution_id, scope_key, epoch,"
                    " status, pending_effects, updated_at) VALUES ('acme', :e, :s, 0,"
                    " 'pending', '{}', 0)"
                ),
                {"e": execution_id, "s": LeaseKey("acme", execution_id).scope_key},
            )
    await SqlLeaseRepository(fresh_engine).setup()
    async with fresh_engine.connect() as conn:
        found = await conn.execute(
            text("SELECT execution_id, parent_execution_id FROM fence_leases")
        )
        assert {row.execution_id: row.parent_execution_id for row in found} == rows
    (warning,) = [r.getMessage() for r in caplog.records if r.name == "langgraph_fence.schema"]
    assert "1 execution(s) in flight" in warning
    assert "(acme:order-42)" in warning


async def test_version_6_keeps_every_row_and_index_and_allows_cancelled(
    fresh_engine: AsyncEngine,
) -> None:
    """Version 6 (``cancelled``) rebuilds SQLite's table and swaps PostgreSQL's check: every
    row of version 5 stays as it was (stamps, budget, parent), the indexes the takes and
    the children's reads use are there, and a row may end ``cancelled``; an unknown status
    is still refused."""
    await migrate(fresh_engine, "leases", LEASE_MIGRATIONS[:5])
    columns = (
        "tenant_id, execution_id, scope_key, epoch, holder, expires_at, status, reason, "
        "updated_at, pending_effects, takeovers, progress_mark, parent_execution_id"
    )
    stamp = '{"t1": {"effect": "non_idempotent_write", "node": "charge", "token": 3}}'
    before = [
        ("acme", "p", "acme:p", 3, "A", 12.5, "running", None, 1.0, stamp, 2, "ck-1", None),
        ("acme", "c", "acme:c", 0, None, None, "pending", "r", 2.0, "{}", 0, None, "p"),
    ]
    select = text(f"SELECT {columns} FROM fence_leases ORDER BY execution_id")
    async with fresh_engine.begin() as conn:
        names = columns.split(", ")
        insert = text(
            f"INSERT INTO fence_leases ({columns}) VALUES ("
            + ", ".join(f":{n}" for n in names)
            + ")"
        )
        for row in before:
            await conn.execute(insert, dict(zip(names, row, strict=True)))
        kept = [tuple(r) for r in await conn.execute(select)]

    await migrate(fresh_engine, "leases", LEASE_MIGRATIONS[:6])

    async with fresh_engine.begin() as conn:
        assert [tuple(r) for r in await conn.execute(select)] == kept
        assert {"fence_leases_candidates", "fence_leases_parent"} <= await indexes(conn)
        ended = "UPDATE fence_leases SET status = :s WHERE execution_id = 'c'"
        await conn.execute(text(ended), {"s": "cancelled"})
    with pytest.raises(Exception, match=r"(?i)check"):
        async with fresh_engine.begin() as conn:
            await conn.execute(text(ended), {"s": "paused"})


async def indexes(conn: Any) -> set[str]:
    """The names of ``fence_leases``'s indexes, expression indexes too (SQLAlchemy's
    inspector skips those)."""
    if conn.dialect.name == "sqlite":
        found = "SELECT name FROM sqlite_master WHERE type = 'index' AND tbl_name = 'fence_leases'"
    else:
        found = (
            "SELECT indexname FROM pg_indexes WHERE tablename = 'fence_leases' "
            "AND schemaname = current_schema()"
        )
    return {name for (name,) in await conn.execute(text(found))}


async def test_version_10_indexes_the_takeover_window_in_place_of_the_old_index(
    fresh_engine: AsyncEngine,
) -> None:
    """Version 10 adds the index a look reads its window from and drops the one no
    statement reads any more; the rows stay as they were and are found by the new read."""
    await migrate(fresh_engine, "leases", LEASE_MIGRATIONS[:9])
    async with fresh_engine.begin() as conn:
        await conn.execute(
            text(
                "INSERT INTO fence_leases (tenant_id, execution_id, scope_key, epoch, status, "
                "updated_at) VALUES ('acme', 'queued', 'acme:queued', 0, 'pending', 1.0)"
            )
        )
        before = await indexes(conn)
    assert "fence_leases_candidates" in before
    assert "fence_leases_takeable" not in before

    store = SqlLeaseRepository(fresh_engine, clock=ManualClock())
    await store.setup()
    async with fresh_engine.begin() as conn:
        after = await indexes(conn)
    assert after == before - {"fence_leases_candidates"} | {"fence_leases_takeable"}
    [candidate] = await store.takeover_candidates()
    assert candidate.key == LeaseKey("acme", "queued")

"""``langgraph-fence resolve --retry | --abandon``, ``executions --json`` and ``worker
--max-takeovers``, run in processes of their own as an operator runs them, on SQLite and
PostgreSQL."""

from __future__ import annotations

import json
import time
from collections.abc import AsyncIterator
from pathlib import Path

import pytest
from sqlalchemy.ext.asyncio import AsyncEngine

from langgraph_fence import Effect, LeaseKey, LeaseStatus, PendingEffect, SqlLeaseRepository
from langgraph_fence.database import create_engine
from langgraph_fence.testing import ManualClock
from tests.support.cli import cli, schema_args
from tests.support.databases import Database, pg_engine_options, unique

#: The CLI or Python run in processes of their own (CI's lowest run leaves them to the newest).
pytestmark = pytest.mark.processes

TTL = 10.0


@pytest.fixture
async def engine(database: Database) -> AsyncIterator[AsyncEngine]:
    options = pg_engine_options(database.schema) if database.schema else {}
    made = create_engine(database.url, **options)
    yield made
    await made.dispose()


async def test_resolve_retry_makes_a_dead_letter_pending_with_its_budget_reset(
    database: Database, engine: AsyncEngine
) -> None:
    url, schema = database.url, database.schema
    clock = ManualClock()
    repo = SqlLeaseRepository(engine, clock=clock)
    await repo.setup()
    key = LeaseKey(unique("t"), unique("e"))
    lease = await repo.acquire(key, "w0", TTL)
    for n in range(1, 5):  # three takeovers resume it, the fourth dead-letters it
        assert lease is not None
        clock.advance(TTL)
        lease = await repo.take_over(lease, f"w{n}", TTL, max_takeovers=3)
    assert lease is not None
    assert lease.status is LeaseStatus.DEAD_LETTERED

    args = ["--tenant", key.tenant_id, "--execution", key.execution_id, *schema_args(schema)]
    done = cli("resolve", "--db", url, *args, "--retry")
    assert done.returncode == 0, done.stdout + done.stderr
    assert "pending again" in done.stdout
    assert "budget reset" in done.stdout
    retried = await repo.get(key)
    assert retried is not None
    assert (retried.status, retried.takeovers, retried.reason, retried.epoch) == (
        LeaseStatus.PENDING,
        0,
        None,
        lease.epoch,
    )

    again = cli("resolve", "--db", url, *args, "--retry")  # pending now: refused
    assert again.returncode == 2
    assert "not dead_lettered" in again.stderr
    unknown = cli(
        "resolve", "--db", url, "--tenant", key.tenant_id, "--execution", "nope",
        *schema_args(schema), "--retry",
    )  # fmt: skip
    assert unknown.returncode == 2
    assert "no execution 'nope'" in unknown.stderr


async def test_resolve_abandon_ends_a_dead_letter_failed_with_the_operators_reason(
    database: Database, engine: AsyncEngine
) -> None:
    url, schema = database.url, database.schema
    clock = ManualClock()
    repo = SqlLeaseRepository(engine, clock=clock)
    await repo.setup()
    key = LeaseKey(unique("t"), unique("e"))
    lease = await repo.acquire(key, "w0", TTL)
    assert lease is not None
    stamp = PendingEffect(Effect.NON_IDEMPOTENT_WRITE, "charge", "task-1", lease.epoch)
    lease = await repo.mark_pending_effect(lease, stamp, TTL)
    clock.advance(TTL)
    dead = await repo.take_over(lease, "w1", TTL)
    assert dead is not None
    assert dead.status is LeaseStatus.DEAD_LETTERED
    # A retry would repeat the charge: refused, pointing at the way out.
    retried = cli("resolve", key.scope_key, "--db", url, *schema_args(schema), "--retry")
    assert retried.returncode == 2
    assert "node 'charge' at token 1" in retried.stderr

    done = cli(
        "resolve", key.scope_key, "--db", url, *schema_args(schema),
        "--abandon", "--reason", "charge refunded by ana (ticket 42)",
    )  # fmt: skip
    assert done.returncode == 0, done.stdout + done.stderr
    assert f"execution {key.scope_key} is failed at token {dead.epoch}" in done.stdout
    abandoned = await repo.get(key)
    assert abandoned is not None
    assert (abandoned.status, abandoned.reason, abandoned.epoch) == (
        LeaseStatus.FAILED,
        "abandoned by operator: charge refunded by ana (ticket 42)",
        dead.epoch,
    )
    assert abandoned.pending_effects == ()

    again = cli(
        "resolve", key.scope_key, "--db", url, *schema_args(schema),
        "--abandon", "--reason", "twice",
    )  # fmt: skip
    assert again.returncode == 2
    assert "is failed, not dead_lettered" in again.stderr
    assert (await repo.get(key)) == abandoned


async def test_executions_json_lists_what_an_operator_decides_on(
    database: Database, engine: AsyncEngine
) -> None:
    url, schema = database.url, database.schema
    tenant = unique("t")
    # Written in the store's clock a minute back: on SQLite the store's clock is this
    # machine's; on PostgreSQL the listing reads now() and the leases carry this clock.
    clock = ManualClock(time.time() - 60.0)
    repo = SqlLeaseRepository(engine, clock=clock)
    await repo.setup()
    live = await repo.acquire(LeaseKey(tenant, "live"), "w-live", 600.0)
    stale = await repo.acquire(LeaseKey(tenant, "stale/1"), "w-stale", 48.0)
    assert live is not None
    assert stale is not None
    stamp = PendingEffect(Effect.NON_IDEMPOTENT_WRITE, "charge", "task-1", stale.epoch)
    await repo.mark_pending_effect(stale, stamp, 48.0)

    done = cli("executions", "--db", url, *schema_args(schema), "--tenant", tenant, "--json")
    assert done.returncode == 0, done.stderr
    listed = {entry["execution_id"]: entry for entry in json.loads(done.stdout)}
    assert set(listed) == {"live", "stale/1"}
    entry = listed["stale/1"]
    assert {k: entry[k] for k in ("scope_key", "tenant_id", "status", "holder", "epoch")} == {
        "scope_key": f"{tenant}:stale%2F1",
        "tenant_id": tenant,
        "status": "running",
        "holder": "w-stale",
        "epoch": 1,
    }
    assert entry["pending_effects"] == [
        {"effect": "non_idempotent_write", "node": "charge", "key": "task-1", "token": 1}
    ]
    assert entry["reason"] is None
    assert entry["takeovers"] == 0
    # Expired about 12 s ago (its holder is dead); the live one has about 9 minutes left.
    assert -40.0 < entry["expires_in"] < -5.0
    assert 480.0 < listed["live"]["expires_in"] < 545.0

    table = cli("executions", "--db", url, *schema_args(schema), "--tenant", tenant)
    assert table.returncode == 0, table.stderr
    assert f"{tenant}:stale%2F1" in table.stdout
    assert "expired" in table.stdout
    assert "s ago" in table.stdout
    assert "non_idempotent_write @ charge (token 1)" in table.stdout


def test_resolve_needs_an_action(tmp_path: Path) -> None:
    done = cli("resolve", "--db", f"sqlite+aiosqlite:///{tmp_path}/x.db", "--tenant", "t",
               "--execution", "e")  # fmt: skip
    assert done.returncode == 2
    assert "--retry" in done.stderr


@pytest.mark.parametrize("bad", ["0", "-2"])
def test_a_worker_refuses_a_budget_below_one(tmp_path: Path, bad: str) -> None:
    done = cli(
        "worker",
        "--db",
        f"sqlite+aiosqlite:///{tmp_path}/w.db",
        "--graphs",
        "tests.support.chaos_graphs:poison_graphs",
        "--max-takeovers",
        bad,
    )
    assert done.returncode == 2, done.stdout + done.stderr
    assert "argument --max-takeovers: expected a whole number >= 1" in done.stderr

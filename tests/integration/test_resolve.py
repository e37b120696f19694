"""``langgraph-fence resolve --retry`` and ``worker --max-takeovers``, run in processes of
their own as an operator runs them, on SQLite and PostgreSQL."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from langgraph_fence import LeaseKey, LeaseStatus, SqlLeaseRepository
from langgraph_fence.database import create_engine
from langgraph_fence.testing import ManualClock
from tests.conftest import pg_engine_options, unique

ROOT = Path(__file__).parents[2]
TTL = 10.0


@pytest.fixture(params=["sqlite", "postgresql"])
def database(request: pytest.FixtureRequest, tmp_path: Path) -> tuple[str, str]:
    """``(url, schema)``; schema empty on SQLite."""
    if request.param == "sqlite":
        return f"sqlite+aiosqlite:///{tmp_path / 'fence.db'}", ""
    url, schema = request.getfixturevalue("pg_schema")
    return url, schema


def cli(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "langgraph_fence.cli", *args],
        capture_output=True,
        text=True,
        timeout=60,
        cwd=ROOT,
        env={**os.environ, "COLUMNS": "200"},
    )


def schema_args(schema: str) -> list[str]:
    return ["--schema", schema] if schema else []


async def test_resolve_retry_makes_a_dead_letter_pending_with_its_budget_reset(
    database: tuple[str, str],
) -> None:
    url, schema = database
    engine = create_engine(url, **(pg_engine_options(schema) if schema else {}))
    clock = ManualClock()
    try:
        repo = SqlLeaseRepository(engine, clock=clock)
        await repo.setup()
        key = LeaseKey(unique("t"), unique("e"))
        lease = await repo.acquire(key, "w0", TTL)
        for n in range(1, 5):  # three takeovers resume it, the fourth dead-letters it
            assert lease is not None
            clock.advance(TTL)
            lease = await repo.take_over(lease, f"w{n}", TTL, max_takeovers=3)
        assert lease is not None and lease.status is LeaseStatus.DEAD_LETTERED

        args = ["--tenant", key.tenant_id, "--execution", key.execution_id, *schema_args(schema)]
        done = cli("resolve", "--db", url, *args, "--retry")
        assert done.returncode == 0, done.stdout + done.stderr
        assert "pending again" in done.stdout and "budget reset" in done.stdout
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
    finally:
        await engine.dispose()


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
        "tests.chaos.chaos_graphs:poison_graphs",
        "--max-takeovers",
        bad,
    )
    assert done.returncode == 2, done.stdout + done.stderr
    assert "argument --max-takeovers: expected a whole number >= 1" in done.stderr

"""Issue 32, item 11: on SQLite a process frozen inside a write transaction holds the
file's only write lock, and what frees it (documented in docs/guarantees.md,
"What is not built yet").

A real process opens a write transaction on the lease file and is frozen (SIGSTOP), as a
worker paused mid-checkpoint would be. Every writer of the file then waits out the busy
timeout and fails ("database is locked"): a takeover of an expired execution too. Killing
the frozen process (SIGKILL: its transaction rolls back) frees the lock, and the next
takeover lands. The busy timeout is shortened for the test (30 s in the product).
"""

from __future__ import annotations

import asyncio
import os
import signal
import sqlite3
import sys
from asyncio.subprocess import PIPE
from pathlib import Path

import pytest
from sqlalchemy.exc import OperationalError

import langgraph_fence.database as database_module
from langgraph_fence import LeaseKey, LeaseStatus, SqlLeaseRepository
from langgraph_fence.database import create_engine
from langgraph_fence.testing import ManualClock

pytestmark = [pytest.mark.chaos]

HOLD = """
import sqlite3, sys
conn = sqlite3.connect(sys.argv[1], isolation_level=None)
conn.execute("BEGIN IMMEDIATE")  # the write lock, as a checkpoint's transaction takes it
conn.execute("UPDATE fence_leases SET updated_at = updated_at")
print("holding", flush=True)
sys.stdin.read()  # until killed
"""


async def test_a_frozen_sqlite_writer_blocks_the_takeover_until_it_is_killed(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(database_module, "SQLITE_BUSY_TIMEOUT_MS", 300)
    path = tmp_path / "fence.db"
    engine = create_engine(f"sqlite+aiosqlite:///{path}")
    clock = ManualClock()
    store = SqlLeaseRepository(engine, clock=clock)
    await store.setup()
    key = LeaseKey("acme", "job")
    assert await store.acquire(key, "worker-a", 30.0) is not None
    clock.advance(31.0)
    (candidate,) = await store.takeover_candidates()
    holder = await asyncio.create_subprocess_exec(
        sys.executable, "-c", HOLD, str(path), stdin=PIPE, stdout=PIPE
    )
    try:
        assert holder.stdout is not None
        assert await holder.stdout.readline() == b"holding\n"
        os.kill(holder.pid, signal.SIGSTOP)  # frozen with its write transaction open
        with pytest.raises((OperationalError, sqlite3.OperationalError), match="is locked"):
            await store.take_over(candidate, "worker-b", 30.0)
        os.kill(holder.pid, signal.SIGKILL)  # what docs/guarantees.md says to do
        await asyncio.wait_for(holder.wait(), 30)
        taken = await store.take_over(candidate, "worker-b", 30.0)
        assert taken is not None
        assert (taken.status, taken.holder, taken.epoch) == (LeaseStatus.RUNNING, "worker-b", 2)
    finally:
        if holder.returncode is None:
            holder.kill()
            await asyncio.wait_for(holder.wait(), 30)
        await store.aclose()
        await engine.dispose()

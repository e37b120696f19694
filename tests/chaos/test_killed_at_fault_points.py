"""Never twice under crashes: a worker SIGKILLed at every fault point, then taken over.

Real processes on SQLite and PostgreSQL, for each durability mode: one process per fault
point runs start -> hold -> charge -> receipt (``charge`` the one non-idempotent write) and
kills itself at that point, the first time it reaches it after ``charge`` began. An
instance in this process then takes every execution over. ``charge`` never runs twice: the
execution is dead-lettered (the write may have happened) or resumed past it from the
checkpoint that recorded it.
"""

from __future__ import annotations

import asyncio
import signal
from pathlib import Path

import pytest

from langgraph_fence import LeaseStatus
from tests.support.databases import unique
from tests.support.fault_points import reachable
from tests.support.write_steps import (
    Database,
    assert_charged_at_most_once,
    effects_of,
    spawn,
    take_over_all,
)

pytestmark = pytest.mark.chaos

DEADLINE = 90.0


@pytest.mark.parametrize("durability", ["sync", "async", "exit"])
async def test_a_worker_killed_at_any_fault_point_never_repeats_the_charge(
    database: Database, durability: str, tmp_path: Path
) -> None:
    (tmp_path / "effects").mkdir()
    points = {unique("linear"): point for point in reachable(durability)}
    procs = {
        execution_id: await spawn(database, "linear", durability, tmp_path, point, [execution_id])
        for execution_id, point in points.items()
    }
    codes = {
        execution_id: await asyncio.wait_for(proc.wait(), DEADLINE)
        for execution_id, proc in procs.items()
    }
    for execution_id, code in codes.items():
        log = (tmp_path / f"doomed-{execution_id}.log").read_text()[-2000:]
        assert code == -signal.SIGKILL, f"{points[execution_id]}: exited {code}\n{log}"
    leases = await take_over_all(database, "linear", tmp_path, list(points), deadline=DEADLINE)
    for execution_id, point in points.items():
        lease = leases[execution_id]
        effects = effects_of(tmp_path, execution_id)
        where = f"{point}/{durability}: {effects}, {lease.status.value} {lease.reason}"
        assert_charged_at_most_once(point, lease, effects, where)
        if point in ("checkpoint.after", "release.before") and durability == "sync":
            # The checkpoint after charge was stored: the resume goes on past it.
            assert lease.status is LeaseStatus.DONE, where

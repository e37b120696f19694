"""Never twice, in parallel too: write steps of one superstep killed mid-write, then taken over.

Real processes on SQLite and PostgreSQL. Each kill is a process of its own, running one
execution through ``Instance.ainvoke``: its slow write step has written and is still inside
its step while the fast step's writes are stored, then the process is SIGKILLed. An
instance in this process then takes every execution over with ``serve()``. With one stamp
per lease the fast step's writes cleared the slow step's stamp and the takeover ran the
slow write again (6 of 12 kills, reproduced on the first version); each task's entry of
the stamp set now stands until that task's own writes are stored, so the takeover
dead-letters, naming the slow write, and no write ever runs twice.

The same for the agents users build (``create_react_agent`` v1 and v2, a ``ToolNode`` graph,
LangChain's ``create_agent``) with two write tool calls in one model answer.

``LGF_CHAOS_KILLS`` sets the kills per configuration (default 10), ``LGF_CHAOS_AGENT_KILLS``
per agent configuration (default 5).
"""

from __future__ import annotations

import os
import signal
from pathlib import Path

import pytest

from langgraph_fence import LeaseStatus
from langgraph_fence.lease import Lease
from tests.support.databases import unique
from tests.support.polling import eventually
from tests.support.write_steps import (
    AGENTS,
    SYNC_TOOL_AGENTS,
    Database,
    effects_of,
    spawn,
    take_over_all,
)

pytestmark = pytest.mark.chaos

KILLS = int(os.environ.get("LGF_CHAOS_KILLS", "10"))
AGENT_KILLS = int(os.environ.get("LGF_CHAOS_AGENT_KILLS", "5"))
DEADLINE = 120.0


async def kill_mid_write(
    database: Database,
    variant: str,
    durability: str,
    directory: Path,
    ready_per_run: int,
    kills: int = KILLS,
) -> dict[str, tuple[Lease, list[str]]]:
    """``kills`` processes, each killed while its slow writes are in flight; then a takeover.

    Returns each execution's lease after the takeover, with the writes it performed.
    """
    (directory / "effects").mkdir()
    (directory / "ready").mkdir()
    ids = [unique(variant) for _ in range(kills)]
    procs = [await spawn(database, variant, durability, directory, "-", [i]) for i in ids]
    try:

        async def all_ready() -> bool | None:
            for execution_id, proc in zip(ids, procs, strict=True):
                if proc.returncode is not None:
                    log = (directory / f"doomed-{execution_id}.log").read_text()[-2000:]
                    pytest.fail(f"a doomed worker exited {proc.returncode} before its kill:\n{log}")
            ready = len(list((directory / "ready").iterdir()))
            return True if ready >= ready_per_run * len(ids) else None

        await eventually(all_ready, timeout=DEADLINE, what="every slow write to be in flight")
    finally:
        for proc in procs:
            if proc.returncode is None:
                proc.send_signal(signal.SIGKILL)
        codes = [await proc.wait() for proc in procs]
    assert codes == [-signal.SIGKILL] * len(procs)
    leases = await take_over_all(database, variant, directory, ids, deadline=DEADLINE)
    return {i: (leases[i], effects_of(directory, i)) for i in ids}


@pytest.mark.parametrize("durability", ["sync", "async"])
@pytest.mark.parametrize(
    "variant",
    ["pair-slow-first", "pair-slow-second", "sync-pair-slow-first", "sync-pair-slow-second"],
)
async def test_a_slow_write_beside_a_fast_one_never_runs_twice(
    database: Database, variant: str, durability: str, tmp_path: Path
) -> None:
    """Async nodes, and sync ones (``sync-``: LangGraph runs them in worker threads)."""
    slow, fast = ("a", "b") if variant.endswith("slow-first") else ("b", "a")
    outcome = await kill_mid_write(database, variant, durability, tmp_path, ready_per_run=1)
    for execution_id, (lease, effects) in outcome.items():
        where = f"{execution_id}: {effects}, {lease.status} {lease.reason}"
        assert effects.count(slow) == 1, where  # written once, before the kill; never again
        assert effects.count(fast) <= 1, where
        # The slow step never recorded its writes: its entry stood, the takeover saw it.
        assert lease.status is LeaseStatus.DEAD_LETTERED, where
        assert lease.reason is not None, where
        assert f"node '{slow}' at token 1" in lease.reason, where


@pytest.mark.parametrize("durability", ["sync", "async"])
@pytest.mark.parametrize("variant", ["fanout", "sync-fanout"])
async def test_a_send_fan_out_killed_with_two_charges_mid_write_never_repeats_one(
    database: Database, variant: str, durability: str, tmp_path: Path
) -> None:
    outcome = await kill_mid_write(database, variant, durability, tmp_path, ready_per_run=2)
    for execution_id, (lease, effects) in outcome.items():
        where = f"{execution_id}: {effects}, {lease.status} {lease.reason}"
        for i in range(4):
            assert effects.count(f"charge-{i}") <= 1, where
        assert effects.count("charge-2") == effects.count("charge-3") == 1, where
        assert lease.status is LeaseStatus.DEAD_LETTERED, where
        # Both slow Send tasks' entries stood (each task has its own).
        assert lease.reason is not None, where
        assert lease.reason.count("node 'charge'") >= 2, where


@pytest.mark.parametrize("first", ["email", "charge"])
@pytest.mark.parametrize("kind", AGENTS + SYNC_TOOL_AGENTS)
async def test_an_agents_two_write_tool_calls_killed_mid_the_slow_one_never_run_twice(
    database: Database, kind: str, first: str, tmp_path: Path
) -> None:
    """The agents users build, as shipped: one model answer with two undeclared tool calls
    (send_email slow, charge_card fast, in either order), killed inside send_email. On the
    first version create_react_agent (v2, each call a task) sent the e-mail twice in 3 of 3
    kills and ended done. With sync tools too (``-sync``), and a sync node calling them with
    ``tool.invoke()`` from its worker thread (``sync-node``)."""
    outcome = await kill_mid_write(
        database, f"agent-{kind}-{first}", "async", tmp_path, ready_per_run=1, kills=AGENT_KILLS
    )
    for execution_id, (lease, effects) in outcome.items():
        where = f"{execution_id}: {effects}, {lease.status} {lease.reason}"
        assert effects.count("send_email") == 1, where
        assert effects.count("charge_card") <= 1, where
        assert lease.status is LeaseStatus.DEAD_LETTERED, where
        # The reason names the call in flight, not only the last one that stamped.
        assert lease.reason is not None, where
        assert "node 'tools:send_email'" in lease.reason, where

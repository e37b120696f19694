"""The pytest plugin as a user's project meets it: its own pytest config, its own test file.

A user's project runs pytest-asyncio in its default ``strict`` mode; the ``leases`` fixture
and :func:`run_node` on a plain node function (as ``fence_graph`` users write them) must
work there exactly as in this repository's ``auto`` mode.
"""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from langgraph_fence import Effect, LeaseKey, LeaseStatus, PendingEffect
from langgraph_fence.testing import Leases

#: The CLI or Python run in processes of their own (CI's lowest run leaves them to the newest).
pytestmark = pytest.mark.processes

USER_TESTS = '''
import pytest

from langgraph_fence import Effect, ExecutionFencedError, LeaseKey
from langgraph_fence.steps.context import get_execution_context
from langgraph_fence.testing import run_node


def charge(state):
    """A plain node function, as a user passes it to fence_graph()."""
    ctx = get_execution_context()
    return {"charged_at": ctx.fence.token, "effect": ctx.effect.value}


@pytest.mark.asyncio
async def test_a_plain_node_runs_with_a_held_token():
    out = await run_node(charge, {}, fence=3, effect="non_idempotent_write")
    assert out == {"charged_at": 3, "effect": "non_idempotent_write"}


@pytest.mark.asyncio
async def test_a_plain_node_is_refused_when_the_lease_is_lost():
    with pytest.raises(ExecutionFencedError):
        await run_node(charge, {}, fence="lost", effect=Effect.NON_IDEMPOTENT_WRITE)


@pytest.mark.asyncio
async def test_the_leases_fixture_in_strict_mode(leases):
    a = leases.instance("A", lease_ttl=5.0)
    key = LeaseKey("t", "strict-mode")
    lease = await a.repository.acquire(key, a.instance_id, 5.0)
    assert lease is not None and lease.epoch == 1
    leases.advance(6.0)
    taken = await leases.take_over(key)
    assert taken.epoch == 2
'''


@pytest.mark.parametrize("mode", ["strict", "auto"])
def test_a_users_project_uses_the_plugin_in_any_asyncio_mode(tmp_path: Path, mode: str) -> None:
    (tmp_path / "pytest.ini").write_text(f"[pytest]\nasyncio_mode = {mode}\n")
    (tmp_path / "test_users_graph.py").write_text(textwrap.dedent(USER_TESTS))
    result = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", str(tmp_path)],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == 0, result.stdout + result.stderr
    assert "3 passed" in result.stdout, result.stdout


async def test_take_over_decides_a_standing_stamp_as_serve_does(leases: Leases) -> None:
    key = LeaseKey("tenant", "stamped")
    lease = await leases.store.acquire(key, "A", 5.0)
    assert lease is not None
    effect = PendingEffect(Effect.NON_IDEMPOTENT_WRITE, "charge", "task-1", lease.epoch)
    await leases.store.mark_pending_effect(lease, effect, 5.0)
    leases.advance(6.0)
    taken = await leases.take_over(key)
    assert taken.status is LeaseStatus.DEAD_LETTERED, "a standing charge was handed back running"
    assert taken.epoch == lease.epoch + 1
    assert taken.reason is not None
    assert "'charge'" in taken.reason


async def test_run_node_refuses_an_effect_that_contradicts_the_decorator() -> None:
    from langgraph_fence import fenced
    from langgraph_fence.testing import run_node

    @fenced(effect=Effect.READ_ONLY)
    def look(state: dict[str, int]) -> dict[str, int]:
        return state

    with pytest.raises(ValueError, match="declare it in one place"):
        await run_node(look, {}, effect="non_idempotent_write")
    assert await run_node(look, {"x": 1}) == {"x": 1}

"""Stamp sets written by another version are read tolerantly: a bad entry costs its own
execution, never a read of the others (ADR-112: an unset or unrecognised effect is
retryable).

The entries are written into the lease row directly, as a newer (or broken) writer would
leave them; every read and take of the store then goes on.
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator, Callable
from typing import Any

import pytest
from sqlalchemy import text
from sqlalchemy.ext.asyncio import AsyncEngine

from langgraph_fence import Lease, LeaseKey, LeaseStatus, SqlLeaseRepository
from langgraph_fence.testing import ManualClock
from tests.support.databases import SQL_BACKENDS, unique

pytestmark = pytest.mark.parametrize("backend", SQL_BACKENDS)

TTL = 10.0

#: What a newer version might write: an effect this one does not know, a field it ignores.
NEWER = {
    "effect": "compensated_write",
    "node": "refund",
    "task_id": "task-1",
    "token": 1,
    "checkpoint_id": "",
    "call": "",
    "compensation": {"node": "undo_refund"},
}


@pytest.fixture
async def store(
    backend: str, make_engine: Callable[[str], AsyncEngine], clock: ManualClock
) -> AsyncIterator[tuple[SqlLeaseRepository, AsyncEngine]]:
    engine = make_engine(backend)
    repo = SqlLeaseRepository(engine, clock=clock)
    await repo.setup()
    yield repo, engine
    await repo.aclose()
    await engine.dispose()


async def _expired_with(
    store: tuple[SqlLeaseRepository, AsyncEngine], clock: ManualClock, stamp_set: Any
) -> LeaseKey:
    """An execution held by A at token 1, its stamp set ``stamp_set`` as stored JSON."""
    repo, engine = store
    key = LeaseKey(unique("t"), unique("e"))
    assert await repo.acquire(key, "A", TTL) is not None
    value = json.dumps(stamp_set)
    cast = "CAST(:v AS jsonb)" if engine.dialect.name == "postgresql" else ":v"
    async with engine.begin() as conn:
        await conn.execute(
            text(
                f"UPDATE fence_leases SET pending_effects = {cast}"
                " WHERE tenant_id = :t AND execution_id = :e"
            ),
            {"v": value, "t": key.tenant_id, "e": key.execution_id},
        )
    return key


async def _take(repo: SqlLeaseRepository, key: LeaseKey) -> Lease:
    """Every candidate is read (none raises), then ``key`` is taken over by B."""
    candidates = {c.key: c for c in await repo.takeover_candidates(1000)}
    assert key in candidates
    taken = await repo.take_over(candidates[key], "B", TTL)
    assert taken is not None
    return taken


async def test_an_entry_of_a_newer_version_is_retryable_and_stops_no_read(
    store: tuple[SqlLeaseRepository, AsyncEngine], clock: ManualClock
) -> None:
    repo, _ = store
    newer = await _expired_with(store, clock, {"task-1": NEWER})
    healthy = await _expired_with(store, clock, {})
    clock.advance(TTL)
    read = await repo.get(newer)
    assert read is not None
    assert [e.node for e in read.pending_effects] == ["refund"]
    assert [e.key for e in read.pending_effects] == ["task-1"]
    assert (await _take(repo, healthy)).status is LeaseStatus.RUNNING
    taken = await _take(repo, newer)
    assert taken.status is LeaseStatus.RUNNING, taken.reason
    assert taken.epoch == 2


@pytest.mark.parametrize(
    "entry",
    [
        {"node": "refund", "task_id": "task-1", "token": 1},  # no effect
        {"effect": None, "node": "refund"},
        "compensated_write",  # not an object
        42,
    ],
    ids=["unset", "null", "string", "number"],
)
async def test_an_entry_without_a_known_effect_is_retryable(
    store: tuple[SqlLeaseRepository, AsyncEngine], clock: ManualClock, entry: Any
) -> None:
    repo, _ = store
    key = await _expired_with(store, clock, {"task-1": entry})
    clock.advance(TTL)
    assert await repo.get(key) is not None
    taken = await _take(repo, key)
    assert taken.status is LeaseStatus.RUNNING, taken.reason


async def test_a_partial_non_idempotent_entry_still_dead_letters_its_own_execution_only(
    store: tuple[SqlLeaseRepository, AsyncEngine], clock: ManualClock
) -> None:
    repo, _ = store
    partial = await _expired_with(
        store, clock, {"task-1/charge/ab12": {"effect": "non_idempotent_write", "token": "x"}}
    )
    healthy = await _expired_with(store, clock, {})
    clock.advance(TTL)
    read = await repo.get(partial)
    assert read is not None
    [entry] = read.pending_effects
    assert (entry.key, entry.task_id, entry.call) == ("task-1/charge/ab12", "task-1", "charge/ab12")
    decided = await _take(repo, partial)
    assert decided.status is LeaseStatus.DEAD_LETTERED
    assert (await _take(repo, healthy)).status is LeaseStatus.RUNNING

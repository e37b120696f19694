"""Issue 32, item 4: an undecodable checkpoint settles its execution once and hides nobody.

A checkpoint that cannot be read used to fail before the take: the execution stayed
``running`` with a dead holder, was tried again every poll, and a window full of such rows
starved every healthy takeover behind them. Both databases.
"""

from __future__ import annotations

from typing import Any

import pytest
from sqlalchemy import text

from langgraph_fence import LeaseKey, LeaseStatus
from langgraph_fence.execution.serve import Server
from langgraph_fence.testing import Leases
from tests.support.databases import SQL_BACKENDS, unique
from tests.support.hardening import expired, log_graph
from tests.support.polling import eventually
from tests.support.serving import serving, until_status

RUNS_ON = SQL_BACKENDS

BAD = 50


async def unreadable(db: Leases, first: Any, tenant: str) -> LeaseKey:
    """An execution of ``tenant`` with a checkpoint, whose worker died mid-run (running,
    expired, holder gone); its checkpoint rows are then made undecodable."""
    key = LeaseKey(tenant, unique("job"))
    config: Any = {"configurable": {"thread_id": key.execution_id}}
    await first.ainvoke(log_graph(first), {"log": []}, config, tenant_id=tenant)
    async with db.engine.begin() as conn:  # its next run died mid-step, token 2
        await conn.execute(
            text(
                "UPDATE fence_leases SET status = 'running', holder = 'died', epoch = epoch + 1, "
                "expires_at = :at WHERE tenant_id = :t AND execution_id = :e"
            ),
            {"at": db.clock() + 30.0, "t": key.tenant_id, "e": key.execution_id},
        )
    return key


async def test_undecodable_checkpoints_are_dead_lettered_once_and_hide_no_takeover(
    db: Leases, monkeypatch: pytest.MonkeyPatch
) -> None:
    tenants = [unique("bad") for _ in range(BAD)]
    first = db.instance("A")
    bad = [await unreadable(db, first, tenant) for tenant in tenants]
    async with db.engine.begin() as conn:  # an unknown serialization: cannot be decoded
        for key in bad:
            changed = await conn.execute(
                text(
                    "UPDATE fence_checkpoints SET type = 'pickle' "
                    "WHERE tenant_id = :t AND thread_id = :e"
                ),
                {"t": key.tenant_id, "e": key.execution_id},
            )
            assert changed.rowcount >= 1
    db.advance(1.0)  # the healthy one expires after them: it is behind them in the window
    healthy = await expired(db, "served", tenant=unique("good"))
    db.advance(31.0)
    worker = db.instance("B")
    polls = 0
    taken_in_poll: list[int] = []
    dead_letters: dict[LeaseKey, int] = {}
    take_work, take_over = Server.take_work, worker.repository.take_over
    dead_letter = worker.repository.dead_letter

    async def counted_poll(server: Server, free: int, **options: Any) -> None:
        nonlocal polls
        polls += 1
        await take_work(server, free, **options)

    async def counted_take_over(candidate: Any, holder: str, ttl: float, **budget: Any) -> Any:
        if candidate.key == healthy:
            taken_in_poll.append(polls)
        return await take_over(candidate, holder, ttl, **budget)

    async def counted_dead_letter(key: LeaseKey, reason: str, **guard: Any) -> Any:
        dead_letters[key] = dead_letters.get(key, 0) + 1
        return await dead_letter(key, reason, **guard)

    monkeypatch.setattr(Server, "take_work", counted_poll)
    worker.repository.take_over = counted_take_over  # type: ignore[method-assign]
    worker.repository.dead_letter = counted_dead_letter  # type: ignore[method-assign]
    try:
        async with serving(worker, {"served": log_graph(worker)}):
            await until_status(db, healthy, LeaseStatus.DONE)
            seen = polls
            await eventually(lambda: polls >= seen + 3)  # later polls find nothing to settle
    finally:
        async with db.engine.begin() as conn:  # out of later tests' way, whatever happened
            for key in bad:
                await conn.execute(
                    text(
                        "UPDATE fence_leases SET status = 'done', holder = NULL "
                        "WHERE tenant_id = :t AND status = 'running'"
                    ),
                    {"t": key.tenant_id},
                )
    assert taken_in_poll == [1]  # taken in the first poll, however many bad rows came first
    for key in bad:
        lease = await db.store.get(key)
        assert lease is not None
        assert lease.status is LeaseStatus.DEAD_LETTERED, lease
        assert lease.reason is not None
        assert lease.reason.startswith("its latest checkpoint cannot be loaded: "), lease.reason
        assert lease.epoch == 3  # dead-lettered under the token of the take that found it
        assert dead_letters.get(key) == 1  # once, not once per poll

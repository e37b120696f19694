"""The sink's contract helpers, shared by the async and the sync sink tests: the user
table, writes with retry, take-overs, and what landed."""

from __future__ import annotations

import json
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

from sqlalchemy import text
from sqlalchemy.exc import DBAPIError
from sqlalchemy.ext.asyncio import AsyncConnection, AsyncEngine

from langgraph_fence import (
    ExecutionFence,
    ExecutionFencedError,
    LeaseKey,
    MemoryLeaseRepository,
)
from langgraph_fence.fence import RunHandle
from langgraph_fence.sinks import (
    fenced_write,
    is_serialization_failure,
)
from langgraph_fence.testing import ManualClock
from tests.support.databases import unique


class Abandon(Exception):
    """Raised inside a block to roll its transaction back."""


async def takeovers(count: int, *, tenant: str | None = None) -> list[RunHandle]:
    """Handles of ``count`` successive holders of one execution: tokens 1..count."""
    clock = ManualClock()
    repo = MemoryLeaseRepository(clock=clock)
    key = LeaseKey(tenant or unique("tenant"), unique("exec"))
    handles = []
    for n in range(1, count + 1):
        lease = await repo.acquire(key, f"instance-{n}", LEASE_TTL)
        assert lease is not None
        assert lease.epoch == n
        handles.append(RunHandle(repo, lease, HOLD_TTL))
        clock.advance(LEASE_TTL + 1)
    return handles


async def mark_of(engine: AsyncEngine, scope: str) -> int | None:
    async with engine.connect() as conn:
        row = await conn.execute(
            text("SELECT token FROM fence_high_water WHERE scope_key = :s"), {"s": scope}
        )
        value = row.scalar_one_or_none()
        return None if value is None else int(value)


async def applied_rows(engine: AsyncEngine, scope: str) -> dict[str, tuple[int, Any]]:
    """``{idempotency_key: (token, result)}`` as committed for ``scope``."""
    async with engine.connect() as conn:
        rows = await conn.execute(
            text("SELECT idempotency_key, token, result FROM fence_applied WHERE scope_key = :s"),
            {"s": scope},
        )
        return {
            r.idempotency_key: (int(r.token), None if r.result is None else json.loads(r.result))
            for r in rows
        }


async def user_rows(engine: AsyncEngine, scope: str) -> list[tuple[str, int, str]]:
    """``(idem, token, writer)`` of the user's own committed rows for ``scope``, in seq order."""
    async with engine.connect() as conn:
        rows = await conn.execute(
            text(
                "SELECT idem, token, writer FROM sink_user_rows WHERE scope_key = :s ORDER BY seq"
            ),
            {"s": scope},
        )
        return [(r.idem, int(r.token), r.writer) for r in rows]


@dataclass
class Outcome:
    """What one writer saw: refused, skipped an applied key, or applied the write."""

    who: str
    token: int
    key: str
    refused: ExecutionFencedError | None = None
    applied_before: bool = False
    result: Any = None
    retries: int = 0
    errors: list[BaseException] = field(default_factory=list)


async def write_with_retry(
    engine: AsyncEngine,
    handle: RunHandle,
    key: str,
    who: str,
    *,
    isolation: str | None = None,
    begun: Callable[[AsyncConnection], Awaitable[None]] | None = None,
) -> Outcome:
    """How a user runs a fenced write: one transaction, retried whole on a conflict."""
    fence = ExecutionFence(handle)
    outcome = Outcome(who, handle.token, key)
    for _attempt in range(20):
        try:
            async with engine.connect() as conn:
                if conn.dialect.name == "postgresql":
                    conn = await conn.execution_options(
                        isolation_level=isolation or "READ COMMITTED"
                    )
                async with conn.begin():
                    if begun is not None:
                        await begun(conn)
                        begun = None  # only the first attempt is orchestrated
                    await write_once(conn, fence, key, who, outcome)
            return outcome
        except ExecutionFencedError as exc:
            outcome.refused = exc
            return outcome
        except DBAPIError as exc:
            if not is_serialization_failure(exc):
                raise
            outcome.errors.append(exc)
            outcome.retries += 1
    raise AssertionError(f"{who} kept failing on conflicts: {outcome.errors}")


LEASE_TTL = 10.0  # on the lease store's manual clock


HOLD_TTL = 3600.0  # on the handle's real clock: local checks never expire inside a test


async def write_once(
    conn: AsyncConnection, fence: ExecutionFence, key: str, who: str, outcome: Outcome
) -> None:
    """The user's code: skip an applied key, else write a row of its own and record."""
    async with fenced_write(conn, fence, key) as write:
        if write.applied:
            outcome.applied_before = True
            outcome.result = write.result
        else:
            await insert_user_row(conn, fence.scope_key, key, fence.token, who)
            outcome.result = {"by": who, "token": fence.token}
            write.record(outcome.result)


async def insert_user_row(
    conn: AsyncConnection, scope: str, idem: str, token: int, who: str
) -> None:
    await conn.execute(
        text("INSERT INTO sink_user_rows (scope_key, idem, token, writer) VALUES (:s, :i, :t, :w)"),
        {"s": scope, "i": idem, "t": token, "w": who},
    )


USER_TABLE = {
    "sqlite": (
        "CREATE TABLE IF NOT EXISTS sink_user_rows ("
        " seq INTEGER PRIMARY KEY AUTOINCREMENT, scope_key TEXT NOT NULL,"
        " idem TEXT NOT NULL, token BIGINT NOT NULL, writer TEXT NOT NULL)"
    ),
    "postgresql": (
        "CREATE TABLE IF NOT EXISTS sink_user_rows ("
        " seq BIGSERIAL PRIMARY KEY, scope_key TEXT NOT NULL,"
        " idem TEXT NOT NULL, token BIGINT NOT NULL, writer TEXT NOT NULL)"
    ),
}

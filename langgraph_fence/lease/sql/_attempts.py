"""The SQL stores' start of an Agent Server attempt (:mod:`langgraph_fence.lease.attempts`):
one transaction that reads the run's row and the lease under their locks, decides, and
writes both; and the record of the epoch an attempt's take took. (An erased thread's rows go
with its execution record: :meth:`~langgraph_fence.lease.records.SqlExecutionRecords.forget`.)"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from dataclasses import replace
from typing import Any

from sqlalchemy import and_, select, update
from sqlalchemy.dialects.postgresql import insert as pg_insert
from sqlalchemy.dialects.sqlite import insert as sqlite_insert
from sqlalchemy.ext.asyncio import AsyncEngine

from langgraph_fence.database import dialect_of, read_only, transaction
from langgraph_fence.database.retry import retry_connection_errors
from langgraph_fence.lease import Lease, LeaseKey
from langgraph_fence.lease.attempts import Attempt, AttemptRow, Supersede, decide_supersede
from langgraph_fence.lease.schema import LEASES, SERVER_ATTEMPTS
from langgraph_fence.lease.timeline import token_floor

__all__ = ["newest_attempt", "record_epoch", "start_attempt"]

_A = SERVER_ATTEMPTS.c
_L = LEASES.c


def _row_of(key: LeaseKey, run_id: str) -> Any:
    return and_(
        _A.tenant_id == key.tenant_id, _A.execution_id == key.execution_id, _A.run_id == run_id
    )


async def start_attempt(
    engine: AsyncEngine,
    now: Callable[[], Awaitable[float]],
    lease_of: Callable[[Any], Lease],
    key: LeaseKey,
    attempt: Attempt,
    holder: str,
    ttl: float,
    *,
    quarantine: bool = True,
) -> Lease | None:
    """Start ``attempt`` of ``key`` for ``holder`` on the lease store of ``engine`` (its
    clock ``now``, its rows read by ``lease_of``): the lease taken over from an earlier
    attempt of the run (``None``: left as it was, to be taken as any run takes it).

    One transaction (``BEGIN IMMEDIATE`` on SQLite; the run's row, then the lease row,
    locked ``FOR UPDATE`` on PostgreSQL: attempts of one run decide one at a time). A
    repeat after a lost answer finds its own attempt and changes nothing.

    Raises:
        ExecutionSupersededError: a newer attempt of the run started; nothing written.
    """
    insert = pg_insert if engine.dialect.name == "postgresql" else sqlite_insert
    row_of = _row_of(key, attempt.run_id)
    lease_row = and_(_L.tenant_id == key.tenant_id, _L.execution_id == key.execution_id)

    async def once() -> Lease | None:
        async with transaction(engine) as conn:
            at = await now()
            await conn.execute(
                insert(SERVER_ATTEMPTS)
                .values(
                    tenant_id=key.tenant_id,
                    execution_id=key.execution_id,
                    run_id=attempt.run_id,
                    attempt=0,
                    epoch=None,
                    at=at,
                )
                .on_conflict_do_nothing(index_elements=["tenant_id", "execution_id", "run_id"])
            )
            found = (
                await conn.execute(select(_A.attempt, _A.epoch).where(row_of).with_for_update())
            ).one()
            row = AttemptRow(found.attempt, found.epoch) if found.attempt else None
            lease = (await conn.execute(select(LEASES).where(lease_row).with_for_update())).first()
            current = None if lease is None else lease_of(lease)
            # The token floor of lease.timeline; while a failover's executions are
            # unclassified the lease is left as it is, for the run's own take (refused
            # until they are) to decide.
            floor, classified = await token_floor(conn, dialect_of(engine))
            decided = decide_supersede(
                key, current if classified or not quarantine else None, row, attempt, holder,
                ttl, at,
            )  # fmt: skip
            if decided.lease is not None and decided.lease.epoch <= floor:
                taken_at = replace(decided.lease, epoch=floor + 1)
                decided = Supersede(AttemptRow(decided.row.number, floor + 1), taken_at)
            await conn.execute(
                update(SERVER_ATTEMPTS)
                .where(row_of)
                .values(attempt=decided.row.number, epoch=decided.row.epoch, at=at)
            )
            taken = decided.lease
            if taken is not None and current is not None:
                values: dict[str, Any] = {
                    "epoch": taken.epoch,
                    "holder": taken.holder,
                    "expires_at": taken.expires_at,
                    "status": taken.status.value,
                    "reason": taken.reason,
                    "takeovers": taken.takeovers,
                    "updated_at": at,
                }
                if not taken.pending_effects:
                    values["pending_effects"] = {}  # the take cleared the idempotent entries
                await conn.execute(
                    update(LEASES).where(lease_row, _L.epoch == current.epoch).values(**values)
                )
            return taken

    return await retry_connection_errors(once, what="start of an Agent Server attempt")


async def record_epoch(engine: AsyncEngine, key: LeaseKey, attempt: Attempt, epoch: int) -> bool:
    """Record that ``attempt`` took ``epoch``; ``False`` when a newer attempt of its run
    started meanwhile (nothing written: the caller gives the lease back)."""
    row_of = _row_of(key, attempt.run_id)

    async def once() -> bool:
        async with transaction(engine) as conn:
            result = await conn.execute(
                update(SERVER_ATTEMPTS)
                .where(row_of, _A.attempt == attempt.number)
                .values(epoch=epoch)
            )
            return bool(result.rowcount)

    return await retry_connection_errors(once, what="record of an Agent Server attempt's take")


async def newest_attempt(engine: AsyncEngine, key: LeaseKey, run_id: str) -> int | None:
    """The newest attempt of server run ``run_id`` of ``key`` that started, or ``None``."""

    async def once() -> int | None:
        async with read_only(engine).connect() as conn:
            found = (
                await conn.execute(select(_A.attempt).where(_row_of(key, run_id)))
            ).scalar_one_or_none()
            return None if not found else int(found)

    return await retry_connection_errors(once, what="newest Agent Server attempt")

"""The SQL stores' start of an Agent Server attempt (:mod:`langgraph_fence.lease.attempts`):
one transaction that reads the newest stamp and the lease under their locks, decides, and
records the stamp with the fence of the attempt it supersedes."""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import Any

from sqlalchemy import and_, select, update
from sqlalchemy.dialects.postgresql import insert as pg_insert
from sqlalchemy.dialects.sqlite import insert as sqlite_insert
from sqlalchemy.ext.asyncio import AsyncEngine

from langgraph_fence.database import transaction
from langgraph_fence.database.retry import retry_connection_errors
from langgraph_fence.lease import Lease, LeaseKey
from langgraph_fence.lease.attempts import decide_supersede
from langgraph_fence.lease.schema import LEASES, SERVER_ATTEMPTS

__all__ = ["supersede"]

_A = SERVER_ATTEMPTS.c
_L = LEASES.c
#: The stamp of a row made only to be locked: older than any attempt's.
_NONE = ""


async def supersede(
    engine: AsyncEngine,
    now: Callable[[], Awaitable[float]],
    lease_of: Callable[[Any], Lease],
    key: LeaseKey,
    stamp: str,
) -> Lease | None:
    """Start attempt ``stamp`` of ``key`` on the lease store of ``engine`` (its clock
    ``now``, its rows read by ``lease_of``): the lease as fenced (``None``: left as it was).

    One transaction (``BEGIN IMMEDIATE`` on SQLite; the attempts row, then the lease row,
    locked ``FOR UPDATE`` on PostgreSQL, so attempts of one execution decide one at a time).
    Safe to repeat: a repeat finds its own stamp the newest and fences nothing.

    Raises:
        ExecutionSupersededError: a newer attempt started before; nothing written.
    """
    insert = pg_insert if engine.dialect.name == "postgresql" else sqlite_insert
    ids = {"tenant_id": key.tenant_id, "execution_id": key.execution_id}
    attempt_row = and_(_A.tenant_id == key.tenant_id, _A.execution_id == key.execution_id)
    lease_row = and_(_L.tenant_id == key.tenant_id, _L.execution_id == key.execution_id)

    async def once() -> Lease | None:
        async with transaction(engine) as conn:
            at = await now()
            await conn.execute(
                insert(SERVER_ATTEMPTS)
                .values(**ids, stamp=_NONE, at=at)
                .on_conflict_do_nothing(index_elements=["tenant_id", "execution_id"])
            )
            found = (
                await conn.execute(select(_A.stamp).where(attempt_row).with_for_update())
            ).scalar_one()
            row = (await conn.execute(select(LEASES).where(lease_row).with_for_update())).first()
            current = None if row is None else lease_of(row)
            latest = None if found == _NONE else str(found)
            fenced = decide_supersede(key, current, latest, stamp)  # may refuse: rolled back
            await conn.execute(
                update(SERVER_ATTEMPTS).where(attempt_row).values(stamp=stamp, at=at)
            )
            if fenced is not None and current is not None:
                values: dict[str, Any] = {
                    "epoch": fenced.epoch,
                    "holder": None,
                    "expires_at": None,
                    "status": fenced.status.value,
                    "reason": fenced.reason,
                    "updated_at": at,
                }
                await conn.execute(
                    update(LEASES).where(lease_row, _L.epoch == current.epoch).values(**values)
                )
            return fenced

    return await retry_connection_errors(once, what="start of an Agent Server attempt")

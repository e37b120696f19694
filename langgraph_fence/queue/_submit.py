"""The writes of a thread's runs, each one transaction: a submit (and what it does to a busy
thread), the start of a thread's next queued run once its run ended, and a cancel; and the
read that refuses a start while submitted runs wait on the thread."""

from __future__ import annotations

import time
import uuid
from collections.abc import Awaitable, Callable, Mapping
from functools import partial
from typing import Any

from sqlalchemy.ext.asyncio import AsyncConnection

from langgraph_fence.database import transaction
from langgraph_fence.database.retry import retry_connection_errors
from langgraph_fence.lease import LeaseKey, LeaseStatus
from langgraph_fence.lease.transitions import is_yielded
from langgraph_fence.queue._checks import (
    OnBusy,
    busy_error,
    dead_lettered_error,
    waiting_error,
)
from langgraph_fence.queue._database import QueueDatabase
from langgraph_fence.queue._flows import HELD_BACK, UPSERT_FLOW, Flow
from langgraph_fence.queue._not_before import Checked, not_before_at
from langgraph_fence.queue._statements import (
    ADD_RUN,
    BETWEEN_RUNS,
    CANCEL_QUEUED,
    MAKE_CURRENT,
    NEXT_QUEUED,
    OPEN_RUNS,
    PROMOTABLE,
    RECORDED,
    RUN_ENDS,
    RUN_STATUS,
    SUBMIT_RECORD,
    WAITING,
)
from langgraph_fence.queue.notifications import ENDS_CHANNEL, NOTIFY_CHANNEL

__all__ = ["cancel_run", "promote_queued", "refuse_beside_waiting", "submit_in", "submit_run"]

_BUSY = (LeaseStatus.PENDING.value, LeaseStatus.RUNNING.value)
# The record columns two submits must share to be the same submit again.
_SAME = ("graph", "input_type", "input", "run_type", "run")


async def submit_run(
    db: QueueDatabase,
    key: LeaseKey,
    record: Mapping[str, Any],
    on_busy: OnBusy,
    not_before: Checked | None = None,
    flow: Flow | None = None,
    stream_modes: str | None = None,
    submitted: Callable[[AsyncConnection, str], Awaitable[None]] | None = None,
) -> str | None:
    """Record a submit of ``record`` (the record's columns, serialised) under ``key``, in one
    transaction: its run row, and the execution's record and pending lease when it runs
    next; the run's id, or the id of the same run submitted before (``None``: that run has
    no row of its own). ``not_before``: no worker starts the run earlier (store clock);
    ``flow``: it waits to be admitted under its key's limits; ``stream_modes``: the stream
    modes its holders record (joined by commas; ``None``: none); ``submitted``: what else
    the submit writes of the run, in its transaction (its callbacks)."""
    at = time.time()
    run_id = uuid.uuid4().hex  # made once: a retried transaction adds the same run

    async def once() -> str | None:
        async with transaction(db.engine) as conn:
            await db.classified(conn)
            start = await not_before_at(conn, not_before, db)
            found = await submit_in(
                db, conn, key, record, on_busy, start, run_id, at, flow, stream_modes
            )
            if found is not None and submitted is not None:
                await submitted(conn, found)
            return found

    return await db.settled_first(partial(retry_connection_errors, once, what="submit"))


async def submit_in(
    db: QueueDatabase,
    conn: AsyncConnection,
    key: LeaseKey,
    record: Mapping[str, Any],
    on_busy: OnBusy,
    start: float | None,
    run_id: str,
    at: float,
    flow: Flow | None = None,
    stream_modes: str | None = None,
) -> str | None:
    """:func:`submit_run`'s writes, in ``conn``'s transaction (which the caller opened, and
    checked classified): the run ``run_id`` submitted at ``at`` (wall clock), starting no
    earlier than ``start`` (store clock, or ``None``), admitted under ``flow``'s limits."""
    params = {"tenant_id": key.tenant_id, "execution_id": key.execution_id}
    flow_key = None if flow is None else flow.key
    row = {**params, **record, "run_id": run_id, "at": at, "not_before": start}
    row["flow_key"] = flow_key
    row["stream_modes"] = stream_modes
    if flow is not None:
        await conn.execute(UPSERT_FLOW, flow.params(key.tenant_id))
    root = {"scope_key": key.scope_key, "parent_execution_id": None}
    created = await conn.execute(db.leases.insert_pending, {**params, **root, **db.now()})
    if created.first() is None:
        lease = (await conn.execute(db.lease_row, params)).one()
        if lease.status == LeaseStatus.DEAD_LETTERED.value:
            raise dead_lettered_error(key, lease.reason)
        runs = list(await conn.execute(OPEN_RUNS, params))
        queued = [r for r in runs if r.status == "queued"]
        current = next((r.run_id for r in runs if r.status == "current"), None)
        in_flight = lease.status in _BUSY or is_yielded(lease.status, lease.holder)
        if in_flight or queued:
            same = tuple(record[k] for k in _SAME)
            if in_flight and await _recorded(conn, params) == same:
                return current  # the same submit again: that run
            for waiting in queued:
                if _same_as(waiting) == same:
                    return str(waiting.run_id)
            if on_busy == "reject":
                raise busy_error(key, lease.status, lease.holder, len(queued))
            if on_busy == "enqueue":
                await conn.execute(ADD_RUN, {**row, "status": "queued"})
                return run_id
        if in_flight:  # interrupt
            reason = f"interrupted by a submit of new input at {at:.3f}"
            await conn.execute(RUN_ENDS, {**params, "status": "failed", "reason": reason})
            interrupt = {**params, "epoch": lease.epoch, **db.now()}
            await conn.execute(
                db.leases.interrupt, {**interrupt, "status": "pending", "reason": reason}
            )
        else:
            # The thread's last run ended: it keeps its end, this one begins
            # (before any queued one, for an interrupt).
            await conn.execute(RUN_ENDS, {**params, "status": None, "reason": None})
            await _repend(db, conn, params, lease.epoch)
    await conn.execute(ADD_RUN, {**row, "status": "current"})
    await _hold_until(db, conn, params, start if flow is None else HELD_BACK)
    # Delivered on commit: a waiting serve() looks at once.
    await db.notify(conn, NOTIFY_CHANNEL, record["graph"])
    await conn.execute(SUBMIT_RECORD, {**params, **record, "at": at})
    return run_id


async def _recorded(conn: AsyncConnection, params: Mapping[str, str]) -> Any:
    row = (await conn.execute(RECORDED, dict(params))).first()
    if row is None:
        return None
    return (row.graph, row.input_type, bytes(row.input), row.run_type, bytes(row.run or b""))


def _same_as(row: Any) -> tuple[Any, ...]:
    """A run row's columns as :data:`_SAME` compares them."""
    return (row.graph, row.input_type, bytes(row.input), row.run_type, bytes(row.run))


async def _hold_until(
    db: QueueDatabase, conn: AsyncConnection, params: Mapping[str, str], start: float | None
) -> None:
    """The execution's pending run starts no earlier than ``start`` (``None``: at once)."""
    if start is not None:
        await conn.execute(db.leases.hold_until, {**params, "not_before": start})


async def _repend(
    db: QueueDatabase, conn: AsyncConnection, params: Mapping[str, str], epoch: int
) -> None:
    """The execution's next run is pending at ``epoch`` (the claim takes the next)."""
    await conn.execute(db.leases.repend, {**params, "epoch": epoch, **db.now()})


async def promote_queued(db: QueueDatabase, limit: int) -> int:
    """Begin the next queued run of up to ``limit`` threads whose run ended, one
    transaction each; how many began."""

    async def threads() -> list[Any]:
        async with db.engine.connect() as conn:
            return list(await conn.execute(PROMOTABLE, {"limit": limit}))

    began = 0
    for found in await retry_connection_errors(threads, what="queued runs"):
        key = LeaseKey(found.tenant_id, found.execution_id)
        promote = partial(retry_connection_errors, partial(_promote, db, key), what="queued run")
        if await db.settled_first(promote):
            began += 1
    return began


async def _promote(db: QueueDatabase, key: LeaseKey) -> bool:
    params = {"tenant_id": key.tenant_id, "execution_id": key.execution_id}
    at = time.time()
    async with transaction(db.engine) as conn:
        await db.classified(conn)
        lease = (await conn.execute(db.lease_row, params)).first()
        if lease is None or lease.status not in BETWEEN_RUNS:
            return False
        if is_yielded(lease.status, lease.holder):
            return False  # its run goes on: it waits for its children
        queued = (await conn.execute(NEXT_QUEUED, params)).first()
        if queued is None:
            return False
        await conn.execute(RUN_ENDS, {**params, "status": None, "reason": None})
        await conn.execute(MAKE_CURRENT, {"run_id": queued.run_id})
        record = {
            "graph": queued.graph,
            "thread_id": queued.thread_id,
            "input_type": queued.input_type,
            "input": queued.input,
            "run_type": queued.run_type,
            "run": queued.run,
        }
        await conn.execute(SUBMIT_RECORD, {**params, **record, "at": at})
        await _repend(db, conn, params, lease.epoch)
        await _hold_until(
            db, conn, params, queued.not_before if queued.flow_key is None else HELD_BACK
        )
        return True


async def refuse_beside_waiting(db: QueueDatabase, key: LeaseKey) -> None:
    """Raise :func:`waiting_error` if a submitted run of ``key`` is pending, or some are
    queued (one read)."""
    params = {"tenant_id": key.tenant_id, "execution_id": key.execution_id}
    row = await db.first(WAITING, params, what="submitted runs of the thread")
    if row is None:
        return
    pending = row.status == LeaseStatus.PENDING.value and row.submitted_at is not None
    if pending or row.queued:
        raise waiting_error(key, row.status, pending=pending)


async def cancel_run(db: QueueDatabase, key: LeaseKey, reason: str, run_id: str | None) -> bool:
    """End the execution ``cancelled`` (or only its queued run ``run_id``) and its children
    no worker claimed yet, in one transaction; whether anything was cancelled."""
    params = {
        "tenant_id": key.tenant_id,
        "execution_id": key.execution_id,
        "status": LeaseStatus.CANCELLED.value,
        "reason": reason,
    }
    # Exactly its own children: the rows that record it as their parent.
    children = {
        "tenant_id": key.tenant_id,
        "parent_execution_id": key.execution_id,
        "reason": f"its parent {key.scope_key!r} was cancelled before it started",
    }

    async def once() -> bool:
        async with transaction(db.engine) as conn:
            await db.classified(conn)
            if run_id is not None:
                # The lease row first (as a promotion locks it): no deadlock with one.
                lock = {"tenant_id": key.tenant_id, "execution_id": key.execution_id}
                await conn.execute(db.lease_row, lock)
                status = (await conn.execute(RUN_STATUS, {"run_id": run_id})).scalar()
                if status == "queued":
                    queued = {"run_id": run_id, "reason": reason}
                    return bool((await conn.execute(CANCEL_QUEUED, queued)).rowcount)
                if status != "current":
                    return False  # it ended already
            now = db.now()
            cancelled = (await conn.execute(db.leases.cancel, {**params, **now})).first()
            if cancelled is not None:
                await conn.execute(db.leases.cancel_children, {**children, **now})
                # Delivered on commit: its result() returns at once.
                await db.notify(conn, ENDS_CHANNEL, key.scope_key)
            return cancelled is not None

    return await db.settled_first(partial(retry_connection_errors, once, what="cancel"))

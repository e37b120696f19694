"""Where a run stands, as any process reads it: one run's state, the runs in flight and
queued (``langgraph-fence runs``), and which workers serve which graph.

Nothing here loads LangGraph: the listings run without it (benchmarks/README.md, start-up).
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass, replace
from typing import Any

from sqlalchemy.ext.asyncio import AsyncEngine

from langgraph_fence.database.retry import retry_connection_errors
from langgraph_fence.lease import LeaseKey, LeaseStatus
from langgraph_fence.queue._flows import HELD_BACK
from langgraph_fence.queue._statements import OF_TENANT, QUEUED_RUNS, RUNS, WORKERS

__all__ = [
    "ANNOUNCED_FOR",
    "ANNOUNCE_EVERY",
    "RunState",
    "WorkerHold",
    "list_runs",
    "run_state",
    "served_graphs",
    "submitted_run_state",
]

#: How often a serving instance says it is serving, and how long that holds (seconds).
ANNOUNCE_EVERY = 5.0
ANNOUNCED_FOR = 30.0


@dataclass(frozen=True, slots=True)
class WorkerHold:
    """What a serving worker holds, as it says each :data:`ANNOUNCE_EVERY` seconds.

    Attributes:
        held: the leases it keeps now.
        max_held: the most it keeps at once.
        lease_ttl: its lease TTL, in seconds.
        renewal_late: how late its latest renewal since the last announcement came, in
            seconds (0.0: in time).
    """

    held: int
    max_held: int
    lease_ttl: float
    renewal_late: float


@dataclass(frozen=True, slots=True)
class RunState:
    """One execution as the queue sees it (``langgraph-fence runs``, :meth:`SubmittedRun.state`).

    Attributes:
        key: the execution.
        status: where its lease stands.
        holder: the worker running it, or ``None``.
        epoch: its lease's token.
        graph: the graph name it is recorded under (``None``: no record).
        thread_id: its thread (``None``: no record).
        submitted: whether it was submitted (not started by ``ainvoke``).
        reason: why it ended, when it did.
        expires_at: when the worker's hold ends (store clock), or ``None``.
        run_id: the submitted run's own id (``None``: the execution's run, whichever).
        queued: the run waits behind the thread's run (``on_busy="enqueue"``); its status
            is then ``pending``.
        not_before: a pending run starts no earlier than this (store clock, epoch seconds;
            ``submit(not_before=...)``, a durable sleep), or ``None``.
        held_back: the run waits for its flow key's limits to admit it
            (``submit(flow=...)``); its status is then ``pending``.
        attempts: the attempts the submitted run made (``serve(run_retries=...)``).
    """

    key: LeaseKey
    status: LeaseStatus
    holder: str | None
    epoch: int
    graph: str | None
    thread_id: str | None
    submitted: bool
    reason: str | None = None
    expires_at: float | None = None
    run_id: str | None = None
    queued: bool = False
    not_before: float | None = None
    held_back: bool = False
    attempts: int = 1


def run_state(row: Any) -> RunState:
    """A row of a lease and its record (the queue's ``STATE``, ``RUNS`` or ``RUN_STATE``)
    as a :class:`RunState`."""
    status = LeaseStatus(row.status)
    # A pending row with no holder keeps in expires_at the time it may start from.
    waits = status is LeaseStatus.PENDING and row.holder is None
    held = waits and row.expires_at is not None and row.expires_at >= HELD_BACK
    return RunState(
        LeaseKey(row.tenant_id, row.execution_id),
        status,
        row.holder,
        int(row.epoch),
        row.graph,
        row.thread_id,
        row.submitted_at is not None,
        row.reason,
        None if waits else row.expires_at,
        not_before=row.expires_at if waits and not held else None,
        held_back=held,
    )


def submitted_run_state(row: Any, run_id: str | None) -> tuple[RunState, tuple[Any, Any]]:
    """The state and stored output of a read of the queue's ``STATE`` (``run_id`` ``None``)
    or ``RUN_STATE``: a run that ended is told by its own row (its outcome, never the next
    run's), a queued one waits (``pending``, or behind a dead-lettered run it cannot pass)."""
    state = replace(run_state(row), attempts=int(row.run_attempts or 1))
    if run_id is None or row.run_status == "current":
        return replace(state, run_id=run_id), (row.output_type, row.output)
    if row.run_status == "queued":
        if state.status is LeaseStatus.DEAD_LETTERED:
            # It cannot begin until the thread is resolved (`langgraph-fence resolve`).
            reason = (
                "it is queued behind the thread's run, which was dead-lettered "
                f"({state.reason or 'no reason recorded'}); it has not run"
            )
            return replace(state, run_id=run_id, queued=True, reason=reason), (None, None)
        waiting = replace(
            state,
            status=LeaseStatus.PENDING,
            holder=None,
            reason=None,
            expires_at=None,
            graph=row.run_graph,
            thread_id=row.run_thread,
            run_id=run_id,
            queued=True,
            not_before=row.run_not_before,
        )
        return waiting, (None, None)
    ended = replace(
        state,
        status=LeaseStatus(row.run_status),
        holder=None,
        epoch=int(row.run_epoch or 0),
        graph=row.run_graph,
        thread_id=row.run_thread,
        reason=row.run_reason,
        expires_at=None,
        run_id=run_id,
    )
    return ended, (row.run_output_type, row.run_output)


async def list_runs(
    engine: AsyncEngine, limit: int = 1000, *, tenant_id: str | None = None
) -> list[RunState]:
    """Every pending, running and yielded execution on ``engine``'s database that has a
    record (with its worker), oldest first; then the submitted runs queued behind them
    (``queued``, status ``pending``), oldest submit first (up to ``limit`` of each). With
    ``tenant_id``, that tenant's only: no other tenant's id, graph or thread is read."""
    of = OF_TENANT[tenant_id is not None]
    params: dict[str, Any] = {"limit": limit}
    if tenant_id is not None:
        params["tenant_id"] = tenant_id

    async def once() -> tuple[list[Any], list[Any]]:
        async with engine.connect() as conn:
            in_flight = list(await conn.execute(RUNS[of], params))
            return in_flight, list(await conn.execute(QUEUED_RUNS[of], params))

    rows, queued = await retry_connection_errors(once, what="runs")
    waiting = [
        RunState(
            LeaseKey(row.tenant_id, row.execution_id),
            LeaseStatus.PENDING,
            None,
            int(row.epoch),
            row.graph,
            row.thread_id,
            True,
            run_id=row.run_id,
            queued=True,
            not_before=row.not_before,
        )
        for row in queued
    ]
    return [run_state(row) for row in rows] + waiting


async def served_graphs(engine: AsyncEngine) -> dict[str, list[str]]:
    """Graph name -> the workers that said they serve it within :data:`ANNOUNCED_FOR`."""
    async with engine.connect() as conn:
        rows = list(await conn.execute(WORKERS, {"since": time.time() - ANNOUNCED_FOR}))
    served: dict[str, list[str]] = {}
    for row in rows:
        for graph in json.loads(row.graphs):
            served.setdefault(graph, []).append(row.instance_id)
    return served

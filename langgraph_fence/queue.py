"""Runs any worker can take: submit, claim, output, cancel, and what a busy thread does.

``await instance.submit(graph_name, input, config, tenant_id=...)`` records the execution
(graph name, thread, input, and the run config as :mod:`langgraph_fence.run_config`
records it) and sets its lease ``pending`` with no holder, in one transaction, and returns
a :class:`SubmittedRun` at once. A pending lease with no holder is a takeover candidate: any
instance's :meth:`~langgraph_fence.Instance.serve` that serves the graph takes it in its one
guarded take statement (the next token), runs the recorded input under that lease, and
stores the output with the execution under the same guard before it releases the lease
``done``. Nothing here adds a second way to run: a claimed run is a taken-over run, so a
claimed-then-killed run is an expired lease like any other, and its takeover decides its
standing stamps as every takeover does (a non-idempotent write is never repeated).

Which checkpoint the input follows is pinned by the first claimer, under its lease, before
the input runs (:meth:`SubmittedRuns.pin`): a later taker that finds the thread still at that
checkpoint runs the input again (the first one died before its first checkpoint); one that
finds a newer checkpoint resumes from it. The input is never applied twice and never lost.

A thread's execution that is pending or running is busy: a submit of the same graph, input
and run config is the same submit again (idempotent: it returns that run, nothing written);
any other input is handled by ``on_busy``: ``"reject"`` (default) raises
:class:`~langgraph_fence.errors.ExecutionBusyError`; ``"interrupt"`` fences the run in flight
(its epoch moves on in the same transaction, so its next write, renewal or release is
refused as any stale writer's, and it drains) and leaves the new input pending for the next
claimer. Cancelling a run is the same fence, ending the execution ``failed``.

Only over a SQL lease store (SQLite or PostgreSQL, :meth:`Instance.open`): the queue is the
lease table every worker reads.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from collections.abc import AsyncIterator, Collection, Mapping, Sequence
from contextlib import asynccontextmanager
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Final, Literal

from sqlalchemy import text
from sqlalchemy.ext.asyncio import AsyncConnection, AsyncEngine

from .database import dialect_of, single_statement, transaction
from .errors import ExecutionBusyError, ExecutionEndedError, RunFailedError
from .guard import guard_sql
from .lease import Lease, LeaseKey, LeaseStatus, is_yielded
from .retry import retry_connection_errors
from .validate import positive_seconds, text_id

if TYPE_CHECKING:
    from langgraph.checkpoint.serde.base import SerializerProtocol

    from .fence import RunHandle
    from .run_config import RecordedRun

logger = logging.getLogger(__name__)

# LangGraph is imported by what submits and runs (run_config, serde), not by what lists:
# `langgraph-fence runs` reads this module without it (benchmarks/README.md, start-up).

__all__ = [
    "ANNOUNCED_FOR",
    "ANNOUNCE_EVERY",
    "NOTIFY_CHANNEL",
    "ON_BUSY",
    "OnBusy",
    "RunState",
    "SubmittedRun",
    "SubmittedRuns",
    "fair_order",
    "list_runs",
    "served_graphs",
]

OnBusy = Literal["reject", "interrupt"]
#: What a submit may do when the thread's execution is pending or running.
ON_BUSY: Final = ("reject", "interrupt")
_BUSY = (LeaseStatus.PENDING.value, LeaseStatus.RUNNING.value)
#: Statuses a submitted run ends in (``waiting``: it reached an interrupt).
_ENDED = frozenset({"done", "waiting", "failed", "dead_lettered"})

_KEY = "tenant_id = :tenant_id AND execution_id = :execution_id"
_HELD = guard_sql(
    tenant_id="l.tenant_id", execution_id="l.execution_id", holder=":holder", epoch=":epoch"
)
_HELD_HERE = (
    "EXISTS (SELECT 1 FROM fence_leases l WHERE l.tenant_id = fence_executions.tenant_id "
    f"AND l.execution_id = fence_executions.execution_id AND {_HELD})"
)
# A new key: pending at epoch 0 with no holder (the first claim takes epoch 1).
_INSERT_PENDING = text(
    "INSERT INTO fence_leases (tenant_id, execution_id, scope_key, epoch, holder, expires_at, "
    "status, pending_effects, reason, updated_at, takeovers, progress_mark) VALUES "
    "(:tenant_id, :execution_id, :scope_key, 0, NULL, NULL, 'pending', '{}', NULL, :at, 0, "
    "NULL) ON CONFLICT (tenant_id, execution_id) DO NOTHING RETURNING epoch"
)
_LEASE = "SELECT status, holder, epoch, reason FROM fence_leases WHERE " + _KEY
# A new turn of an execution that is not busy: pending again at the same epoch (the claim
# takes the next one). The stamp set stays: the take decides it, as for every take.
_REPEND = text(
    "UPDATE fence_leases SET status = 'pending', holder = NULL, expires_at = NULL, "
    "reason = NULL, updated_at = :at WHERE " + _KEY + " AND epoch = :epoch"
)
# The run in flight is fenced: its epoch moves on, so none of its writes lands again.
_FENCE = (
    "UPDATE fence_leases SET epoch = epoch + 1, holder = NULL, expires_at = NULL, "
    "status = :status, reason = :reason, updated_at = :at WHERE " + _KEY
)
_INTERRUPT = text(_FENCE + " AND epoch = :epoch")
# Pending, running, or yielded (waiting with its holder kept: its run goes on).
_CANCEL = text(
    _FENCE + " AND (status IN ('pending', 'running') OR (status = 'waiting' AND holder IS "
    "NOT NULL)) RETURNING epoch"
)
# A parent's children that no worker claimed yet (pending, no holder) never start.
_CANCEL_CHILDREN = text(
    "UPDATE fence_leases SET epoch = epoch + 1, status = 'failed', reason = :reason, "
    "updated_at = :at WHERE tenant_id = :tenant_id AND status = 'pending' AND holder IS NULL "
    "AND substr(execution_id, 1, :length) = :prefix"
)
# A yielded tree whose children have all ended becomes pending for any instance, from
# :not_before on (until then its waiter, usually alive, takes it again first); one statement,
# run after each child's end and after each yield, so whichever comes last sees every end.
_LIVE_CHILD = (
    "SELECT 1 FROM fence_leases c WHERE c.tenant_id = :tenant_id "
    "AND substr(c.execution_id, 1, :length) = :prefix AND (c.status IN ('pending', 'running') "
    "OR (c.status = 'waiting' AND c.holder IS NOT NULL))"
)
_WAKE = text(
    "UPDATE fence_leases SET status = 'pending', holder = NULL, expires_at = :not_before, "
    "updated_at = :at WHERE " + _KEY + " AND status = 'waiting' AND holder IS NOT NULL "
    "AND NOT EXISTS (" + _LIVE_CHILD + ") RETURNING epoch"
)
_RECORDED = text(
    "SELECT graph, input_type, input, run_type, run FROM fence_executions WHERE " + _KEY
)
_SUBMIT_RECORD = text(
    "INSERT INTO fence_executions (tenant_id, execution_id, graph, thread_id, input_type, "
    "input, run_type, run, recorded_at, submitted_at, input_after, output_type, output) "
    "VALUES (:tenant_id, :execution_id, :graph, :thread_id, :input_type, :input, :run_type, "
    ":run, :at, :at, NULL, NULL, NULL) ON CONFLICT (tenant_id, execution_id) DO UPDATE SET "
    "graph = excluded.graph, thread_id = excluded.thread_id, input_type = excluded.input_type, "
    "input = excluded.input, run_type = excluded.run_type, run = excluded.run, "
    "recorded_at = excluded.recorded_at, submitted_at = excluded.submitted_at, "
    "input_after = NULL, output_type = NULL, output = NULL"
)
# The record columns two submits must share to be the same submit again.
_SAME = ("graph", "input_type", "input", "run_type", "run")
# A child is recorded only under its parent's hold (the lease guard on the parent's row).
_PARENT_HELD = "SELECT 1 FROM fence_leases WHERE " + guard_sql(
    tenant_id=":ptenant", execution_id=":pexecution", holder=":holder", epoch=":epoch"
)
# The first claimer pins the checkpoint the input follows; every later taker reads it back.
_PIN = text(
    "UPDATE fence_executions SET input_after = COALESCE(input_after, :checkpoint) WHERE "
    + _KEY
    + " AND submitted_at IS NOT NULL AND "
    + _HELD_HERE
    + " RETURNING input_after"
)
_OUTPUT = text(
    "UPDATE fence_executions SET output_type = :output_type, output = :output WHERE "
    + _KEY
    + " AND submitted_at IS NOT NULL AND "
    + _HELD_HERE
)
# What a run's state is read from (the lease, and its record when there is one).
_STATE_COLUMNS = (
    "SELECT l.tenant_id, l.execution_id, l.status, l.holder, l.epoch, l.reason, l.expires_at, "
    "e.graph, e.thread_id, e.submitted_at"
)
_STATE = text(
    _STATE_COLUMNS + ", e.output_type, e.output FROM fence_leases l LEFT JOIN fence_executions e "
    "ON e.tenant_id = l.tenant_id AND e.execution_id = l.execution_id "
    "WHERE l.tenant_id = :tenant_id AND l.execution_id = :execution_id"
)
_RUNS = text(
    _STATE_COLUMNS + " FROM fence_leases l JOIN fence_executions e "
    "ON e.tenant_id = l.tenant_id AND e.execution_id = l.execution_id "
    "WHERE (l.status IN ('pending', 'running') OR (l.status = 'waiting' AND l.holder IS NOT "
    "NULL)) ORDER BY l.updated_at, l.scope_key LIMIT :limit"
)


#: The PostgreSQL channel a submit notifies (the payload: the graph name).
NOTIFY_CHANNEL = "langgraph_fence_runs"
_NOTIFY = text(f"SELECT pg_notify('{NOTIFY_CHANNEL}', :graph)")
_ANNOUNCE = text(
    "INSERT INTO fence_workers (instance_id, graphs, seen_at) VALUES (:instance_id, :graphs, "
    ":at) ON CONFLICT (instance_id) DO UPDATE SET graphs = excluded.graphs, "
    "seen_at = excluded.seen_at"
)
_RETIRE = text("DELETE FROM fence_workers WHERE instance_id = :instance_id")
_WORKERS = text("SELECT instance_id, graphs FROM fence_workers WHERE seen_at >= :since")
#: How often a serving instance says it is serving, and how long that holds (seconds).
ANNOUNCE_EVERY = 5.0
ANNOUNCED_FOR = 30.0


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


class SubmittedRuns:
    """The run queue on the lease table's database: submit, pin, output, state, cancel.

    Args:
        engine: the engine of the lease table (and the execution records).
        serde: the serializer of the recorded inputs and the outputs (the records' one).
    """

    def __init__(self, engine: AsyncEngine, serde: SerializerProtocol) -> None:
        self._engine = engine
        self._writer = single_statement(engine)
        self._pg = dialect_of(engine) == "postgresql"
        self.serde = serde

    # -- submit

    def check(
        self,
        graph_name: object,
        input: Any,
        config: Mapping[str, Any] | None,
        tenant_id: object,
        execution_id: object,
        on_busy: object,
        options: Mapping[str, Any],
    ) -> tuple[LeaseKey, str, RecordedRun]:
        """Every argument of a submit, checked before anything is written.

        Returns:
            the execution key, its thread id, and the recorded run config.

        Raises:
            ValueError: a bad argument, named with the fix (a non-serialisable input too).
            TypeError: ``config`` is not a mapping.
        """
        from .run_config import RECORDED_OPTIONS, record_run

        text_id("graph_name", graph_name, what="the name a worker serves the graph under")
        text_id("tenant_id", tenant_id, what="the tenant the execution and its thread belong to")
        if on_busy not in ON_BUSY:
            raise ValueError(
                f"on_busy must be one of {', '.join(map(repr, ON_BUSY))} (what a submit does "
                f"when the thread's run is pending or running), got {on_busy!r}"
            )
        if config is not None and not isinstance(config, Mapping):
            raise TypeError(f"config must be a dict (a RunnableConfig), got {config!r}")
        unknown = sorted(set(options) - set(RECORDED_OPTIONS))
        if unknown:
            raise ValueError(
                f"submit got unknown options {unknown}: it takes the options a run records "
                f"({', '.join(RECORDED_OPTIONS)})"
            )
        configurable = dict((config or {}).get("configurable") or {})
        thread_id = text_id(
            "config['configurable']['thread_id']",
            configurable.get("thread_id"),
            what="a submitted run is one thread, e.g. {'configurable': {'thread_id': 'order-42'}}",
        )
        given = configurable.get("tenant_id")
        if given is not None and given != tenant_id:
            raise ValueError(
                f"config['configurable']['tenant_id'] is {given!r} and tenant_id is "
                f"{tenant_id!r}: a run is of one tenant; pass the same tenant in both"
            )
        if execution_id is None:
            execution_id = thread_id
        text_id("execution_id", execution_id, what="the lease's execution id")
        if input is None:
            raise ValueError(
                "input must be the graph's input: a submitted run starts from it (to resume "
                "a thread, use instance.ainvoke(graph, None, config, ...))"
            )
        self._check_storable(input)
        run = record_run(config or {}, options, serde=self.serde)
        return LeaseKey(str(tenant_id), str(execution_id)), thread_id, run

    def _check_storable(self, input: Any) -> None:
        from .serde import loads_checked

        try:
            loads_checked(self.serde, self.serde.dumps_typed(input), what="the input")
        except Exception as exc:
            raise ValueError(
                f"input cannot be recorded with the execution ({type(exc).__name__}: {exc}): "
                "a worker in another process runs it from the record, so it must be storable "
                "data (str, numbers, lists, dicts, or types LANGGRAPH_STRICT_MSGPACK allows). "
                "Refused before anything was written"
            ) from exc

    async def submit(
        self,
        key: LeaseKey,
        graph_name: str,
        thread_id: str,
        input: Any,
        run: RecordedRun,
        on_busy: OnBusy,
    ) -> bool:
        """Record the run and set the lease pending, in one transaction; whether it was
        written (``False``: the same run is pending or running already).

        Raises:
            ExecutionBusyError: the execution is busy with other input and ``on_busy`` is
                ``"reject"``; nothing written.
            ExecutionEndedError: the execution was dead-lettered; nothing written.
        """
        record = self._record(graph_name, thread_id, input, run)
        params = {"tenant_id": key.tenant_id, "execution_id": key.execution_id}
        at = time.time()

        async def once() -> bool:
            async with transaction(self._engine) as conn:
                created = await conn.execute(
                    _INSERT_PENDING, {**params, "scope_key": key.scope_key, "at": at}
                )
                if created.first() is None:
                    lease = (await conn.execute(text(_LEASE + self._lock), params)).one()
                    if lease.status == LeaseStatus.DEAD_LETTERED.value:
                        raise _dead_lettered(key, lease.reason)
                    # A yielded execution's run goes on (it waits for its children).
                    if lease.status in _BUSY or is_yielded(lease.status, lease.holder):
                        same = tuple(record[k] for k in _SAME)
                        if await self._recorded(conn, params) == same:
                            return False  # the same submit again: that run
                        if on_busy == "reject":
                            raise _busy(key, lease.status, lease.holder)
                        reason = f"interrupted by a submit of new input at {at:.3f}"
                        interrupt = {**params, "epoch": lease.epoch, "at": at}
                        await conn.execute(
                            _INTERRUPT, {**interrupt, "status": "pending", "reason": reason}
                        )
                    else:
                        await conn.execute(_REPEND, {**params, "epoch": lease.epoch, "at": at})
                if self._pg:
                    # Delivered on commit: a waiting serve() looks at once.
                    await conn.execute(_NOTIFY, {"graph": graph_name})
                await conn.execute(_SUBMIT_RECORD, {**params, **record, "at": at})
                return True

        return await retry_connection_errors(once, what="submit")

    async def submit_child(
        self,
        parent: Lease,
        key: LeaseKey,
        graph_name: str,
        thread_id: str,
        input: Any,
        run: RecordedRun,
    ) -> bool | None:
        """Record a child run and set its lease pending, in one transaction guarded by the
        parent's hold (:mod:`langgraph_fence.children`); whether it was written.

        ``False``: the child's key exists already (the parent step ran again): nothing
        written, the child stays as it is. ``None``: ``parent`` is no longer held (taken
        over, or ended): nothing written.
        """
        record = self._record(graph_name, thread_id, input, run)
        params = {"tenant_id": key.tenant_id, "execution_id": key.execution_id}
        held = {
            "ptenant": parent.key.tenant_id,
            "pexecution": parent.key.execution_id,
            "holder": parent.holder,
            "epoch": parent.epoch,
        }
        at = time.time()

        async def once() -> bool | None:
            async with transaction(self._engine) as conn:
                # The parent's row, locked (PostgreSQL) or serialised (SQLite's BEGIN
                # IMMEDIATE): a takeover of the parent waits for this transaction, so the
                # child is recorded only while the parent's token is the lease's.
                if (await conn.execute(text(_PARENT_HELD + self._lock), held)).first() is None:
                    return None
                created = await conn.execute(
                    _INSERT_PENDING, {**params, "scope_key": key.scope_key, "at": at}
                )
                if created.first() is None:
                    return False
                if self._pg:
                    await conn.execute(_NOTIFY, {"graph": graph_name})
                await conn.execute(_SUBMIT_RECORD, {**params, **record, "at": at})
                return True

        return await retry_connection_errors(once, what="spawn child")

    def _record(
        self, graph_name: str, thread_id: str, input: Any, run: RecordedRun
    ) -> dict[str, Any]:
        """The record columns of a submitted run (its input and run config serialised)."""
        input_type, blob = self.serde.dumps_typed(input)
        run_type, run_blob = self.serde.dumps_typed(run.as_payload())
        return {
            "graph": graph_name,
            "thread_id": thread_id,
            "input_type": input_type,
            "input": blob,
            "run_type": run_type,
            "run": run_blob,
        }

    @property
    def _lock(self) -> str:
        # PostgreSQL: two submits of one key wait for each other; SQLite's BEGIN IMMEDIATE
        # serialises every writer already.
        return " FOR UPDATE" if self._pg else ""

    async def _recorded(self, conn: AsyncConnection, params: Mapping[str, str]) -> Any:
        row = (await conn.execute(_RECORDED, dict(params))).first()
        if row is None:
            return None
        return (row.graph, row.input_type, bytes(row.input), row.run_type, bytes(row.run or b""))

    # -- the claimer's side

    async def pin(self, lease: Lease, checkpoint_id: str | None) -> str | None:
        """For a submitted run just taken under ``lease``: the checkpoint its input follows
        (``""``: none), pinned to ``checkpoint_id`` by the first claimer; ``None`` for a
        run that was not submitted (or a lease no longer held). One guarded statement."""

        async def once() -> str | None:
            async with self._writer.begin() as conn:
                row = (
                    await conn.execute(
                        _PIN,
                        {
                            "tenant_id": lease.key.tenant_id,
                            "execution_id": lease.key.execution_id,
                            "holder": lease.holder,
                            "epoch": lease.epoch,
                            "checkpoint": checkpoint_id or "",
                        },
                    )
                ).first()
                return None if row is None else str(row.input_after)

        return await retry_connection_errors(once, what="submitted run pin")

    async def store_output(self, handle: RunHandle, output: Any) -> None:
        """Keep ``output`` with the execution, guarded by the run's hold (one statement).

        Raises:
            ExecutionFencedError: the run was taken over, cancelled or interrupted: its
                output is refused as any stale write.
            ValueError: the output cannot be stored (the run then ends ``failed``).
        """
        try:
            output_type, blob = self.serde.dumps_typed(output)
        except Exception as exc:
            raise ValueError(
                f"the output of execution {handle.scope_key!r} cannot be stored "
                f"({type(exc).__name__}: {exc})"
            ) from exc
        lease = handle.lease

        async def once() -> int:
            async with self._writer.begin() as conn:
                result = await conn.execute(
                    _OUTPUT,
                    {
                        "tenant_id": lease.key.tenant_id,
                        "execution_id": lease.key.execution_id,
                        "holder": lease.holder,
                        "epoch": lease.epoch,
                        "output_type": output_type,
                        "output": blob,
                    },
                )
                return int(result.rowcount)

        if not await retry_connection_errors(once, what="submitted run output"):
            await handle.renew()  # raises the fencing error the refusal means
            raise RuntimeError(f"the output of {handle.scope_key!r} was refused")

    # -- any process's side

    async def state(self, key: LeaseKey) -> tuple[RunState, Any] | None:
        """The execution's state and stored output (``None`` for none), or ``None``."""

        async def once() -> Any:
            async with self._engine.connect() as conn:
                params = {"tenant_id": key.tenant_id, "execution_id": key.execution_id}
                return (await conn.execute(_STATE, params)).first()

        row = await retry_connection_errors(once, what="submitted run state")
        if row is None:
            return None
        return _run_state(row), (row.output_type, row.output)

    def decode_output(
        self, key: LeaseKey, stored: tuple[Any, Any], allow: Collection[tuple[str, ...]]
    ) -> Any:
        """The output :meth:`store_output` kept, decoded with the serializer (and ``allow``)."""
        from .serde import loads_checked, with_allowlist

        output_type, blob = stored
        if output_type is None:
            return None
        serde = with_allowlist(self.serde, allow)
        return loads_checked(
            serde, (output_type, bytes(blob)), what=f"the output of execution {key.scope_key!r}"
        )

    async def cancel(self, key: LeaseKey, reason: str) -> bool:
        """End the execution ``failed`` with ``reason`` if it is pending or running; whether
        it was. A running one is fenced (its epoch moves on): its next write, renewal or
        release is refused and it drains. Its ``ANY_INSTANCE`` children that no worker
        has claimed yet end ``failed`` with it, in the same transaction (they never start);
        children already running run to their end (:mod:`langgraph_fence.children`)."""
        params = {
            "tenant_id": key.tenant_id,
            "execution_id": key.execution_id,
            "status": LeaseStatus.FAILED.value,
            "reason": reason,
            "at": time.time(),
        }
        # A child's id is its parent's scope key, ':', and its key (children.py).
        prefix = key.scope_key + ":"
        children = {
            "tenant_id": key.tenant_id,
            "prefix": prefix,
            "length": len(prefix),
            "reason": f"its parent {key.scope_key!r} was cancelled before it started",
            "at": params["at"],
        }

        async def once() -> bool:
            async with transaction(self._engine) as conn:
                cancelled = (await conn.execute(_CANCEL, params)).first() is not None
                if cancelled:
                    await conn.execute(_CANCEL_CHILDREN, children)
                return cancelled

        return await retry_connection_errors(once, what="cancel")

    async def wake_yielded(self, parent: LeaseKey, not_before: float) -> bool:
        """Make ``parent`` pending (runnable by any instance's ``serve()`` from
        ``not_before`` on, store clock) if it is yielded and none of its children is still
        pending, running or yielded itself; whether it was. Serving instances are woken
        (PostgreSQL NOTIFY), so a waiter that died never strands its tree."""
        prefix = parent.scope_key + ":"  # a child's id: its parent's scope key, ':', its key
        params = {
            "tenant_id": parent.tenant_id,
            "execution_id": parent.execution_id,
            "prefix": prefix,
            "length": len(prefix),
            "not_before": not_before,
            "at": time.time(),
        }

        async def once() -> bool:
            async with transaction(self._engine) as conn:
                woken = (await conn.execute(_WAKE, params)).first() is not None
                if woken and self._pg:
                    await conn.execute(_NOTIFY, {"graph": ""})
                return woken

        return await retry_connection_errors(once, what="wake a yielded tree")

    async def runs(self, limit: int = 1000) -> list[RunState]:
        """Every pending, running and yielded execution (with its worker), oldest first."""
        return await list_runs(self._engine, limit)

    @asynccontextmanager
    async def wakeups(self, wake: asyncio.Event) -> AsyncIterator[bool]:
        """Set ``wake`` whenever a run is submitted, while the block runs; yields whether it
        will (PostgreSQL: a connection of the pool LISTENs on :data:`NOTIFY_CHANNEL`;
        SQLite, or a connection that cannot listen: never, and the caller polls). A
        connection the database drops later is not listened on again: the caller's polling
        finds the runs from then on."""
        if not self._pg:
            yield False
            return

        def notified(*_: Any) -> None:
            wake.set()

        try:
            conn = await self._engine.connect()
        except Exception as exc:
            logger.info("serve: cannot LISTEN for submits (%s); polling only", exc)
            yield False
            return
        try:
            driver: Any = None
            try:
                driver = (await conn.get_raw_connection()).driver_connection
                await driver.add_listener(NOTIFY_CHANNEL, notified)
            except Exception as exc:
                logger.info("serve: cannot LISTEN for submits (%s); polling only", exc)
                driver = None
            try:
                yield driver is not None
            finally:
                if driver is not None:
                    try:
                        await driver.remove_listener(NOTIFY_CHANNEL, notified)
                    except Exception:
                        logger.debug("serve: UNLISTEN failed", exc_info=True)
        finally:
            try:
                await conn.close()
            except Exception:
                # A connection the database dropped (a restart): nothing left to give back.
                logger.debug("serve: closing the LISTEN connection failed", exc_info=True)

    # -- who serves what

    async def announce(self, instance_id: str, graphs: Collection[str]) -> None:
        """Say that ``instance_id`` serves ``graphs`` now (one upsert)."""
        async with self._writer.begin() as conn:
            params = {"instance_id": instance_id, "graphs": json.dumps(sorted(graphs))}
            await conn.execute(_ANNOUNCE, {**params, "at": time.time()})

    async def retire(self, instance_id: str) -> None:
        """Say that ``instance_id`` serves nothing any more (it stopped)."""
        async with self._writer.begin() as conn:
            await conn.execute(_RETIRE, {"instance_id": instance_id})

    async def served(self) -> dict[str, list[str]]:
        """Graph name -> the workers that said they serve it within :data:`ANNOUNCED_FOR`."""
        return await served_graphs(self._engine)


async def list_runs(engine: AsyncEngine, limit: int = 1000) -> list[RunState]:
    """Every pending, running and yielded execution on ``engine``'s database that has a
    record (with its worker), oldest first."""

    async def once() -> list[Any]:
        async with engine.connect() as conn:
            return list(await conn.execute(_RUNS, {"limit": limit}))

    rows = await retry_connection_errors(once, what="runs")
    return [_run_state(row) for row in rows]


async def served_graphs(engine: AsyncEngine) -> dict[str, list[str]]:
    """Graph name -> the workers that said they serve it within :data:`ANNOUNCED_FOR`."""
    async with engine.connect() as conn:
        rows = list(await conn.execute(_WORKERS, {"since": time.time() - ANNOUNCED_FOR}))
    served: dict[str, list[str]] = {}
    for row in rows:
        for graph in json.loads(row.graphs):
            served.setdefault(graph, []).append(row.instance_id)
    return served


class SubmittedRun:
    """A handle on a submitted run, from the process that submitted it or any other
    (:meth:`Instance.get_run <langgraph_fence.Instance.get_run>`).

    Attributes:
        key: the execution.
    """

    def __init__(self, queue: SubmittedRuns, key: LeaseKey) -> None:
        self._queue = queue
        self.key = key

    def __repr__(self) -> str:
        return f"SubmittedRun({self.key.scope_key!r})"

    @property
    def scope_key(self) -> str:
        """The execution's scope key."""
        return self.key.scope_key

    async def state(self) -> RunState:
        """Where the run stands now (one read).

        Raises:
            KeyError: no execution of that key exists.
        """
        found = await self._queue.state(self.key)
        if found is None:
            raise KeyError(f"no execution {self.key.scope_key!r}: nothing was submitted under it")
        return found[0]

    async def result(
        self,
        timeout: float | None = None,  # noqa: ASYNC109 - the API is result(timeout=...)
        *,
        poll_interval: float = 0.05,
        allow: Collection[tuple[str, ...]] = (),
    ) -> Any:
        """Wait for the run's end and return its output (what ``graph.ainvoke`` returned).

        A run that reached an interrupt ends ``waiting``: its output is the state with
        ``__interrupt__``, as ``ainvoke`` returns it.

        Args:
            timeout: seconds to wait (``None``: as long as it takes).
            poll_interval: the longest pause between looks (they start faster).
            allow: ``(module, name)`` pairs the output may construct besides what the
                serializer allows (your state types).

        Raises:
            RunFailedError: the run ended ``failed`` (its error, or cancelled) or
                ``dead_lettered``; the message names the execution, its end and why.
            TimeoutError: it had not ended within ``timeout``.
            KeyError: no execution of that key exists.
        """
        if timeout is not None:
            timeout = positive_seconds("timeout", timeout, what="how long result() waits")
        pause = positive_seconds("poll_interval", poll_interval, what="between looks")
        loop = asyncio.get_running_loop()
        deadline = None if timeout is None else loop.time() + timeout
        wait = min(0.005, pause)
        while True:
            found = await self._queue.state(self.key)
            if found is None:
                raise KeyError(f"no execution {self.key.scope_key!r}: nothing was submitted")
            state, stored = found
            # A yielded run (waiting for its children, holder kept) has not ended.
            if state.status.value in _ENDED and not is_yielded(state.status, state.holder):
                return self._end(state, stored, allow)
            if deadline is not None and loop.time() >= deadline:
                raise TimeoutError(
                    f"execution {self.key.scope_key!r} had not ended after {timeout:g} s (it is "
                    f"{state.status.value}, held by {state.holder or 'no worker'} at token "
                    f"{state.epoch}): is a worker serving graph {state.graph!r}? See "
                    "`langgraph-fence runs`"
                )
            left = pause if deadline is None else max(0.0, deadline - loop.time())
            await asyncio.sleep(min(wait, left))
            wait = min(wait * 2, pause)

    def _end(self, state: RunState, stored: tuple[Any, Any], allow: Collection[Any]) -> Any:
        if state.status in (LeaseStatus.DONE, LeaseStatus.WAITING):
            return self._queue.decode_output(self.key, stored, allow)
        raise RunFailedError(
            f"execution {self.key.scope_key!r} (graph {state.graph!r}, thread "
            f"{state.thread_id!r}) ended {state.status.value} at token {state.epoch}: "
            f"{state.reason or 'no reason recorded'}",
            scope_key=self.key.scope_key,
            status=state.status.value,
            reason=state.reason,
        )

    async def cancel(self) -> bool:
        """Cancel the run: a pending one never starts, a running one is fenced (its next
        write is refused and it drains); it ends ``failed`` with the reason "cancelled".
        Whether it was still pending or running. Guarantee 3 stands: a non-idempotent write
        it stamped is not repeated by a later run of the thread (that run dead-letters)."""
        return await self._queue.cancel(self.key, "cancelled by SubmittedRun.cancel()")


def _run_state(row: Any) -> RunState:
    """A row of :data:`_STATE_COLUMNS` as a :class:`RunState`."""
    return RunState(
        LeaseKey(row.tenant_id, row.execution_id),
        LeaseStatus(row.status),
        row.holder,
        int(row.epoch),
        row.graph,
        row.thread_id,
        row.submitted_at is not None,
        row.reason,
        row.expires_at,
    )


def fair_order(candidates: Sequence[Lease], after_tenant: str | None) -> list[Lease]:
    """``candidates`` in the order a worker claims them: round-robin by tenant.

    Each tenant's first candidate (in the given order: its oldest), then each one's second,
    and so on; among the tenants at one rank, those after ``after_tenant`` (the tenant this
    worker claimed for last) come first, in tenant order, then the rest. So one tenant's
    burst does not starve the others, even one claim per look. The store's candidate query
    ranks the same way, so a window of candidates holds every waiting tenant's oldest.
    """
    seen: dict[str, int] = {}
    ranked = []
    for index, lease in enumerate(candidates):
        tenant = lease.key.tenant_id
        rank = seen[tenant] = seen.get(tenant, -1) + 1
        wrapped = after_tenant is not None and tenant <= after_tenant
        ranked.append(((rank, wrapped, tenant, index), lease))
    ranked.sort(key=lambda pair: pair[0])
    return [lease for _, lease in ranked]


def _busy(key: LeaseKey, status: str, holder: str | None) -> ExecutionBusyError:
    who = f"running on {holder}" if status == "running" and holder else status
    return ExecutionBusyError(
        f"execution {key.scope_key!r} is {who} with other input: refused (on_busy='reject'), "
        "nothing written. Wait for it (await instance.get_run(...).result()), or submit with "
        "on_busy='interrupt' to fence it and run the new input next",
        scope_key=key.scope_key,
        status=status,
    )


def _dead_lettered(key: LeaseKey, reason: str | None) -> ExecutionEndedError:
    extra = f" ({reason})" if reason else ""
    return ExecutionEndedError(
        f"execution {key.scope_key!r} was dead-lettered{extra}: nothing was submitted. Inspect "
        "it with `langgraph-fence dead-letters`; `langgraph-fence resolve` decides it",
        status=LeaseStatus.DEAD_LETTERED.value,
        reason=reason,
    )

"""Schedules: a cron expression in a time zone that submits one run of a graph on a thread
at each tick, whichever worker fires it, once.

A tick fires in one transaction that locks the schedule's row, submits the tick's run
(:func:`~langgraph_fence.queue._submit.submit_in`: the run's row, record and pending lease)
and moves ``next_tick`` on past it. Two workers that find the same tick due serialise on
the row (PostgreSQL's row lock, SQLite's write lock); the second finds ``next_tick`` moved
and fires nothing. A worker killed or cut off before the commit fires nothing (the
transaction rolls back and the tick is still due); one that committed fired it. So each
tick fires exactly once, and the time that decides it is the store's clock, never a
worker's.
"""

from __future__ import annotations

import logging
import time
import uuid
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass
from datetime import UTC, datetime
from functools import partial
from typing import TYPE_CHECKING, Any, Final, Literal

from sqlalchemy import text
from sqlalchemy.ext.asyncio import AsyncConnection

from langgraph_fence.database import transaction
from langgraph_fence.database.retry import retry_connection_errors
from langgraph_fence.errors import ExecutionBusyError, ExecutionEndedError
from langgraph_fence.lease import LeaseKey
from langgraph_fence.lease.scope import refuse_child_ids
from langgraph_fence.queue._checks import OnBusy
from langgraph_fence.queue._database import QueueDatabase
from langgraph_fence.queue._submit import submit_in
from langgraph_fence.queue._ticks import check_cron, check_timezone, tick_until
from langgraph_fence.validate import MAX_ID_BYTES, MAX_SECONDS, text_id

if TYPE_CHECKING:
    from langgraph.checkpoint.serde.base import SerializerProtocol

    from langgraph_fence.lease.run_config import RecordedRun

logger = logging.getLogger("langgraph_fence.queue")

__all__ = ["MISSED", "OVERLAP", "Missed", "Overlap", "Schedule", "Schedules"]

Overlap = Literal["skip", "enqueue", "cancel_previous"]
#: What a tick does when the schedule's previous run is still pending or running.
OVERLAP: Final = ("skip", "enqueue", "cancel_previous")
Missed = Literal["skip", "run_one"]
#: What happens to ticks found later than their grace (the fleet was down or paused).
MISSED: Final = ("skip", "run_one")
# A tick's overlap policy as a submit's on_busy.
_ON_BUSY: Final[dict[str, OnBusy]] = {
    "skip": "reject",
    "enqueue": "enqueue",
    "cancel_previous": "interrupt",
}
#: The most ticks one firing submits; the rest stay due for the next look.
MAX_TICKS_PER_FIRING = 1000

_KEY = "tenant_id = :tenant_id AND schedule_id = :schedule_id"
_COLUMNS = (
    "tenant_id, schedule_id, graph, thread_id, execution_id, cron, timezone, overlap, missed, "
    "grace, paused, end_at, next_tick, last_tick, fired, skipped, created_at"
)
_DEFINITION = (
    "graph, thread_id, execution_id, input_type, input, run_type, run, cron, timezone, "
    "overlap, missed, grace, end_at"
)
_INSERT = (
    f"INSERT INTO fence_schedules (tenant_id, schedule_id, {_DEFINITION}, paused, next_tick, "
    "last_tick, fired, skipped, created_at) VALUES (:tenant_id, :schedule_id, :graph, "
    ":thread_id, :execution_id, :input_type, :input, :run_type, :run, :cron, :timezone, "
    ":overlap, :missed, :grace, :end_at, 0, :next_tick, NULL, 0, 0, :at) "
    "ON CONFLICT (tenant_id, schedule_id) DO "
)
CREATE = text(_INSERT + "NOTHING RETURNING schedule_id")
REPLACE = text(
    _INSERT
    + "UPDATE SET "
    + ", ".join(f"{c} = excluded.{c}" for c in _DEFINITION.split(", "))
    + ", paused = 0, next_tick = excluded.next_tick RETURNING schedule_id"
)
GET = text(f"SELECT {_COLUMNS} FROM fence_schedules WHERE {_KEY}")
LIST = {
    of: text(
        f"SELECT {_COLUMNS} FROM fence_schedules {of}ORDER BY tenant_id, schedule_id LIMIT :limit"
    )
    for of in ("", "WHERE tenant_id = :tenant_id ")
}
PAUSE = text(f"UPDATE fence_schedules SET paused = 1 WHERE {_KEY}")
RESUME = text(
    f"UPDATE fence_schedules SET paused = 0, next_tick = :next_tick WHERE {_KEY} AND paused = 1"
)
DELETE = text(f"DELETE FROM fence_schedules WHERE {_KEY}")


@dataclass(frozen=True, slots=True)
class Schedule:
    """A schedule as the database holds it.

    Attributes:
        tenant_id: the tenant its runs are of.
        schedule_id: its id, unique in the tenant.
        graph: the graph name its runs are submitted under.
        thread_id: the thread each tick's run is a turn of.
        execution_id: the execution of that thread.
        cron: its cron expression.
        timezone: the time zone its cron's hours are in.
        overlap: what a tick does when the previous run is still pending or running.
        missed: what happens to ticks found later than ``grace``.
        grace: how late (seconds) a tick may be found and still fire.
        paused: no tick fires while paused.
        end_at: no tick after this time fires (epoch seconds), or ``None``.
        next_tick: the next tick (epoch seconds, store clock), or ``None``: it has ended.
        last_tick: the last tick that fired or was skipped, or ``None``.
        fired: how many ticks submitted a run.
        skipped: how many ticks did not (missed, or ``overlap="skip"`` on a busy thread).
        created_at: when it was created (epoch seconds).
    """

    tenant_id: str
    schedule_id: str
    graph: str
    thread_id: str
    execution_id: str
    cron: str
    timezone: str
    overlap: Overlap
    missed: Missed
    grace: float
    paused: bool
    end_at: float | None
    next_tick: float | None
    last_tick: float | None
    fired: int
    skipped: int
    created_at: float

    @classmethod
    def from_row(cls, row: Any) -> Schedule:
        """A row of ``fence_schedules``."""
        return cls(
            row.tenant_id,
            row.schedule_id,
            row.graph,
            row.thread_id,
            row.execution_id,
            row.cron,
            row.timezone,
            row.overlap,
            row.missed,
            float(row.grace),
            bool(row.paused),
            row.end_at,
            row.next_tick,
            row.last_tick,
            int(row.fired),
            int(row.skipped),
            float(row.created_at),
        )


@dataclass(frozen=True, slots=True)
class _Firing:
    """What one firing of a schedule decided: the ticks to submit, how many it skipped,
    and the schedule's next tick after them."""

    submit: list[float]
    skipped: int
    last: float | None
    next: float | None


def plan_firing(row: Any, now: float) -> _Firing:
    """Which of ``row``'s due ticks (``next_tick`` up to ``now``, store clock) fire: those at
    most ``grace`` late; of the later ones none (``missed="skip"``) or the newest
    (``"run_one"``). At most :data:`MAX_TICKS_PER_FIRING`; the rest stay due."""
    due: list[float] = []
    tick: float | None = row.next_tick
    while tick is not None and tick <= now and len(due) < MAX_TICKS_PER_FIRING:
        due.append(tick)
        tick = tick_until(row.cron, row.timezone, tick, row.end_at)
    late = [t for t in due if now - t > row.grace]
    submit = [t for t in due if now - t <= row.grace]
    if late and row.missed == "run_one":
        submit.insert(0, late[-1])
    return _Firing(submit, len(due) - len(submit), due[-1] if due else None, tick)


class Schedules:
    """Schedules on the run queue's database: create, read, pause, resume, delete, and the
    firing of due ticks that each worker's ``serve()`` does at every look."""

    def __init__(
        self,
        db: QueueDatabase,
        serde: SerializerProtocol,
        check: Callable[..., tuple[LeaseKey, str, RecordedRun]],
        bind: Callable[[LeaseKey, str], Awaitable[None]] | None,
    ) -> None:
        self._db = db
        self._serde = serde
        self._check = check
        self._bind = bind
        self._due = text(
            "SELECT tenant_id, schedule_id FROM fence_schedules WHERE paused = 0 AND "
            f"next_tick IS NOT NULL AND next_tick <= {db.store.now_sql} ORDER BY next_tick "
            "LIMIT :limit"
        )
        self._lock_due = text(
            f"SELECT cron, timezone, overlap, missed, grace, end_at, next_tick, graph, "
            f"thread_id, execution_id, input_type, input, run_type, run, "
            f"{db.store.now_sql} AS now FROM fence_schedules WHERE {_KEY} AND paused = 0 AND "
            f"next_tick IS NOT NULL AND next_tick <= {db.store.now_sql}"
            # Another worker firing it now: passed over (it fires it; if it fails, the
            # tick is still due at the next look).
            + (" FOR UPDATE SKIP LOCKED" if db.pg else "")
        )
        self._advance = text(
            "UPDATE fence_schedules SET next_tick = :next, last_tick = :last, "
            f"fired = fired + :fired, skipped = skipped + :skipped WHERE {_KEY} "
            "AND next_tick = :tick"
        )
        self._last_tick = text(
            f"SELECT last_tick FROM fence_schedules WHERE {_KEY}" + (" FOR UPDATE" if db.pg else "")
        )

    async def create(
        self,
        schedule_id: str,
        graph_name: str,
        input: Any,
        config: Mapping[str, Any] | None = None,
        *,
        tenant_id: str,
        cron: str,
        timezone: str = "UTC",
        overlap: Overlap = "skip",
        missed: Missed = "skip",
        grace: float = 60.0,
        end_at: datetime | None = None,
        execution_id: str | None = None,
        replace: bool = False,
        **options: Any,
    ) -> Schedule:
        """Create the schedule ``schedule_id`` of ``tenant_id``: at each tick of ``cron`` in
        ``timezone`` (judged by the database's clock), one run of ``graph_name`` with
        ``input`` and ``config`` is submitted on the config's thread, as
        :meth:`~langgraph_fence.Instance.submit` submits it. Each tick fires exactly once
        across every worker, through kills and database restarts. The run's
        ``config["metadata"]`` carries ``schedule_id`` and ``scheduled_for`` (the tick, ISO
        8601 in UTC).

        Args:
            schedule_id: its id, unique in the tenant.
            graph_name: the name a worker serves the graph under.
            input: each run's input (storable data).
            config: the run config; ``config["configurable"]["thread_id"]`` is required:
                each tick's run is a new turn of that thread.
            tenant_id: the tenant.
            cron: 5 fields (``"0 9 * * MON-FRI"``), or 6 with seconds last.
            timezone: an IANA time zone name (default ``"UTC"``).
            overlap: when the thread's previous run is still pending or running:
                ``"skip"`` (default: the tick is counted skipped), ``"enqueue"`` (it runs
                after it), ``"cancel_previous"`` (that run is fenced and ends ``failed``;
                the tick's runs next).
            missed: ticks found more than ``grace`` seconds late (the fleet was down):
                ``"skip"`` (default) or ``"run_one"`` (one run for the newest of them).
            grace: how late a tick may be found and still fire (seconds, default 60).
            end_at: no tick after this (an aware ``datetime``).
            execution_id: the execution of the thread (default: the thread id).
            replace: replace an existing schedule of that id (its counts are kept);
                without it an existing one is refused.
            **options: recorded ``ainvoke`` options (``context``, ``durability``, ...).

        Raises:
            ValueError: a bad argument, named with the fix; or the schedule exists and
                ``replace`` is false. Nothing written.
            ExecutionThreadBoundError: the thread belongs to another execution id.
        """
        text_id("schedule_id", schedule_id, what="the schedule's id", max_bytes=MAX_ID_BYTES)
        check_cron(cron)
        check_timezone(timezone)
        if overlap not in OVERLAP:
            raise ValueError(
                f"overlap must be one of {', '.join(map(repr, OVERLAP))} (what a tick does "
                f"while the previous run is pending or running), got {overlap!r}"
            )
        if missed not in MISSED:
            raise ValueError(
                f"missed must be one of {', '.join(map(repr, MISSED))} (what happens to ticks "
                f"found more than grace seconds late), got {missed!r}"
            )
        if (
            isinstance(grace, bool)
            or not isinstance(grace, int | float)
            or not 0 <= grace <= MAX_SECONDS
        ):
            raise ValueError(f"grace must be 0 to {MAX_SECONDS:.0e} seconds, got {grace!r}")
        end = _end_at(end_at)
        key, thread_id, run = self._check(
            graph_name, input, config, tenant_id, execution_id, "reject", options
        )
        refuse_child_ids(thread_id, key.execution_id)
        if self._bind is not None:
            await self._bind(key, thread_id)
        input_type, blob = self._serde.dumps_typed(input)
        run_type, run_blob = self._serde.dumps_typed(run.as_payload())
        params = {
            "tenant_id": key.tenant_id,
            "schedule_id": schedule_id,
            "graph": graph_name,
            "thread_id": thread_id,
            "execution_id": key.execution_id,
            "input_type": input_type,
            "input": blob,
            "run_type": run_type,
            "run": run_blob,
            "cron": cron,
            "timezone": timezone,
            "overlap": overlap,
            "missed": missed,
            "grace": float(grace),
            "end_at": end,
            "at": time.time(),
        }

        params_key = {"tenant_id": key.tenant_id, "schedule_id": schedule_id}

        async def once() -> bool:
            async with transaction(self._db.engine) as conn:
                # The row first (PostgreSQL: waits for a firing in progress, then sees its
                # commit): a replace never moves next_tick back to a tick already fired.
                last = (await conn.execute(self._last_tick, dict(params_key))).first()
                now = await self._db.store_now(conn)
                if last is not None and last.last_tick is not None:
                    now = max(now, float(last.last_tick))
                first = tick_until(cron, timezone, now, end)
                statement = REPLACE if replace else CREATE
                made = await conn.execute(statement, {**params, "next_tick": first})
                return made.first() is not None

        if not await retry_connection_errors(once, what="schedule"):
            raise ValueError(
                f"schedule {schedule_id!r} of tenant {key.tenant_id!r} exists: nothing "
                "written. Pass replace=True to replace its definition, or delete it first"
            )
        found = await self.get(schedule_id, tenant_id=key.tenant_id)
        assert found is not None  # made above, and only a delete removes it
        return found

    async def get(self, schedule_id: str, *, tenant_id: str) -> Schedule | None:
        """The schedule, or ``None``."""
        row = await self._db.first(
            GET, {"tenant_id": tenant_id, "schedule_id": schedule_id}, what="schedule"
        )
        return None if row is None else Schedule.from_row(row)

    async def list(self, *, tenant_id: str | None = None, limit: int = 1000) -> list[Schedule]:
        """Every schedule (of ``tenant_id`` only, when given), by tenant and id."""
        params: dict[str, Any] = {"limit": limit}
        if tenant_id is not None:
            params["tenant_id"] = tenant_id
        statement = LIST["" if tenant_id is None else "WHERE tenant_id = :tenant_id "]

        async def once() -> list[Any]:
            async with self._db.engine.connect() as conn:
                return list(await conn.execute(statement, params))

        return [Schedule.from_row(r) for r in await retry_connection_errors(once, what="schedules")]

    async def pause(self, schedule_id: str, *, tenant_id: str) -> bool:
        """Fire no tick until :meth:`resume`; whether the schedule exists."""
        key = {"tenant_id": tenant_id, "schedule_id": schedule_id}
        return await self._write(PAUSE, key)

    async def resume(self, schedule_id: str, *, tenant_id: str) -> bool:
        """Fire again from the first tick after now (the ticks while paused are not
        fired); whether it was paused."""
        schedule = await self.get(schedule_id, tenant_id=tenant_id)
        if schedule is None or not schedule.paused:
            return False

        async def once() -> bool:
            async with transaction(self._db.engine) as conn:
                now = await self._db.store_now(conn)
                first = tick_until(schedule.cron, schedule.timezone, now, schedule.end_at)
                params = {"tenant_id": tenant_id, "schedule_id": schedule_id, "next_tick": first}
                return bool((await conn.execute(RESUME, params)).rowcount)

        return await retry_connection_errors(once, what="schedule resume")

    async def delete(self, schedule_id: str, *, tenant_id: str) -> bool:
        """Delete the schedule (runs it submitted are left as they are); whether it
        existed."""
        key = {"tenant_id": tenant_id, "schedule_id": schedule_id}
        return await self._write(DELETE, key)

    async def fire_due(self, limit: int = 100) -> int:
        """Fire the due ticks of up to ``limit`` schedules, one transaction each; how many
        runs were submitted. Each worker's ``serve()`` calls it at every look."""
        async with self._db.engine.connect() as conn:
            due = list(await conn.execute(self._due, {"limit": limit, **self._db.now()}))
        submitted = 0
        for row in due:
            key = {"tenant_id": row.tenant_id, "schedule_id": row.schedule_id}
            fire = partial(retry_connection_errors, partial(self._fire, key), what="schedule tick")
            submitted += await self._db.settled_first(fire)
        return submitted

    async def _fire(self, key: Mapping[str, str]) -> int:
        async with transaction(self._db.engine) as conn:
            await self._db.classified(conn)
            row = (await conn.execute(self._lock_due, {**key, **self._db.now()})).first()
            if row is None:
                return 0  # fired by another worker meanwhile, paused, or deleted
            plan = plan_firing(row, float(row.now))
            lease = LeaseKey(key["tenant_id"], row.execution_id)
            submitted = skipped = 0
            for tick in plan.submit:
                if await self._submit_tick(conn, row, lease, key["schedule_id"], tick):
                    submitted += 1
                else:
                    skipped += 1
            advance = {
                **key,
                "tick": row.next_tick,
                "next": plan.next,
                "last": plan.last,
                "fired": submitted,
                "skipped": plan.skipped + skipped,
            }
            if (await conn.execute(self._advance, advance)).rowcount != 1:
                # Moved on by another firing after this one read it: not this one's tick.
                # Rolled back, the runs submitted here with it (the row lock, or SQLite's
                # write lock, keeps this from happening; this keeps it from counting).
                raise RuntimeError(
                    f"schedule {key['schedule_id']!r} moved on while a worker fired it; its "
                    "firing was rolled back"
                )
            return submitted

    async def _submit_tick(
        self, conn: AsyncConnection, row: Any, key: LeaseKey, schedule_id: str, tick: float
    ) -> bool:
        """Submit ``tick``'s run in ``conn``'s transaction; whether it was (``False``: the
        thread is busy under ``overlap="skip"``, or dead-lettered)."""
        from langgraph_fence.lease.run_config import RecordedRun

        run = RecordedRun.from_payload(self._serde.loads_typed((row.run_type, bytes(row.run))))
        metadata = {
            **dict(run.config.get("metadata") or {}),
            "schedule_id": schedule_id,
            "scheduled_for": datetime.fromtimestamp(tick, UTC).isoformat(),
        }
        config = {**run.config, "metadata": metadata}
        run_type, run_blob = self._serde.dumps_typed(
            RecordedRun(run.configurable, config, run.options).as_payload()
        )
        record = {
            "graph": row.graph,
            "thread_id": row.thread_id,
            "input_type": row.input_type,
            "input": bytes(row.input),
            "run_type": run_type,
            "run": run_blob,
        }
        on_busy = _ON_BUSY[row.overlap]
        try:
            await submit_in(
                self._db, conn, key, record, on_busy, None, uuid.uuid4().hex, time.time()
            )
        except ExecutionBusyError:
            return False  # overlap="skip": the previous run goes on
        except ExecutionEndedError as exc:
            logger.warning(
                "schedule %s: its thread is dead-lettered (%s); tick skipped", schedule_id, exc
            )
            return False
        return True

    async def _write(self, statement: Any, params: Mapping[str, Any]) -> bool:
        async def once() -> bool:
            async with transaction(self._db.engine) as conn:
                return bool((await conn.execute(statement, dict(params))).rowcount)

        return await retry_connection_errors(once, what="schedule")


def _end_at(end_at: object) -> float | None:
    if end_at is None:
        return None
    if not isinstance(end_at, datetime) or end_at.utcoffset() is None:
        raise ValueError(
            f"end_at must be an aware datetime (no tick after it fires), e.g. "
            f"datetime(2027, 1, 1, tzinfo=ZoneInfo('Europe/Paris')), got {end_at!r}"
        )
    return end_at.timestamp()

"""The run queue itself: :class:`SubmittedRuns`, what the instance, a worker and a waiting
parent ask of the queue on the lease table's database (the guarantees are the package's,
:mod:`langgraph_fence.queue`)."""

from __future__ import annotations

import asyncio
import json
import logging
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Collection, Mapping, Sequence
from contextlib import asynccontextmanager
from functools import partial
from typing import TYPE_CHECKING, Any, NamedTuple, TypeVar

from langgraph_fence.database import transaction
from langgraph_fence.database.retry import retry_connection_errors
from langgraph_fence.lease import Lease, LeaseKey
from langgraph_fence.queue._callbacks import Callbacks
from langgraph_fence.queue._checks import ON_BUSY, OnBusy, stored_input
from langgraph_fence.queue._children import ChildRuns
from langgraph_fence.queue._database import QueueDatabase
from langgraph_fence.queue._flows import Flow, Flows
from langgraph_fence.queue._not_before import Checked
from langgraph_fence.queue._schedules import Schedules
from langgraph_fence.queue._state import (
    RunState,
    WorkerHold,
    list_runs,
    served_graphs,
    submitted_run_state,
)
from langgraph_fence.queue._statements import (
    ANNOUNCE,
    ATTEMPTS,
    ONE_MORE_ATTEMPT,
    OUTPUT,
    OUTPUT_RETURNING,
    RETIRE,
    RUN_STATE,
    STATE,
)
from langgraph_fence.queue._streams import (
    HELD,
    READ,
    RECORD,
    RECORDED_AFTER,
    STREAM_OF,
    WITHDRAW,
    Kept,
    joined_modes,
    kept_at,
    listed_modes,
    restore_tuples,
    split_modes,
)
from langgraph_fence.queue._submit import (
    cancel_run,
    promote_queued,
    refuse_beside_waiting,
    submit_run,
)
from langgraph_fence.queue.notifications import NOTIFY_CHANNEL, NOTIFY_SQL, Notifications
from langgraph_fence.validate import MAX_ID_BYTES, text_id

if TYPE_CHECKING:
    from langgraph.checkpoint.serde.base import SerializerProtocol
    from sqlalchemy.ext.asyncio import AsyncConnection

    from langgraph_fence.fence import RunHandle
    from langgraph_fence.lease.run_config import RecordedRun
    from langgraph_fence.lease.sql import SqlLeaseRepository

logger = logging.getLogger("langgraph_fence.queue")

__all__ = ["Pinned", "SubmittedRuns"]

T = TypeVar("T")


class SubmittedRuns:
    """The run queue on the lease table's database: submit, pin, output, state, cancel.

    Args:
        store: the SQL lease store; the queue is on its database (the lease table and the
            execution records), and its clock stamps the queue's lease writes.
        serde: the serializer of the recorded inputs and the outputs (the records' one).
        bind: binds a thread to its execution, refusing one bound to another (the
            records'; a schedule's thread is bound when the schedule is created).
    """

    def __init__(
        self,
        store: SqlLeaseRepository,
        serde: SerializerProtocol,
        *,
        bind: Callable[[LeaseKey, str], Awaitable[None]] | None = None,
    ) -> None:
        self._db = QueueDatabase(store)
        self._engine = self._db.engine
        self.serde = serde
        #: The schedules on the queue's database; ``bind`` binds a schedule's thread to its
        #: execution when it is created (as a submit's is).
        self.schedules = Schedules(self._db, serde, self.check, bind)
        #: The admission of runs submitted with a flow key (each worker's look).
        self.flows = Flows(self._db)
        #: The completion callbacks of submitted runs (webhooks, registered callbacks).
        self.callbacks = Callbacks(self._db)
        #: The LISTEN side: one connection for every waiter of this queue (PostgreSQL).
        self.notifications = Notifications(self._engine) if self._db.pg else None
        self._children = ChildRuns(self._db)

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
        from langgraph_fence.lease.run_config import RECORDED_OPTIONS, record_run

        text_id("graph_name", graph_name, what="the name a worker serves the graph under")
        text_id(
            "tenant_id",
            tenant_id,
            what="the tenant the execution and its thread belong to",
            max_bytes=MAX_ID_BYTES,
        )
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
            max_bytes=MAX_ID_BYTES,
        )
        given = configurable.get("tenant_id")
        if given is not None and given != tenant_id:
            raise ValueError(
                f"config['configurable']['tenant_id'] is {given!r} and tenant_id is "
                f"{tenant_id!r}: a run is of one tenant; pass the same tenant in both"
            )
        if execution_id is None:
            execution_id = thread_id
        text_id(
            "execution_id", execution_id, what="the lease's execution id", max_bytes=MAX_ID_BYTES
        )
        if input is None:
            raise ValueError(
                "input must be the graph's input: a submitted run starts from it (to resume "
                "a thread, use instance.ainvoke(graph, None, config, ...))"
            )
        stored_input(self.serde, input, whose="input")
        run = record_run(config or {}, options, serde=self.serde)
        return LeaseKey(str(tenant_id), str(execution_id)), thread_id, run

    async def submit(
        self,
        key: LeaseKey,
        graph_name: str,
        thread_id: str,
        input: Any,
        run: RecordedRun,
        on_busy: OnBusy,
        not_before: Checked | None = None,
        flow: Flow | None = None,
        stream_modes: Sequence[str] = (),
        stream_listed: bool = True,
        callbacks: Sequence[str] = (),
    ) -> str | None:
        """Record the run (its own row, and the execution's record and pending lease when it
        runs next), in one transaction; the run's id. ``not_before`` (checked by
        :func:`~langgraph_fence.queue._not_before.check_not_before`): no worker starts it
        earlier, judged by the database's clock. ``flow``: it waits to be admitted under
        its key's limits (:class:`~langgraph_fence.queue.Flow`). ``stream_modes`` (checked
        by :func:`~langgraph_fence.queue._streams.check_stream_mode`): its holders record its
        stream in them, for :meth:`SubmittedRun.astream` in any process (``stream_listed``:
        they were given as a list, and the stream reads ``(mode, payload)``). ``callbacks``
        (:func:`~langgraph_fence.queue._callbacks.callback_targets`): delivered once it ends.

        The same run submitted again while it is pending, running or queued returns that
        run's id and writes nothing (``None``: the execution's run in flight has no run
        row, e.g. it was submitted before runs had their own).

        Raises:
            ExecutionBusyError: the execution is busy with other input and ``on_busy`` is
                ``"reject"``; nothing written.
            ExecutionEndedError: the execution was dead-lettered; nothing written.
        """
        input_type, blob = self.serde.dumps_typed(input)
        run_type, run_blob = self.serde.dumps_typed(run.as_payload())
        record = {
            "graph": graph_name,
            "thread_id": thread_id,
            "input_type": input_type,
            "input": blob,
            "run_type": run_type,
            "run": run_blob,
        }
        return await submit_run(
            self._db,
            key,
            record,
            on_busy,
            not_before,
            flow,
            joined_modes(stream_modes, listed=stream_listed),
            partial(self.callbacks.add, key=key, targets=callbacks) if callbacks else None,
        )

    async def promote(self, limit: int = 100) -> int:
        """Begin the next queued run of each thread whose current run has ended: the ended
        run keeps its outcome, the queued one becomes the execution's run (record and
        pending lease), in one transaction per thread; how many began. Any worker may do
        it, and two racing do it once (the lease row is locked, or SQLite serialises)."""
        return await promote_queued(self._db, limit)

    def serialize_inputs(self, inputs: Mapping[str, Any]) -> list[tuple[str, bytes]]:
        """Each input of ``inputs`` (child key -> input) as it is recorded, checked storable
        (encoded once and read back, as :meth:`check` does), in the order given.

        Raises:
            ValueError: an input cannot be recorded (its key named); nothing was written.
        """
        return [
            stored_input(self.serde, input, whose=f"the input of child {key!r}")
            for key, input in inputs.items()
        ]

    async def submit_children(
        self,
        parent: Lease,
        graph_name: str,
        children: Sequence[tuple[LeaseKey, tuple[str, bytes]]],
    ) -> list[bool] | None:
        """Record children of ``parent`` (their keys, and their inputs as
        :meth:`serialize_inputs` gives them) as submitted runs of ``graph_name``, each
        pending, all at once and only while ``parent`` is held; whether each was written.

        One statement on PostgreSQL (it locks the parent's row, so a takeover of the parent
        waits for it), one ``BEGIN IMMEDIATE`` transaction of four statements on SQLite (up
        to 10 000 children; one more per 10 000), whatever the number of children. Each
        child's thread is its execution id; its recorded run config is empty (as
        ``{"configurable": {"thread_id": ...}}`` records).

        Returns:
            per child, in the order given: ``True`` recorded now, ``False`` its key existed
            already (an earlier run of the parent step spawned it: nothing written for it);
            or ``None``: ``parent`` is no longer held (taken over, or ended), nothing written.

        Raises:
            ValueError: two children of the same key.
        """
        from langgraph_fence.lease.run_config import record_run

        ids = [key.execution_id for key, _ in children]
        if len(set(ids)) != len(ids):
            raise ValueError("children spawned together must have distinct keys")
        if not children:
            return []
        tenant = children[0][0].tenant_id
        if any(key.tenant_id != tenant for key, _ in children):
            raise ValueError("children spawned together must be of one tenant (their parent's)")
        run_type, run_blob = self.serde.dumps_typed(
            record_run({}, {}, serde=self.serde).as_payload()
        )
        common = {
            "tenant_id": tenant,
            "graph": graph_name,
            "run_type": run_type,
            "run": run_blob,
            "at": time.time(),
        }
        created = await self._children.record(parent, common, children)
        if created is None:
            return None
        return [execution_id in created for execution_id in ids]

    async def child_ends(
        self, children: Collection[LeaseKey]
    ) -> dict[LeaseKey, tuple[RunState, tuple[Any, Any]] | None]:
        """Of ``children``, those that ended (done, an interrupt, failed, dead-lettered;
        not yielded) with their stored outputs, and those that are gone (``None``): ONE
        read, whatever their number. A child still pending, running or yielded is not in
        the answer."""
        return await self._children.ends(children)

    async def refuse_beside_waiting(self, key: LeaseKey) -> None:
        """Refuse a start of the thread (``ainvoke`` with new input, ``None`` or a
        ``Command``) while submitted runs wait on it (one read).

        A submitted run that is pending (not claimed yet, or handed back) is the thread's
        run in flight, though no one holds its lease, and a queued one runs after it: a
        start would take that lease (or run between them), and the submitted input would
        never run (its ``result()`` would read another run's end).

        Raises:
            ExecutionBusyError: such runs wait; nothing was written.
        """
        await refuse_beside_waiting(self._db, key)

    # -- the claimer's side

    async def pin(self, lease: Lease, checkpoint_id: str | None) -> Pinned | None:
        """For a submitted run just taken under ``lease``: the checkpoint its input follows
        (``""``: none), pinned to ``checkpoint_id`` by the first claimer, with the run's id
        and recorded stream modes (and, on PostgreSQL, its execution's record); ``None`` for
        a run that was not submitted (or a lease no longer held). One guarded statement, and
        the run's start written on its row (flow keys count starts), in one transaction."""

        statements = self._db.leases

        async def once() -> Pinned | None:
            params = {**_held(lease), "checkpoint": checkpoint_id or "", **self._db.now()}
            if statements.pin_started is not None and self._db.on_driver:
                # On the driver, in autocommit (committed on a user's engine too).
                rows = await self._db.driver_rows(statements.pin_started, params)
                if not rows:
                    return None
                both = rows[0]
                pinned = _pinned(both["input_after"], both if both["run_id"] is not None else None)
                return pinned._replace(record=both)
            async with transaction(self._engine) as conn:
                row = (await conn.execute(statements.pin, params)).first()
                if row is None:
                    return None
                run = (await conn.execute(statements.run_started, params)).first()
                return _pinned(row.input_after, run)

        return await retry_connection_errors(once, what="submitted run pin")

    async def record_stream(self, lease: Lease, rows: Sequence[Mapping[str, Any]]) -> bool:
        """Write a holder's stream events (``fence_stream`` rows without the key) under
        ``lease``'s hold, in one transaction; whether they were (``False``: the lease is no
        longer this hold, and nothing was written). Written again on a connection error:
        an event written before is kept as it was."""
        held = _held(lease)
        params = [{**row, **held} for row in rows]

        async def record(conn: AsyncConnection) -> bool:
            await conn.execute(RECORD, params)
            return True

        return await self._while_held(held, record, False, what="stream events")

    async def withdraw_stream(
        self, lease: Lease, run_id: str, resume_from: str, finished: Collection[str] = ()
    ) -> Kept:
        """For a run just taken under ``lease``, beginning from checkpoint ``resume_from``
        (``""``: none) with the stored writes of the tasks ``finished``: withdraw the
        events older holders recorded after it, which this holder records again, but
        those it does not (:func:`~langgraph_fence.queue._streams.kept_at`); what was
        kept. Nothing is withdrawn when the lease is no longer this hold."""
        held = _held(lease)
        params = {**held, "run_id": run_id, "resume_from": resume_from}

        async def withdraw(conn: AsyncConnection) -> Kept:
            rows = list(await conn.execute(RECORDED_AFTER, params))
            keep, kept = kept_at(rows, resume_from, finished)
            gone = [
                {"run_id": run_id, "epoch": r.epoch, "seq": r.seq}
                for r in rows
                if (r.epoch, r.seq) not in keep
            ]
            if gone:
                await conn.execute(WITHDRAW, gone)
            return kept

        return await self._while_held(held, withdraw, Kept(False), what="stream withdrawal")

    async def _while_held(
        self,
        held: Mapping[str, Any],
        body: Callable[[AsyncConnection], Awaitable[T]],
        refused: T,
        *,
        what: str,
    ) -> T:
        """``body`` in the transaction of a guard read of ``held`` (``FOR SHARE`` on
        PostgreSQL: a take waits for its commit); ``refused`` when the lease is no longer
        that hold (nothing written)."""

        async def once() -> T:
            async with transaction(self._engine) as conn:
                if (await conn.execute(HELD[self._db.pg], dict(held))).first() is None:
                    return refused
                return await body(conn)

        return await retry_connection_errors(once, what=what)

    async def stream_of(
        self, key: LeaseKey, run_id: str
    ) -> tuple[tuple[str, ...], bool, str] | None:
        """The stream modes submitted run ``run_id`` of ``key`` records, whether they were
        given as a list, and its thread; ``None``: no such run."""
        params = {"tenant_id": key.tenant_id, "execution_id": key.execution_id, "run_id": run_id}
        row = await self._db.first(STREAM_OF, params, what="run stream")
        if row is None:
            return None
        modes = row.stream_modes
        return split_modes(modes), listed_modes(modes), str(row.thread_id)

    async def stream_rows(self, run_id: str, after: tuple[int, int], limit: int) -> list[Any]:
        """Up to ``limit`` of run ``run_id``'s events not withdrawn, past position ``after``
        (``(epoch, seq)``), in stream order."""
        params = {"run_id": run_id, "epoch": after[0], "seq": after[1], "limit": limit}

        async def once() -> list[Any]:
            async with self._engine.connect() as conn:
                return list(await conn.execute(READ, params))

        return await retry_connection_errors(once, what="run stream")

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
        params = {**_held(handle.lease), "output_type": output_type, "output": blob}

        async def once() -> int:
            if self._db.on_driver:
                return len(await self._db.driver_rows(OUTPUT_RETURNING, params))
            async with self._db.writer.begin() as conn:
                return int((await conn.execute(OUTPUT, params)).rowcount)

        if not await retry_connection_errors(once, what="submitted run output"):
            await handle.renew()  # raises the fencing error the refusal means
            raise RuntimeError(f"the output of {handle.scope_key!r} was refused")

    async def record_sleep(
        self, lease: Lease, sleep_key: str, not_before: Checked
    ) -> tuple[float, float] | None:
        """Record a step's durable sleep under ``lease``'s hold (a sleep recorded before
        keeps its end); ``(wake_at, now)`` on the store's clock, or ``None`` when neither
        the sleep was recorded before nor the lease is held (the run was fenced)."""
        at, delay = not_before
        params = {
            **_held(lease),
            "sleep_key": sleep_key,
            "at": at,
            "delay": delay,
            **self._db.now(),
        }

        async def once() -> Any:
            async with transaction(self._engine) as conn:
                await conn.execute(self._db.leases.record_sleep, params)
                return (await conn.execute(self._db.leases.read_sleep, params)).first()

        row = await retry_connection_errors(once, what="durable sleep")
        return None if row is None else (float(row.wake_at), float(row.now))

    async def release_sleeping(self, lease: Lease, wake_at: float, reason: str) -> bool:
        """Give ``lease`` back, pending for any worker from ``wake_at`` (store clock) on;
        whether it was still held (one guarded statement)."""
        params = {**_held(lease), "wake_at": wake_at, "delay": None, "reason": reason}
        params.update(self._db.now())

        async def once() -> int:
            async with self._db.writer.begin() as conn:
                return int((await conn.execute(self._db.leases.release_sleeping, params)).rowcount)

        return bool(await retry_connection_errors(once, what="durable sleep release"))

    async def attempts(self, key: LeaseKey) -> int | None:
        """The attempts of the execution's current submitted run (``None``: none)."""
        params = {"tenant_id": key.tenant_id, "execution_id": key.execution_id}
        row = await self._db.first(ATTEMPTS, params, what="run attempts")
        return None if row is None else int(row.attempts)

    async def release_for_retry(self, lease: Lease, delay: float, reason: str) -> bool:
        """Give ``lease`` back, pending for any worker ``delay`` seconds from now (store
        clock) on, and count one more attempt of its current run, in one transaction;
        whether it was still held with no non-idempotent stamp standing (one that stands
        ends the run failed: its retry would be dead-lettered at the take)."""
        params = {**_held(lease), "wake_at": None, "delay": delay, "reason": reason}
        params.update(self._db.now())

        async def once() -> bool:
            async with transaction(self._engine) as conn:
                released = await conn.execute(self._db.leases.release_for_retry, params)
                if not released.rowcount:
                    return False
                await conn.execute(ONE_MORE_ATTEMPT, params)
                return True

        return await retry_connection_errors(once, what="run retry")

    # -- any process's side

    async def state(self, key: LeaseKey, run_id: str | None = None) -> tuple[RunState, Any] | None:
        """The state and stored output (``None`` for none) of the execution's run, or of
        its submitted run ``run_id``; ``None`` when there is no such execution or run.
        One read: a run that ended is read with its own outcome, never the next run's."""
        params = {"tenant_id": key.tenant_id, "execution_id": key.execution_id}
        if run_id is None:
            row = await self._db.first(STATE, params, what="submitted run state")
        else:
            params["run_id"] = run_id
            row = await self._db.first(RUN_STATE, params, what="submitted run state")
        return None if row is None else submitted_run_state(row, run_id)

    def decode_output(
        self, key: LeaseKey, stored: tuple[Any, Any], allow: Collection[tuple[str, ...]]
    ) -> Any:
        """The output :meth:`store_output` kept, decoded with the serializer (and ``allow``)."""
        from langgraph_fence.serde import loads_checked, with_allowlist

        output_type, blob = stored
        if output_type is None:
            return None
        serde = with_allowlist(self.serde, allow)
        return loads_checked(
            serde, (output_type, bytes(blob)), what=f"the output of execution {key.scope_key!r}"
        )

    def decode_event(
        self, payload_type: str, blob: bytes, allow: Collection[tuple[str, ...]]
    ) -> Any:
        """A recorded stream event's payload, decoded with the serializer (and ``allow``)."""
        from langgraph_fence.serde import loads_checked, with_allowlist

        serde = with_allowlist(self.serde, allow)
        stored = loads_checked(serde, (payload_type, bytes(blob)), what="a recorded stream event")
        return restore_tuples(stored)

    async def cancel(self, key: LeaseKey, reason: str, run_id: str | None = None) -> bool:
        """End the execution ``cancelled`` with ``reason`` if it is pending or running;
        whether it was. With ``run_id``: that submitted run only (a queued one never begins,
        and ends ``cancelled``; the current one as the execution; one that ended:
        ``False``). A running one is fenced (its epoch moves on): its next write, renewal or
        release is refused and it drains. Its ``ANY_INSTANCE`` children that no worker has
        claimed yet end ``cancelled`` with it, in the same transaction (they never start);
        children already running run to their end (:mod:`langgraph_fence.execution.children`). A
        cancelled execution is resumed from its last checkpoint by a new run of its thread
        or by ``langgraph-fence resolve --retry``."""
        return await cancel_run(self._db, key, reason, run_id)

    async def wake_yielded(self, parent: LeaseKey, ttl: float) -> bool:
        """Make ``parent`` pending (runnable by any instance's ``serve()`` ``ttl`` seconds
        from now on, store clock) if it is yielded and none of its children is still
        pending, running or yielded itself; whether it was. Serving instances are woken
        (PostgreSQL NOTIFY), so a waiter that died never strands its tree."""
        params = {"tenant_id": parent.tenant_id, "execution_id": parent.execution_id, "ttl": ttl}
        wake = self._db.leases.wake
        return bool(await self._children.wake(wake, params, what="wake a yielded tree"))

    async def wake_all_yielded(self, ttl: float) -> int:
        """Wake every yielded tree none of whose children is still pending, running or
        yielded (runnable by any ``serve()`` ``ttl`` seconds from now, store clock); how
        many. One statement, made by each look of ``serve()``: a tree whose last child
        ended without waking it (dead-lettered by a take, ended by an operator, a wake
        lost to an outage) is not stranded, whether its waiter lives or died."""
        wake_all = self._db.leases.wake_all
        return await self._children.wake(wake_all, {"ttl": ttl}, what="wake yielded trees")

    async def runs(self, limit: int = 1000) -> list[RunState]:
        """Every pending, running and yielded execution (with its worker), oldest first."""
        return await list_runs(self._engine, limit)

    @asynccontextmanager
    async def wakeups(self, wake: asyncio.Event) -> AsyncIterator[bool]:
        """Set ``wake`` whenever an execution becomes runnable (a submit, a child recorded,
        a run handed back), while the block runs; yields whether it will (PostgreSQL:
        LISTEN on :data:`~langgraph_fence.queue.notifications.NOTIFY_CHANNEL`, re-opened if the
        database drops it; SQLite, or a database that cannot be listened to: never, and the
        caller polls)."""
        if self.notifications is None:
            yield False
            return
        async with self.notifications.subscribe(NOTIFY_CHANNEL, wake) as listening:
            yield listening

    async def aclose(self) -> None:
        """Give back the connections a served run's statements are kept on."""
        await self._db.aclose()

    async def notify(self, channel: str, payload: str) -> None:
        """Say on ``channel`` (PostgreSQL; nothing elsewhere) what changed: one statement,
        off the hot paths (a hand-back, a submitted run's end). Never raises: a waiter that
        misses it finds the change by polling."""
        if not self._db.pg:
            return
        try:
            await self._db.driver_rows(NOTIFY_SQL, {"channel": channel, "payload": payload})
        except Exception as exc:
            logger.info("NOTIFY %s failed (%s): waiters poll", channel, exc)

    # -- who serves what

    async def announce(
        self, instance_id: str, graphs: Collection[str], hold: WorkerHold | None = None
    ) -> None:
        """Say that ``instance_id`` serves ``graphs`` now, holding ``hold`` (one upsert)."""
        async with self._db.writer.begin() as conn:
            params = {
                "instance_id": instance_id,
                "graphs": json.dumps(sorted(graphs)),
                "at": time.time(),
                "held": None if hold is None else hold.held,
                "max_held": None if hold is None else hold.max_held,
                "lease_ttl": None if hold is None else hold.lease_ttl,
                "renewal_late": None if hold is None else hold.renewal_late,
            }
            await conn.execute(ANNOUNCE, params)

    async def retire(self, instance_id: str) -> None:
        """Say that ``instance_id`` serves nothing any more (it stopped)."""
        async with self._db.writer.begin() as conn:
            await conn.execute(RETIRE, {"instance_id": instance_id})

    async def served(self) -> dict[str, list[str]]:
        """Graph name -> the workers that said they serve it within
        :data:`~langgraph_fence.queue.ANNOUNCED_FOR`."""
        return await served_graphs(self._engine)


class Pinned(NamedTuple):
    """What a submitted run's pin tells its taker."""

    #: The checkpoint the run's input follows (``""``: none).
    input_after: str
    #: The submitted run's id (``None``: it was submitted before runs had rows).
    run_id: str | None
    #: The stream modes its holders record (none: its stream is not recorded).
    stream_modes: tuple[str, ...]
    #: Whether the run has callbacks to tell when it ends (``submit(webhook=, callback=)``).
    told: bool = False
    #: The execution's record as the pin read it back (its ``fence_executions`` columns;
    #: the input only where the run begins from it), for
    #: :meth:`~langgraph_fence.lease.records.SqlExecutionRecords.decode`; ``None``: not read.
    record: Mapping[str, Any] | None = None


def _pinned(input_after: Any, run: Any) -> Pinned:
    """The pin's answer; ``run`` the run's row, SQLAlchemy's or the driver's (``None``:
    submitted before runs had rows)."""
    if run is None:
        return Pinned(str(input_after), None, ())
    found = run._mapping if hasattr(run, "_mapping") else run
    return Pinned(
        str(input_after),
        str(found["run_id"]),
        split_modes(found["stream_modes"]),
        bool(found["told"]),
    )


def _held(lease: Lease) -> dict[str, Any]:
    """The parameters of a statement guarded by ``lease``'s hold."""
    return {
        "tenant_id": lease.key.tenant_id,
        "execution_id": lease.key.execution_id,
        "holder": lease.holder,
        "epoch": lease.epoch,
    }

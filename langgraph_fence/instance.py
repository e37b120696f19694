"""``Instance``: the process-level runtime that runs graphs under leases.

One instance holds leases, renews them on timers, runs graphs with the run's handle in their
config, and releases each lease with the run's outcome. Where a run loses its lease (a
renewal refused, or renewals failing until the confirmed window ran out) the instance marks
the run's handle, drains the graph at the next superstep boundary, cancels the steps in
flight, and raises the recorded fencing error, whatever LangGraph surfaced instead.
"""

from __future__ import annotations

import asyncio
import inspect
import logging
import os
import socket
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator, Mapping
from contextlib import asynccontextmanager, contextmanager
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from langchain_core.runnables import RunnableConfig
from langgraph.errors import GraphDrained
from langgraph.runtime import RunControl
from langgraph.types import Command

from .admin import ThreadAdmin, _base_store, admin_holder
from .contracts import require_implements
from .errors import (
    ExecutionDeadLetteredError,
    ExecutionEndedError,
    ExecutionFencedError,
    ExecutionLeaseHeldError,
    ExecutionLeaseLostError,
    find_error,
    find_fence_error,
)
from .events import EventKind, FenceListener, Listeners
from .executions import (
    ExecutionHead,
    ExecutionRecord,
    ExecutionRecords,
    MemoryExecutionRecords,
    SqlExecutionRecords,
    check_thread_binding,
)
from .faults import fault_point
from .fence import FENCE_CONFIG_KEY, RunHandle, safety_margin
from .lease import (
    DEFAULT_MAX_TAKEOVERS,
    ExecutionLeaseRepository,
    Lease,
    LeaseKey,
    LeaseStatus,
    dead_letter_reason,
    non_idempotent_standing,
    validate_max_takeovers,
)
from .redact import bounded_reason, failure_reason
from .retry import FixedWindow, is_database_connection_error, retry_window
from .run_config import record_run, restore_run, run_allowlist
from .serde import safe_serializer
from .store import FencedStore
from .validate import positive_int, positive_seconds, text_id

if TYPE_CHECKING:
    from langgraph.checkpoint.base import BaseCheckpointSaver
    from langgraph.checkpoint.serde.base import SerializerProtocol

__all__ = ["Instance"]

logger = logging.getLogger(__name__)

#: The longest pause serve() takes between looks while the store cannot be read.
MAX_SERVE_BACKOFF = 10.0
#: The tenant of a graph called the LangGraph way whose config names none (``tenant_id=``).
DEFAULT_TENANT_ID = "default"

Sleep = Callable[[float], Awaitable[Any]]


def _default_instance_id() -> str:
    return f"{socket.gethostname()}:{os.getpid()}:{uuid.uuid4().hex[:8]}"


@dataclass(slots=True, eq=False)
class _Run:
    """One run in flight: its config, handle, control and timers."""

    config: RunnableConfig
    handle: RunHandle
    control: RunControl
    base_config: RunnableConfig
    timers: list[asyncio.Task[None]] = field(default_factory=list)


class Instance:
    """Runs LangGraph graphs under execution leases, one fencing token per run.

    Guarantees: a run starts only after its lease is taken (epoch + 1); every step and
    checkpoint of the run carries that token; the lease is renewed every
    ``renew_interval``; a run whose lease is lost stops at the next superstep boundary
    and its ``ainvoke`` raises :class:`~langgraph_fence.ExecutionFencedError` (taken
    over) or :class:`~langgraph_fence.ExecutionLeaseLostError` (could not be renewed in
    time), the same object that was recorded, never a cancellation or a sibling's error
    in its place. The lease is released with the run's outcome: ``done``, ``waiting``
    (interrupted), or ``failed`` with the error as reason.

    Args:
        repository: the lease store.
        saver: the checkpoint saver; wrapped in :class:`~langgraph_fence.FencedCheckpointer`
            unless it already is one. Compile graphs with ``checkpointer=instance.checkpointer``.
        instance_id: this instance's holder id (default: host, pid and a random suffix).
        lease_ttl: seconds a hold lasts without renewal (default 30).
        renew_interval: seconds between renewals (default ``lease_ttl / 3``); must be below
            ``lease_ttl``.
        clock: this process's clock for confirmed windows (default ``time.monotonic``).
        sleep: how timers wait (default ``asyncio.sleep``); tests pass a controlled one.
        records: where each execution's graph name, thread and input are recorded so any
            instance's :meth:`serve` can resume it. Default: over a
            :class:`~langgraph_fence.SqlLeaseRepository`, in its database (same engine;
            its ``setup()`` creates their tables), where every other instance looks; in
            memory only over a :class:`~langgraph_fence.MemoryLeaseRepository` (whose
            leases are of this process only too). Any other repository needs them passed.
        max_takeovers: the takeover budget of :meth:`serve` (default 3): how many times in
            a row an execution is taken over from a holder that died with no new
            checkpoint of its thread since the take before; the next take dead-letters it
            ("crashed N workers") instead of handing it to one more worker.
    """

    def __init__(
        self,
        repository: ExecutionLeaseRepository,
        saver: BaseCheckpointSaver[Any],
        *,
        instance_id: str | None = None,
        lease_ttl: float = 30.0,
        renew_interval: float | None = None,
        clock: Callable[[], float] | None = None,
        sleep: Sleep | None = None,
        records: ExecutionRecords | None = None,
        max_takeovers: int = DEFAULT_MAX_TAKEOVERS,
        tenant_id: str = DEFAULT_TENANT_ID,
    ) -> None:
        from . import graph_calls
        from .checkpoint import FencedCheckpointer
        from .from_thread import running_loop

        require_implements(repository, ExecutionLeaseRepository, argument="repository")
        if records is not None:
            require_implements(records, ExecutionRecords, argument="records")
        self.instance_id, self.lease_ttl, self.renew_interval, self.max_takeovers = _settings(
            instance_id, lease_ttl, renew_interval, max_takeovers
        )
        #: The tenant of a graph called the LangGraph way whose config names none.
        self.tenant_id = text_id(
            "tenant_id", tenant_id, what="the default tenant of graphs called the LangGraph way"
        )
        self.repository = repository
        self.checkpointer: FencedCheckpointer = (
            saver if isinstance(saver, FencedCheckpointer) else FencedCheckpointer(saver)
        )
        # The LangGraph way (graph.ainvoke on a graph compiled with this checkpointer) runs
        # through this instance; a write from outside any run is refused, never unfenced.
        self.checkpointer.instance = self
        self.checkpointer.require_fence = True
        #: The event loop this instance's runs and timers belong to (sync calls hop to it).
        self.loop: asyncio.AbstractEventLoop | None = running_loop()
        graph_calls.install()
        self.clock = clock or time.monotonic
        self._sleep: Sleep = sleep or asyncio.sleep
        self.records: ExecutionRecords = (
            records if records is not None else _default_records(repository)
        )
        # A run config is checked with what its records store it with (memory records keep
        # objects, but a value is refused the same way on every store).
        self._record_serde: SerializerProtocol = (
            getattr(self.records, "serde", None) or safe_serializer()
        )
        # Admin operations through this instance's checkpointer hold the execution's lease.
        self.checkpointer.admin = ThreadAdmin(
            repository,
            self.records,
            holder=admin_holder(self.instance_id),
            ttl=self.lease_ttl,
        )
        self._runs: set[_Run] = set()
        self._events = Listeners(self.instance_id)
        #: The fenced LangGraph store on the instance's database (``Instance.open``):
        #: ``compile(checkpointer=instance.checkpointer, store=instance.store)``.
        self.store: FencedStore | None = None

    def add_listener(self, listener: FenceListener) -> Callable[[], None]:
        """Call ``listener(event)`` with every :class:`~langgraph_fence.FenceEvent` of this
        instance's runs (acquired, renewed late, lost, fenced, taken over, dead-lettered,
        handed back); returns a function that removes it.

        A listener runs on the event loop and must not block; one that raises is logged and
        never breaks a run (:mod:`langgraph_fence.events`).
        """
        return self._events.add(listener)

    @classmethod
    @asynccontextmanager
    async def open(
        cls,
        url: str,
        *,
        engine_options: Mapping[str, Any] | None = None,
        serde: SerializerProtocol | None = None,
        **options: Any,
    ) -> AsyncIterator[Instance]:
        """Open an instance on one database: its lease table and checkpoints side by side.

        Creates the engine, the :class:`~langgraph_fence.SqlLeaseRepository` and the
        :class:`checkpointers.SqlCheckpointer` on the same database (so the checkpointer
        checks the token inside its own writes), and ``instance.store``
        (:class:`~langgraph_fence.FencedStore` over :class:`checkpointers.SqlStore`, which
        does the same for LangGraph store writes), runs their migrations, and closes
        everything on exit.

        Args:
            url: ``sqlite+aiosqlite:///path.db`` or ``postgresql+asyncpg://...``.
            engine_options: passed to :func:`langgraph_fence.database.create_engine`.
            serde: the serializer of checkpoints and execution records (default: LangGraph's
                in strict msgpack mode, :func:`langgraph_fence.serde.safe_serializer`; a
                stored payload constructs no type outside its allow-list).
            **options: :class:`Instance` options (``instance_id``, ``lease_ttl``,
                ``renew_interval``, ``clock``, ``sleep``, ``max_takeovers``, ``tenant_id``).
        """
        from checkpointers import SqlCheckpointer
        from checkpointers.store import SqlStore

        from .database import create_engine
        from .stores.sql import SqlLeaseRepository

        # Refused before the engine exists: bad input creates no table and writes no row.
        accepted = set(inspect.signature(cls.__init__).parameters) - {
            "self",
            "repository",
            "saver",
            "records",
        }
        unknown = sorted(set(options) - accepted)
        if unknown:
            raise ValueError(
                f"Instance.open got unknown options {unknown}: it takes url, engine_options, "
                f"serde and the Instance options {sorted(accepted)}"
            )
        _settings(
            options.get("instance_id"),
            options.get("lease_ttl", 30.0),
            options.get("renew_interval"),
            options.get("max_takeovers", DEFAULT_MAX_TAKEOVERS),
        )
        text_id(
            "tenant_id",
            options.get("tenant_id", DEFAULT_TENANT_ID),
            what="the default tenant of graphs called the LangGraph way",
        )
        engine = create_engine(url, **dict(engine_options or {}))
        try:
            repository = SqlLeaseRepository(engine)
            await repository.setup()
            saver = SqlCheckpointer(engine, serde=serde)
            await saver.setup()
            records = SqlExecutionRecords(engine, serde=serde)  # set up with the repository
            instance = cls(repository, saver, records=records, **options)
            store = SqlStore(engine)
            await store.setup()
            instance.store = FencedStore(store)
            try:
                yield instance
            finally:
                await instance.aclose()
                await saver.aclose()
        finally:
            await engine.dispose()

    @classmethod
    @contextmanager
    def open_sync(cls, url: str, **options: Any) -> Iterator[Instance]:
        """:meth:`open` for a sync program (Flask, Django, Celery, a script): the instance
        runs on an event loop of its own, in a thread of its own, until the block ends.

        ``graph.invoke`` / ``stream`` / ``batch`` / ``update_state`` of a graph compiled
        with ``instance.checkpointer`` then run fenced from any thread, as
        ``graph.ainvoke`` does on an async instance. Takes the arguments of :meth:`open`.
        """
        from .from_thread import loop_thread

        with loop_thread("langgraph-fence instance") as portal:
            context = cls.open(url, **options)
            instance = portal.call(context.__aenter__)
            try:
                yield instance
            except BaseException as exc:
                error = exc
                if not portal.call(
                    lambda: context.__aexit__(type(error), error, error.__traceback__)
                ):
                    raise
            else:
                portal.call(lambda: context.__aexit__(None, None, None))

    async def aclose(self) -> None:
        """Stop the timers of every run still in flight (their leases then lapse)."""
        for run in list(self._runs):
            await _cancel_all(run.timers)

    # -- running graphs

    async def ainvoke(
        self,
        graph: Any,
        input: Any,
        config: RunnableConfig | None = None,
        *,
        tenant_id: str,
        execution_id: str | None = None,
        graph_name: str | None = None,
        **kwargs: Any,
    ) -> Any:
        """Run ``graph`` to its end (or an interrupt) under the execution's lease.

        ``input=None`` (or a ``Command``) resumes the thread from the checkpoint the config
        names (``checkpoint_id``: a replay or a fork; the latest by default), as in LangGraph,
        also on an execution that ended ``done`` or ``failed`` (resume after an error, time
        travel); new input on such a thread starts a new turn. Each is a new run at the next
        token (epoch + 1); a non-idempotent write stamped and never cleared dead-letters the
        execution instead of repeating it, and a dead-lettered execution never runs again
        without an operator's ``resolve``.

        Args:
            graph: a graph compiled with ``checkpointer=instance.checkpointer``.
            input: the graph's input, a ``Command``, or ``None`` to resume.
            config: the run config; ``config["configurable"]["thread_id"]`` is required.
            tenant_id: the tenant the execution and its thread belong to (part of the
                thread's key: read the thread back with ``configurable["tenant_id"]``).
            execution_id: the lease's execution id (default: the thread id).
            graph_name: the name :meth:`serve` finds the graph under when another instance
                takes the execution over (default: ``graph.name``, the ``name=`` given to
                ``compile()``; LangGraph's default name ``"LangGraph"`` is refused, since
                no ``serve()`` would find it).
            **kwargs: passed to ``graph.ainvoke`` (``durability``, ``context``, ...).

        A run started with input records, with its execution, what a takeover runs it with
        again: its ``configurable`` keys, ``context``, ``recursion_limit``, ``tags``,
        ``metadata``, ``run_name``, ``max_concurrency``, ``durability``,
        ``interrupt_before`` and ``interrupt_after`` (:mod:`langgraph_fence.run_config`).
        Callbacks and other live objects are not carried over to a takeover; a value that
        cannot be recorded is refused with a ``ValueError`` naming it, before anything is
        written.

        Raises:
            ExecutionFencedError: the lease was taken over during the run.
            ExecutionLeaseLostError: the lease could not be renewed in time.
            ExecutionLeaseHeldError: another live instance holds the lease.
            ExecutionEndedError: the execution was dead-lettered: it runs again only after
                an operator's ``langgraph-fence resolve``.
            ExecutionDeadLetteredError: the run was dead-lettered (a non-idempotent
                write may have happened and is not repeated).
            ExecutionThreadBoundError: the tenant's thread belongs to another execution id
                (a ``ValueError``); refused before anything runs.
            ValueError: bad arguments (a default-named graph without ``graph_name``, a run
                config value that cannot be recorded), before anything runs or is written.
        """
        async with self._run(
            graph, input, config, tenant_id, execution_id, kwargs, graph_name=graph_name
        ) as run:
            return await graph.ainvoke(input, run.config, control=run.control, **kwargs)

    async def astream(
        self,
        graph: Any,
        input: Any,
        config: RunnableConfig | None = None,
        *,
        tenant_id: str,
        execution_id: str | None = None,
        graph_name: str | None = None,
        **kwargs: Any,
    ) -> AsyncIterator[Any]:
        """Stream ``graph`` under the execution's lease; see :meth:`ainvoke`."""
        async with self._run(
            graph, input, config, tenant_id, execution_id, kwargs, graph_name=graph_name
        ) as run:
            async for chunk in graph.astream(input, run.config, control=run.control, **kwargs):
                yield chunk

    async def aupdate_state(
        self,
        graph: Any,
        config: RunnableConfig,
        values: Any,
        as_node: str | None = None,
        *,
        tenant_id: str,
        execution_id: str | None = None,
        task_id: str | None = None,
    ) -> RunnableConfig:
        """``graph.aupdate_state(...)`` under the execution's lease; returns the new config.

        The update is a run of the execution like any other: it takes the lease (the next
        token), is refused with :class:`~langgraph_fence.ExecutionLeaseHeldError` while
        another live instance holds it, writes its checkpoint under that token, and leaves
        the execution ``waiting`` (steps to run: resume it with ``ainvoke(graph, None,
        new_config, ...)``) or ``done``. Use it to edit state before a fork; a plain
        ``graph.aupdate_state`` writes outside any lease.
        """
        async with self._run(graph, None, config, tenant_id, execution_id, {}) as run:
            updated: RunnableConfig = await graph.aupdate_state(
                run.config, values, as_node=as_node, task_id=task_id
            )
        configurable = {
            k: v
            for k, v in dict(updated.get("configurable") or {}).items()
            if k != FENCE_CONFIG_KEY
        }
        return {**updated, "configurable": configurable}

    # -- taking executions over

    async def serve(
        self,
        graphs: Mapping[str, Any],
        *,
        concurrency: int = 4,
        poll_interval: float = 1.0,
        stop: asyncio.Event | None = None,
        handle_signals: bool = True,
        max_takeovers: int | None = None,
        **kwargs: Any,
    ) -> None:
        """Take over expired executions and run them to their end, until ``stop`` is set.

        Every ``poll_interval`` seconds the loop asks the store for executions whose lease
        expired (their instance died or froze) or that were handed back, and takes each
        over in ONE guarded statement that also decides its fate: an execution found with a
        ``NON_IDEMPOTENT_WRITE`` stamp standing is dead-lettered (the write may have
        happened; the reason names the node and the token that stamped it), any other is
        taken (epoch + 1) and resumed from its last checkpoint, or from its recorded input
        if it died before its first checkpoint, with the config and options its run was
        started with (its ``configurable`` keys, ``context``, ``recursion_limit``, ``tags``,
        ..., as :meth:`ainvoke` recorded them). Two instances never both take, or both
        dead-letter, one execution. An execution whose graph is not in ``graphs`` is left
        untouched, and logged once at WARNING with the graph name it is recorded under.

        The takeover budget: an execution taken over more than ``max_takeovers`` times in a
        row from holders that died with no new checkpoint of its thread in between (a step
        that kills its process, or runs it out of memory) is dead-lettered by the take that
        would start one more worker on it, with the reason "crashed N workers". A new
        checkpoint (the latest one of the thread's root namespace, read just before each
        take) starts the count again; so does a run that ends or reaches an interrupt, and
        ``langgraph-fence resolve --retry``. A handed-back (pending) execution costs nothing.

        On ``stop`` (or SIGTERM / SIGINT with ``handle_signals``) the loop takes no more
        work, drains its running graphs at their next superstep boundary, and releases
        their leases as ``pending`` so another instance resumes them at once.

        Args:
            graphs: graph name -> graph compiled with ``checkpointer=instance.checkpointer``.
            concurrency: how many executions this loop runs at once.
            poll_interval: seconds between looks at the store.
            stop: set it to stop the loop gracefully.
            handle_signals: set ``stop`` on SIGTERM and SIGINT (main thread only).
            max_takeovers: the takeover budget (default: the instance's ``max_takeovers``).
            **kwargs: passed to each ``graph.ainvoke`` (``durability``, ...); an option the
                run recorded (e.g. its ``durability``) wins over these.
        """
        from .checkpoint import FencedCheckpointer

        if not isinstance(graphs, Mapping) or not graphs:
            raise ValueError("graphs must be a non-empty mapping of graph name -> graph")
        for name, graph in graphs.items():
            text_id("graphs' names", name, what="the graph name executions are recorded under")
            if not isinstance(getattr(graph, "checkpointer", None), FencedCheckpointer):
                raise ValueError(
                    f"graphs[{name!r}] was compiled without a fenced checkpointer: compile it "
                    "with builder.compile(checkpointer=instance.checkpointer)"
                )
            own = getattr(graph, "name", None)
            if own not in (name, DEFAULT_GRAPH_NAME):
                # Runs started with this graph and no graph_name are recorded under its own
                # name: this loop would never find them.
                logger.warning(
                    "graph %r is served as %r: runs started with it and no graph_name are "
                    "recorded as %r, which this loop does not serve; serve it as %r, or "
                    "start its runs with graph_name=%r",
                    own,
                    name,
                    own,
                    own,
                    name,
                )
        positive_int("concurrency", concurrency, what="how many executions serve() runs at once")
        poll = positive_seconds("poll_interval", poll_interval, what="between looks at the store")
        budget = self.max_takeovers if max_takeovers is None else _budget(max_takeovers)
        stop = stop if stop is not None else asyncio.Event()
        remove_signals = _on_signals(stop) if handle_signals else (lambda: None)
        running: dict[asyncio.Task[None], list[_Run]] = {}
        unserved: dict[LeaseKey, int] = {}
        logger.info("instance %s serves %s", self.instance_id, sorted(graphs))
        failures = 0  # looks in a row that the store refused: the loop backs off
        try:
            while not stop.is_set():
                free = concurrency - len(running)
                if free > 0:
                    try:
                        await self._take_work(graphs, free, running, unserved, budget, kwargs)
                        failures = 0
                    except Exception as exc:
                        failures += 1
                        logger.warning(
                            "serve: the store could not be read (%s); looking again in %.1fs",
                            failure_reason(exc),
                            _serve_backoff(poll, failures),
                        )
                waiters: list[asyncio.Future[Any]] = [asyncio.ensure_future(stop.wait())]
                waiters.extend(running)
                timeout = _serve_backoff(poll, failures)
                await asyncio.wait(waiters, timeout=timeout, return_when=asyncio.FIRST_COMPLETED)
                waiters[0].cancel()
                for task in [t for t in running if t.done()]:
                    running.pop(task)
        finally:
            remove_signals()
            for runs in running.values():
                for run in runs:
                    reason = "langgraph-fence: the instance is stopping"
                    run.handle.request_stop(reason)  # confirm_now() refuses from here on
                    run.control.request_drain(reason)
            if running:
                await asyncio.gather(*running, return_exceptions=True)
            logger.info("instance %s stopped serving", self.instance_id)

    async def _take_work(
        self,
        graphs: Mapping[str, Any],
        free: int,
        running: dict[asyncio.Task[None], list[_Run]],
        unserved: dict[LeaseKey, int],
        budget: int,
        kwargs: Mapping[str, Any],
    ) -> None:
        """Take up to ``free`` candidates over; a failed take never stops the serve loop
        (a failed look raises, and serve() backs off).

        An execution of a graph this loop does not serve is remembered with its epoch
        (``unserved``) and costs no read on the polls after: its record is never loaded, its
        input never decoded. A record is decoded only once its execution is taken, and a
        record that cannot be decoded dead-letters its execution (guarded by the epoch just
        taken) with the reason, instead of failing the loop.
        """
        window = free * 4
        while free > 0:
            # A store that cannot be read raises out of here: serve() logs it and backs off.
            # Unserved executions stay candidates: widen the window by as many, or they
            # would hide the ones this loop can run.
            limit = window + len(unserved)
            candidates = await self.repository.takeover_candidates(limit=limit)
            # Forget the ones that are no longer candidates (ended, or taken by their
            # servers); a new epoch is a new run, whose record may name another graph.
            current = {candidate.key: candidate.epoch for candidate in candidates}
            for key in [k for k, epoch in unserved.items() if current.get(k) != epoch]:
                del unserved[key]
            fresh = [c for c in candidates if c.key not in unserved]
            heads = await self.records.heads_of([c.key for c in fresh]) if fresh else {}
            found_unserved = False
            for candidate in fresh:
                if free <= 0:
                    return
                head = heads.get(candidate.key)
                graph_name = None if head is None else head.graph
                if head is None or head.graph not in graphs:
                    # Once per execution (and epoch): remembered in ``unserved`` from here on.
                    unserved[candidate.key] = candidate.epoch
                    found_unserved = True
                    logger.warning(
                        "execution %s is expired but its graph %r is not served here (this "
                        "loop serves %s): left untouched; to take it over, serve a graph "
                        "under the name %r (serve({%r: graph}), or a worker whose --graphs "
                        "factory returns that key)",
                        candidate.scope_key,
                        graph_name,
                        sorted(graphs),
                        graph_name,
                        graph_name,
                    )
                    continue
                try:
                    started = await self._take_one(
                        graphs[head.graph], candidate, head, running, budget, kwargs
                    )
                except Exception:
                    logger.warning("could not take %s over", candidate.scope_key, exc_info=True)
                    continue
                if started:
                    free -= 1
            if len(candidates) < limit or not found_unserved:
                return
            # A full window of newly found unserved executions may hide servable ones behind
            # it: look again at once, past them (doubling, so N of them take log N looks,
            # once; later polls skip them without a read).
            window *= 2

    async def _take_one(
        self,
        graph: Any,
        candidate: Lease,
        head: ExecutionHead,
        running: dict[asyncio.Task[None], list[_Run]],
        budget: int,
        kwargs: Mapping[str, Any],
    ) -> bool:
        """Take ``candidate`` over and start its run; whether a run was started.

        The recorded input is read only when the run needs it (no checkpoint yet), decoded
        with the graph's own allow-list; a record that cannot be, dead-letters the execution.
        """
        # The tenant names the thread too (another tenant's thread of the same id is another).
        config: RunnableConfig = {
            "configurable": {"thread_id": head.thread_id, "tenant_id": candidate.key.tenant_id}
        }
        # The thread's progress, for the takeover budget: its latest checkpoint, read before
        # the take (the take statement compares it with the mark the last take stored). The
        # expired holder may still land a checkpoint between this read and the take: that
        # progress is then seen by the next take, one take late.
        latest = await graph.checkpointer.aget_tuple(config)
        mark = None if latest is None else str(latest.config["configurable"]["checkpoint_id"])
        taken = await self.repository.take_over(
            candidate,
            self.instance_id,
            self.lease_ttl,
            progress_mark=mark,
            max_takeovers=budget,
        )
        if taken is None:
            return False  # renewed by its holder or taken by another instance meanwhile
        if taken.status is LeaseStatus.DEAD_LETTERED:
            self._dead_lettered(taken.scope_key, taken.epoch, taken.reason)
            return False
        self._events.emit(
            EventKind.TAKEN_OVER,
            taken.scope_key,
            taken.epoch,
            f"from {candidate.holder or 'no holder'} at token {candidate.epoch}",
        )
        # The record cannot change under us now: a new run of the key takes a new epoch.
        # A checkpoint found before the take is there still; none found is read again now
        # the take fenced the old holder (it may have landed its first one in between).
        from_input = latest is None and await graph.checkpointer.aget_tuple(config) is None
        try:
            record = await self.records.get(
                taken.key, allow=run_allowlist(graph), with_input=from_input
            )
            if record is None:
                raise LookupError(f"the record of execution {taken.scope_key!r} is gone")
        except Exception as exc:
            # Ours now (epoch + 1): left as it is, every instance would fail on it, poll
            # after poll. It cannot run anywhere: dead-letter it, saying why.
            reason = failure_reason(exc, prefix="its execution record cannot be loaded: ")
            await self.repository.dead_letter(taken.key, reason, epoch=taken.epoch)
            self._dead_lettered(taken.scope_key, taken.epoch, reason)
            return False
        # The run as it was started: its configurable keys, context, limits and options
        # (serve()'s own options are the defaults under them).
        config, options = restore_run(record.run, head.thread_id, candidate.key.tenant_id)
        runs: list[_Run] = []
        task = asyncio.create_task(
            self._resume(graph, config, record.input, taken, runs, {**kwargs, **options}),
            name=f"resume {taken.scope_key}",
        )
        running[task] = runs
        return True

    def _dead_lettered(self, scope_key: str, token: int, reason: str | None) -> None:
        """Say (to the listeners and the log) that an execution was dead-lettered."""
        self._events.emit(EventKind.DEAD_LETTERED, scope_key, token, reason)
        logger.warning(
            "execution %s dead-lettered at token %d: %s",
            scope_key,
            token,
            reason,
            extra={"scope_key": scope_key, "token": token},
        )

    async def _resume(
        self,
        graph: Any,
        config: RunnableConfig,
        input: Any,
        taken: Lease,
        runs: list[_Run],
        kwargs: Mapping[str, Any],
    ) -> None:
        """Run a taken execution: from its last checkpoint (``input`` None), or its input."""
        try:
            logger.info(
                "resuming %s at token %d from its %s",
                taken.scope_key,
                taken.epoch,
                "last checkpoint" if input is None else "recorded input",
            )
            async with self._run(
                graph,
                input,
                config,
                taken.key.tenant_id,
                taken.key.execution_id,
                kwargs,
                taken=taken,
            ) as run:
                runs.append(run)
                await graph.ainvoke(input, run.config, control=run.control, **kwargs)
        except GraphDrained:
            logger.info("run %s drained and handed back", taken.scope_key)
        except Exception:
            logger.warning("resumed run %s ended with an error", taken.scope_key, exc_info=True)

    # -- the life of one run

    def _prepare(
        self,
        graph: Any,
        config: RunnableConfig | None,
        tenant_id: str,
        execution_id: str | None,
        kwargs: Mapping[str, Any],
    ) -> tuple[LeaseKey, RunnableConfig]:
        from .checkpoint import FencedCheckpointer
        from .fail_closed import refuse_unfenced

        if not isinstance(getattr(graph, "checkpointer", None), FencedCheckpointer):
            raise ValueError(
                "graph was compiled without a fenced checkpointer: compile it with "
                "builder.compile(checkpointer=instance.checkpointer)"
            )
        refuse_unfenced(graph)
        if "control" in kwargs:
            raise ValueError(
                "control is set by the instance (it drains the run when the lease is lost); "
                "do not pass one"
            )
        if config is not None and not isinstance(config, Mapping):
            raise ValueError(f"config must be a dict (a RunnableConfig), got {config!r}")
        base: dict[str, Any] = dict(config or {})
        configurable = dict(base.get("configurable") or {})
        if FENCE_CONFIG_KEY in configurable:
            raise ValueError(
                f"config['configurable'][{FENCE_CONFIG_KEY!r}] is already set: the instance "
                "puts the run's handle there; pass the config of the run, not of a step"
            )
        thread_id = text_id(
            "config['configurable']['thread_id']",
            configurable.get("thread_id"),
            what="a fenced run is one thread, e.g. {'configurable': {'thread_id': 'order-42'}}",
        )
        text_id("tenant_id", tenant_id, what="the tenant the execution and its thread belong to")
        if execution_id is not None:
            text_id("execution_id", execution_id, what="the lease's execution id")
        given = configurable.get("tenant_id")
        if given is not None and given != tenant_id:
            raise ValueError(
                f"config['configurable']['tenant_id'] is {given!r} and tenant_id is "
                f"{tenant_id!r}: a run is of one tenant; pass the same tenant in both, or "
                "leave it out of the config"
            )
        if execution_id is None:
            execution_id = thread_id
        key = LeaseKey(tenant_id, execution_id)
        # The tenant is part of the thread's key: every read the runtime makes of the
        # thread (the state at the end of the run) is of this tenant's thread.
        configurable["tenant_id"] = tenant_id
        base["configurable"] = configurable
        return key, base  # type: ignore[return-value]

    async def _acquire(self, key: LeaseKey) -> RunHandle:
        sent_at = self.clock()
        # Every run may reopen a done or failed execution, whatever its input: new input is a
        # new turn, None or a Command resumes (or replays, or forks) from the checkpoint its
        # config names, as LangGraph does. Either is a new run at the next token; only a
        # dead-lettered execution stays shut (decide_acquire).
        lease = await self.repository.acquire(key, self.instance_id, self.lease_ttl, reopen=True)
        if lease is None:
            raise _refusal(key, await self.repository.get(key), self.instance_id)
        self._events.emit(EventKind.ACQUIRED, key.scope_key, lease.epoch)
        handle = RunHandle(
            self.repository, lease, self.lease_ttl, clock=self.clock, confirmed_from=sent_at
        )
        if lease.pending_effects:
            standing = non_idempotent_standing(lease)
            if standing:
                # The same decision as serve()'s take_over.
                reason = dead_letter_reason(standing, lease.epoch, self.instance_id, how="resumed")
                await self.repository.dead_letter(key, reason, epoch=lease.epoch)
                self._dead_lettered(key.scope_key, lease.epoch, reason)
                raise ExecutionDeadLetteredError(
                    f"execution {key.scope_key!r} was dead-lettered: {reason}"
                )
            # Idempotent writes converge on repeat: clear their entries and go on.
            lease = await self.repository.clear_pending_effects(lease)
            handle.replace_lease(lease, sent_at=sent_at)
        return handle

    @asynccontextmanager
    async def _run(
        self,
        graph: Any,
        input: Any,
        config: RunnableConfig | None,
        tenant_id: str,
        execution_id: str | None,
        kwargs: Mapping[str, Any],
        *,
        graph_name: str | None = None,
        taken: Lease | None = None,
    ) -> AsyncIterator[_Run]:
        key, base = self._prepare(graph, config, tenant_id, execution_id, kwargs)
        if graph_name is not None:
            text_id("graph_name", graph_name, what="the name serve() finds the graph under")
        if taken is None:
            thread_id = str(base["configurable"]["thread_id"])
            record = None
            if input is not None and not isinstance(input, Command):
                # Checked before anything is written: the name serve() finds the graph
                # under, and a run config a takeover can run with again.
                record = ExecutionRecord(
                    key,
                    _recorded_graph_name(graph, graph_name),
                    thread_id,
                    input,
                    record_run(
                        base,
                        kwargs,
                        serde=self._record_serde,
                        allow=run_allowlist(graph),
                    ),
                )
            # One thread, one execution: a run under another execution id of the thread's
            # tenant would hold a lease of its own and fork the thread. Checked before the
            # record and the lease, so a refused run leaves nothing behind.
            check_thread_binding(key, thread_id, await self.records.bind(key, thread_id))
            if record is not None:
                # Recorded before the lease is taken: a process that dies after its acquire
                # must leave a record for the instance that takes the execution over (one
                # that dies before it leaves no lease, so nothing to take over). Skipped
                # while the lease is held: a start that is refused must not rewrite the
                # record of the run in flight.
                if await self.records.record(record, unless_held=True):
                    record = None
            handle = await self._acquire(key)
        else:
            record = None
            handle = RunHandle(self.repository, taken, self.lease_ttl, clock=self.clock)
        control = RunControl()
        run_config: dict[str, Any] = dict(base)
        run_config["configurable"] = {
            **base["configurable"],
            FENCE_CONFIG_KEY: handle,
            "tenant_id": key.tenant_id,
            "execution_id": key.execution_id,
        }
        run = _Run(run_config, handle, control, base)  # type: ignore[arg-type]

        def drain(error: BaseException) -> None:
            control.request_drain(f"langgraph-fence: {error}")
            fenced = isinstance(error, ExecutionFencedError)
            kind = EventKind.FENCED if fenced else EventKind.LOST
            self._events.emit(kind, key.scope_key, handle.token, str(error))

        handle.on_stop(drain)
        run.timers = [
            asyncio.create_task(self._renew_loop(handle), name=f"renew {key.scope_key}"),
            asyncio.create_task(self._watchdog(handle), name=f"watchdog {key.scope_key}"),
        ]
        self._runs.add(run)
        logger.info(
            "run %s started at token %d on %s",
            key.scope_key,
            handle.token,
            self.instance_id,
            extra={"scope_key": key.scope_key, "token": handle.token},
        )
        try:
            try:
                if record is not None:
                    # The lease was held (expired) when the record was skipped; it is ours now.
                    await self.records.record(record)
                yield run
            finally:
                await _cancel_all(run.timers)
        except BaseException as exc:
            await self._settle_failure(run, exc)
            raise  # _settle_failure raises what stands; this is for the type checker
        else:
            await self._settle_success(graph, run)
        finally:
            self._runs.discard(run)

    async def _settle_success(self, graph: Any, run: _Run) -> None:
        handle = run.handle
        if handle.error is not None:
            raise handle.error
        if handle.dead_letter is not None:
            # The graph ended "normally" because something caught the dead letter (a
            # tool-retry wrapper answering the model, a try/except): the run is dead all the same.
            await self._dead_letter(handle, handle.dead_letter)
            raise handle.dead_letter
        # Where the thread stands now: its latest checkpoint, not the one a replay or a fork
        # named in the config (that one has the steps the run just ran still ahead of it).
        state = await graph.aget_state(_latest(run.base_config))
        status = LeaseStatus.WAITING if state.next else LeaseStatus.DONE
        await self._release(run, status, None)
        logger.info(
            "run %s ended %s at token %d",
            handle.scope_key,
            status.value,
            handle.token,
            extra={"scope_key": handle.scope_key, "token": handle.token},
        )

    async def _settle_failure(self, run: _Run, exc: BaseException) -> None:
        handle = run.handle
        # The fencing error is decided first, before cancellation, drains or anything else.
        found = find_fence_error(exc)
        if found is not None:
            handle.record(found)
        if handle.error is not None:
            await self._classify_loss(handle)
            raise handle.error
        dead = handle.dead_letter or find_error(exc, ExecutionDeadLetteredError)
        if dead is not None:
            await self._dead_letter(handle, dead)
            if dead is not exc:
                raise dead  # keeps its own cause: the error the write failed with
            return
        if isinstance(exc, GraphDrained):
            # Drained by request (not by a fence): hand the execution back for any instance.
            reason = bounded_reason(f"drained: {exc.reason}")
            await self._release(run, LeaseStatus.PENDING, reason)
            self._events.emit(EventKind.HANDED_BACK, handle.scope_key, handle.token, reason)
            return
        if is_database_connection_error(exc):
            # An infrastructure error, not the graph's: the store could not be reached while
            # the run's hold lasted (each call retried until then). The run stops as
            # lease-lost; its lease expires and serve() takes it over. Never ``failed``.
            handle.record(_lost_to_the_store(handle, exc))
            await self._classify_loss(handle)
            if not isinstance(handle.error, ExecutionFencedError):
                await self._hand_back(run, f"the store could not be reached: {failure_reason(exc)}")
            assert handle.error is not None
            raise handle.error from exc
        if isinstance(exc, asyncio.CancelledError):
            reason = "cancelled"
        else:
            reason = failure_reason(exc)
        await self._release(run, LeaseStatus.FAILED, reason)

    async def _hand_back(self, run: _Run, reason: str) -> None:
        """Release the run's lease as ``pending`` so serve() resumes it at once; a store
        still out of reach leaves it to expire (then it is taken over all the same)."""
        try:
            await self._release(run, LeaseStatus.PENDING, bounded_reason(reason))
            self._events.emit(EventKind.HANDED_BACK, run.handle.scope_key, run.handle.token, reason)
        except ExecutionLeaseLostError:
            pass  # recorded on the handle: it was taken over
        except Exception as exc:
            logger.warning(
                "could not hand %s back (%s): it is taken over once its lease expires",
                run.handle.scope_key,
                failure_reason(exc),
            )

    async def _dead_letter(self, handle: RunHandle, dead: ExecutionDeadLetteredError) -> None:
        reason = failure_reason(dead)
        await self.repository.dead_letter(handle.key, reason, epoch=handle.token)
        self._dead_lettered(handle.scope_key, handle.token, reason)

    async def _classify_loss(self, handle: RunHandle) -> None:
        """After a lapse, ask the store whether the run was taken over.

        A run that only lost track of its lease raises ``ExecutionLeaseLostError``; if the
        store shows a newer token, the caller gets the ``ExecutionFencedError`` instead. One
        round trip, on the failure path only. A store that cannot be reached (the lapse was
        an outage) is asked again on connection errors for up to one lease TTL: the answer
        after the outage tells whether another instance took the run over meanwhile.
        """
        if isinstance(handle.error, ExecutionFencedError):
            return
        try:
            with retry_window(FixedWindow.lasting(self.lease_ttl)):
                await asyncio.wait_for(handle.renew(), timeout=self.lease_ttl)
        except (ExecutionLeaseLostError, TimeoutError):
            pass
        except Exception:
            logger.warning("could not classify the loss of %s", handle.scope_key, exc_info=True)

    async def _release(self, run: _Run, status: LeaseStatus, reason: str | None) -> None:
        handle = run.handle
        await fault_point("release.before", handle=handle, status=status)
        try:
            await self.repository.release(handle.lease, status, reason)
        except ExecutionFencedError as exc:
            raise handle.record(exc) from None

    # -- timers

    async def _renew_loop(self, handle: RunHandle) -> None:
        while not isinstance(handle.error, ExecutionFencedError):
            await self._sleep(self.renew_interval)
            left = handle.confirmed_until - self.clock()
            try:
                # After a lapse this one more renewal tells a takeover (fenced) from a slow
                # store (lost); the run stops either way.
                await handle.renew()
                if left < self.renew_interval:
                    late = f"renewed with {max(left, 0.0):.1f} s of its proven hold left"
                    self._events.emit(EventKind.RENEWED_LATE, handle.scope_key, handle.token, late)
            except ExecutionLeaseLostError:
                return  # recorded on the handle; the run stops
            except Exception:
                # The store may be down for a moment: the watchdog decides when that
                # has lasted too long; until then the next renewal may get through.
                logger.warning("renewal of %s failed", handle.scope_key, exc_info=True)

    async def _watchdog(self, handle: RunHandle) -> None:
        while handle.error is None:
            remaining = handle.confirmed_until - self.clock()
            if remaining <= 0:
                try:
                    handle.check()
                except ExecutionLeaseLostError:
                    return
            await self._sleep(max(remaining, 0.0) + 1e-3)


#: The name ``StateGraph.compile()`` gives a graph compiled without ``name=``.
DEFAULT_GRAPH_NAME = "LangGraph"


def _recorded_graph_name(graph: Any, graph_name: str | None) -> str:
    """The name an execution of ``graph`` is recorded under: the one ``serve()`` finds it by.

    Raises:
        ValueError: neither ``graph_name`` nor a ``name=`` of the compiled graph says which
            graph it is (LangGraph's default name would strand the execution: no
            ``serve({"orders": graph})`` finds a record named ``"LangGraph"``).
    """
    if graph_name is not None:
        return graph_name
    name = getattr(graph, "name", None)
    if not isinstance(name, str) or not name or name == DEFAULT_GRAPH_NAME:
        raise ValueError(
            f"the graph has LangGraph's default name {name!r} and no graph_name was given: an "
            "execution is recorded under its graph's name, and another instance takes it over "
            "only if it serves a graph of that name, so this one could never be taken over. "
            'Name it: builder.compile(checkpointer=instance.checkpointer, name="orders") and '
            'serve({"orders": graph}) (the worker\'s --graphs factory returns that mapping), '
            'or pass instance.ainvoke(..., graph_name="orders"). Refused before anything was '
            "written"
        )
    return name


def _default_records(repository: ExecutionLeaseRepository) -> ExecutionRecords:
    """The records every instance on ``repository``'s store finds: in its database, or in
    memory for the memory store; refused for a store of another kind."""
    from .stores.sql import SqlLeaseRepository

    try:
        store = _base_store(repository)
    except ValueError:
        raise ValueError(
            f"records is required with a repository of type {type(repository).__name__}: "
            "pass records=SqlExecutionRecords(engine) on the lease table's database, so an "
            "instance that takes an execution over finds how to resume it"
        ) from None
    if isinstance(store, SqlLeaseRepository):
        return SqlExecutionRecords(store.engine)
    return MemoryExecutionRecords()


def _settings(
    instance_id: object, lease_ttl: object, renew_interval: object, max_takeovers: object
) -> tuple[str, float, float, int]:
    """The instance's id, TTL, renew interval and takeover budget, checked; else
    ``ValueError`` naming the argument and the fix."""
    ttl = positive_seconds("lease_ttl", lease_ttl, what="how long a hold lasts unrenewed")
    renew = positive_seconds(
        "renew_interval", ttl / 3 if renew_interval is None else renew_interval
    )
    if renew >= ttl - safety_margin(ttl):
        raise ValueError(
            f"renew_interval ({renew_interval}) must be below lease_ttl ({lease_ttl}) minus "
            f"its safety margin ({safety_margin(ttl):g} s), or the lease "
            "lapses between renewals: use lease_ttl / 3 (the default)"
        )
    if instance_id is None:
        instance_id = _default_instance_id()
    else:
        text_id("instance_id", instance_id, what="this instance's holder id in the lease table")
    return str(instance_id), ttl, renew, _budget(max_takeovers)


def _budget(max_takeovers: object) -> int:
    """``max_takeovers`` if an int >= 1, else ``ValueError`` naming it and the fix."""
    if max_takeovers is None:
        raise ValueError(
            "max_takeovers must be an int >= 1 (how many takeovers in a row without a new "
            "checkpoint an execution gets before it is dead-lettered), got None"
        )
    budget = validate_max_takeovers(max_takeovers)  # type: ignore[arg-type]
    assert budget is not None
    return budget


def _on_signals(stop: asyncio.Event) -> Callable[[], None]:
    """Set ``stop`` on SIGTERM and SIGINT; returns how to undo it."""
    import signal
    import threading

    if threading.current_thread() is not threading.main_thread():
        return lambda: None
    loop = asyncio.get_running_loop()
    installed = []
    for sig in (signal.SIGTERM, signal.SIGINT):
        try:
            loop.add_signal_handler(sig, stop.set)
            installed.append(sig)
        except (NotImplementedError, RuntimeError):
            pass

    def remove() -> None:
        for sig in installed:
            loop.remove_signal_handler(sig)

    return remove


def _serve_backoff(poll: float, failures: int) -> float:
    """The pause before serve()'s next look: ``poll``, doubling per failed look in a row up
    to ``MAX_SERVE_BACKOFF`` (never shorter than ``poll``)."""
    if failures <= 0:
        return poll
    return max(poll, min(MAX_SERVE_BACKOFF, poll * float(1 << min(failures, 16))))


def _lost_to_the_store(handle: RunHandle, exc: BaseException) -> ExecutionLeaseLostError:
    return ExecutionLeaseLostError(
        f"the lease of execution {handle.scope_key!r} at token {handle.token} can no longer "
        f"be proven held: the store could not be reached while it lasted ({failure_reason(exc)}). "
        "Another worker takes it over once it expires; this run must not write again.",
        scope_key=handle.scope_key,
        token_held=handle.token,
        token_seen=None,
    )


def _latest(config: RunnableConfig) -> RunnableConfig:
    """``config`` naming its thread's latest checkpoint (no ``checkpoint_id``)."""
    configurable = {
        k: v for k, v in (config.get("configurable") or {}).items() if k != "checkpoint_id"
    }
    return {**config, "configurable": configurable}


def _refusal(
    key: LeaseKey, current: Lease | None, me: str
) -> ExecutionLeaseHeldError | ExecutionEndedError:
    """Why ``acquire`` (which reopens done and failed executions) did not take ``key``."""
    if current is not None and current.status is LeaseStatus.DEAD_LETTERED:
        extra = f" ({current.reason})" if current.reason else ""
        return ExecutionEndedError(
            f"execution {key.scope_key!r} was dead-lettered{extra}: it never runs again, "
            "resumed or not, until an operator decides. Inspect it with `langgraph-fence "
            "dead-letters`; once what it stamped is settled, `langgraph-fence resolve "
            "--retry` resumes it from its last checkpoint",
            status=current.status.value,
            reason=current.reason,
        )
    if current is None or current.holder is None or current.expires_at is None:
        # Taken and given back by another run between the refused take and this read.
        return ExecutionLeaseHeldError(
            f"the lease of execution {key.scope_key!r} was taken by another run while this "
            "one asked for it; try again"
        )
    who = "this instance" if current.holder == me else f"instance {current.holder!r}"
    return ExecutionLeaseHeldError(
        f"execution {key.scope_key!r} is held by {who} at token {current.epoch} until "
        f"{current.expires_at} (store clock): wait for that run to end, or for its lease to "
        "expire if that instance died"
    )


async def _cancel_all(tasks: list[asyncio.Task[None]]) -> None:
    for task in tasks:
        task.cancel()
    for task in tasks:
        try:
            await task
        except asyncio.CancelledError:
            pass
        except Exception:
            logger.exception("timer task failed")

"""``Instance``: the process-level runtime that runs graphs under leases.

One instance holds leases, renews them on timers, runs graphs with the run's handle in their
config, and releases each lease with the run's outcome. Where a run loses its lease (a
renewal refused, or renewals failing until the confirmed window ran out) the instance marks
the run's handle, drains the graph at the next superstep boundary, cancels the steps in
flight, and raises the recorded fencing error, whatever LangGraph surfaced instead.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Callable, Iterator, Mapping, Sequence
from contextlib import asynccontextmanager, contextmanager
from typing import TYPE_CHECKING, Any

from langchain_core.runnables import RunnableConfig

from langgraph_fence.contracts import require_implements
from langgraph_fence.events import FenceListener, Listeners
from langgraph_fence.execution.callbacks import RunEndCallback
from langgraph_fence.execution.children import refuse_child_ids
from langgraph_fence.execution.collector import collector
from langgraph_fence.execution.host import InstanceHost
from langgraph_fence.execution.keeper import Keeper, Renewer, Sleep, thread_store
from langgraph_fence.execution.retries import RunRetry
from langgraph_fence.execution.run import running
from langgraph_fence.instance._database import open_database
from langgraph_fence.instance._failover import watch_failovers
from langgraph_fence.instance._settings import (
    DEFAULT_TENANT_ID,
    Settings,
    check_open_options,
    check_settings,
    check_tenant,
    default_records,
)
from langgraph_fence.keys import FENCE_CONFIG_KEY
from langgraph_fence.lease import ExecutionLeaseRepository, LeaseKey
from langgraph_fence.lease.journal import Journal
from langgraph_fence.lease.records import ExecutionRecords, check_thread_binding
from langgraph_fence.lease.timeline import OnFailover, failover_mode
from langgraph_fence.lease.transitions import DEFAULT_MAX_TAKEOVERS
from langgraph_fence.queue import (
    Flow,
    NotBefore,
    OnBusy,
    Schedules,
    SubmittedRun,
    SubmittedRuns,
    callback_targets,
    check_not_before,
    check_stream_mode,
)
from langgraph_fence.saver.admin import ThreadAdmin, admin_holder
from langgraph_fence.saver.store import FencedStore

if TYPE_CHECKING:
    from langgraph.checkpoint.base import BaseCheckpointSaver
    from langgraph.checkpoint.serde.base import SerializerProtocol

__all__ = ["Instance"]


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
        max_held: how many executions the instance holds at once. Default: as many as it
            renews at 3 000 leases a second
            (:func:`~langgraph_fence.execution.keeper.default_max_held`),
            at most 10 000 where the renewals run in their thread (10 000 at the default TTL,
            3 000 at TTL 3 s) and 1 000 where they run on the loop. Every lease it holds is
            renewed by its one keeper, batched; past the limit :meth:`ainvoke` raises
            :class:`~langgraph_fence.InstanceFullError` before anything is written, and
            :meth:`serve` takes nothing over until a run ends.
            Below it too, while the renewals of the leases it holds run late, a new run
            waits for them to catch up (at most a TTL, then the same error) and
            :meth:`serve` takes nothing over.
        renewer: where the renewals run (:mod:`langgraph_fence.execution.keeper`). ``"auto"`` (the
            default): in a thread with an event loop and database connections of its own
            when the repository is a :class:`~langgraph_fence.SqlLeaseRepository` (not in
            memory) and neither ``clock`` nor ``sleep`` is injected, so a busy or blocked
            event loop (thousands of runs starting or ending at once, a node doing
            synchronous work) does not delay them; it keeps renewing while the loop has not
            run for up to ``max(lease_ttl, 10 s)``, then lets the leases lapse. Otherwise
            (an injected clock or sleep, as in the ``leases`` fixture; a memory or
            wrapped store) on the instance's event loop, where a loop busier than a
            lease's slack loses the lease (a wrapped store logs a warning saying so).
            ``"thread"`` requires the thread (``ValueError`` where it cannot run);
            ``"loop"`` renews on the loop.
        manage_gc: keep the garbage collector's full passes, which stop every thread of
            the process, shorter than the leases held can wait (default ``True``): while
            leases are held, the objects that survived are frozen every few seconds
            (``gc.freeze()``), and a full pass that returns the memory of unreachable
            cycles runs only while no lease is held in the process or when it fits in the
            leases' slack (:mod:`~langgraph_fence.execution.collector`). An application
            that froze objects itself or disabled the collector is left alone. The
            collector is the process's: an application that runs it itself passes
            ``False`` to every instance.
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
        max_held: int | None = None,
        renewer: Renewer = "auto",
        manage_gc: bool = True,
    ) -> None:
        settings = check_settings(
            instance_id, lease_ttl, renew_interval, max_takeovers, max_held, renewer, manage_gc
        )
        self._setup(repository, saver, records, settings, clock, sleep, check_tenant(tenant_id))

    def _setup(
        self,
        repository: ExecutionLeaseRepository,
        saver: BaseCheckpointSaver[Any],
        records: ExecutionRecords | None,
        settings: Settings,
        clock: Callable[[], float] | None,
        sleep: Sleep | None,
        tenant_id: str = DEFAULT_TENANT_ID,
    ) -> None:
        """The instance on checked ``settings`` (``__init__`` and ``open`` check them once)."""
        import langgraph_fence.steps.graph_calls as graph_calls
        from langgraph_fence.from_thread import running_loop
        from langgraph_fence.saver.checkpoint import FencedCheckpointer

        require_implements(repository, ExecutionLeaseRepository, argument="repository")
        if records is not None:
            require_implements(records, ExecutionRecords, argument="records")
        self.instance_id = settings.instance_id
        self.lease_ttl = settings.lease_ttl
        self.renew_interval = settings.renew_interval
        self.max_takeovers = settings.max_takeovers
        #: The tenant of a graph called the LangGraph way whose config names none.
        self.tenant_id = tenant_id
        self._repository = repository
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
            records if records is not None else default_records(repository)
        )
        # Admin operations through this instance's checkpointer hold the execution's lease.
        self.checkpointer.admin = ThreadAdmin(
            repository,
            self.records,
            holder=admin_holder(self.instance_id),
            ttl=self.lease_ttl,
        )
        #: The graphs serve() serves here, by name: where a step's PARENT_INSTANCE child
        #: finds its graph when it names no other (``spawn_child(..., graph=...)``).
        self.served_graphs: dict[str, Any] = {}
        events = Listeners(self.instance_id)
        renew_through = thread_store(repository, renewer=settings.renewer, clock=clock, sleep=sleep)
        keeper = Keeper(
            ttl=self.lease_ttl,
            renew_interval=self.renew_interval,
            clock=self.clock,
            sleep=self._sleep,
            events=events,
            holder=self.instance_id,
            max_held=settings.max_held,
            thread_store=renew_through,
            collector=collector() if settings.manage_gc else None,
        )
        #: What this instance's runs, its takeover loop and their children use of it.
        self.host = InstanceHost(
            instance_id=self.instance_id,
            lease_ttl=self.lease_ttl,
            clock=self.clock,
            repository=repository,
            records=self.records,
            checkpointer=self.checkpointer,
            keeper=keeper,
            events=events,
            served_graphs=self.served_graphs,
        )
        #: The fenced LangGraph store on the instance's database (``Instance.open``):
        #: ``compile(checkpointer=instance.checkpointer, store=instance.store)``.
        self.store: FencedStore | None = None
        #: What writes this instance's events to ``fence_journal`` (``Instance.open``,
        #: unless ``journal=False``), or ``None``.
        self.journal: Journal | None = None

    @property
    def repository(self) -> ExecutionLeaseRepository:
        """The lease store every run of this instance takes and renews its lease in."""
        return self._repository

    @repository.setter
    def repository(self, repository: ExecutionLeaseRepository) -> None:
        # Replaced (a wrapper around the store, in tests): its runs use the new one too.
        self._repository = repository
        if hasattr(self, "host"):
            self.host.repository = repository

    @property
    def max_held(self) -> int:
        """The most executions this instance holds at once (``max_held``, or its default)."""
        return self.host.keeper.max_held

    def add_listener(self, listener: FenceListener) -> Callable[[], None]:
        """Call ``listener(event)`` with every :class:`~langgraph_fence.FenceEvent` of this
        instance's runs (acquired, renewed late, lost, fenced, taken over, dead-lettered,
        handed back); returns a function that removes it.

        A listener runs on the event loop and must not block; one that raises is logged and
        never breaks a run (:mod:`langgraph_fence.events`).
        """
        return self.host.events.add(listener)

    @classmethod
    @asynccontextmanager
    async def open(
        cls,
        url: str,
        *,
        schema: str | None = None,
        engine_options: Mapping[str, Any] | None = None,
        serde: SerializerProtocol | None = None,
        journal: bool = True,
        on_failover: OnFailover | None = None,
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
            schema: PostgreSQL only: the schema every table of the instance is in (the
                connections' ``search_path``), created if it does not exist; default: the
                role's search_path. A ``ValueError`` naming ``schema`` with a SQLite URL.
            engine_options: passed to :func:`langgraph_fence.database.create_engine`.
            serde: the serializer of checkpoints and execution records (default: LangGraph's
                in strict msgpack mode, :func:`langgraph_fence.serde.safe_serializer`; a
                stored payload constructs no type outside its allow-list).
            journal: record each turn of its runs' leases (takes, takeovers, refused
                writes, dead letters) in ``fence_journal``, in the background, for the
                operator's console (``langgraph-fence ui``) and ``/metrics``; never delays a
                run (:mod:`langgraph_fence.lease.journal`).
            on_failover: PostgreSQL: what a failover of the database does to the executions
                in flight when it happened. ``"quarantine"`` (the default): they are
                dead-lettered with a reason naming the failover, never repeated (the
                promoted server may lack the old primary's last takeover or stamp), and no
                take lands until they are. ``"trust"``: they resume; only for synchronous
                replication or quorum storage. Tokens keep rising across a failover either
                way (:mod:`langgraph_fence.lease.timeline`, docs/replication.md). ``None``:
                ``$LANGGRAPH_FENCE_ON_FAILOVER``, else ``"quarantine"``.
            **options: :class:`Instance` options (``instance_id``, ``lease_ttl``,
                ``renew_interval``, ``clock``, ``sleep``, ``max_takeovers``, ``tenant_id``,
                ``max_held``, ``renewer``).
        """
        # Refused before the engine exists: bad input creates no table and writes no row.
        settings, tenant_id = check_open_options(cls.__init__, options)
        on_failover = failover_mode(on_failover)
        async with open_database(
            url, schema=schema, engine_options=engine_options, serde=serde, on_failover=on_failover
        ) as database:
            instance = cls.__new__(cls)
            instance._setup(
                database.repository,
                database.saver,
                database.records,
                settings,
                options.get("clock"),
                options.get("sleep"),
                tenant_id,
            )
            store = await database.open_store(tenant_id)  # outside a step: its tenant
            instance.store = FencedStore(store)
            # An erased thread's runs' items go with it.
            instance.checkpointer.admin.store = store  # type: ignore[union-attr]
            written = Journal(database.engine, own_pool=True) if journal else None
            if written is not None:
                instance.add_listener(written)
            instance.journal = written
            try:
                async with watch_failovers(
                    database.repository, instance.host.events, instance.renew_interval
                ):
                    yield instance
            finally:
                try:
                    await instance.aclose()
                finally:
                    if written is not None:
                        await written.aclose()
                    await database.aclose()

    @classmethod
    @contextmanager
    def open_sync(cls, url: str, **options: Any) -> Iterator[Instance]:
        """:meth:`open` for a sync program (Flask, Django, Celery, a script): the instance
        runs on an event loop of its own, in a thread of its own, until the block ends.

        ``graph.invoke`` / ``stream`` / ``batch`` / ``update_state`` of a graph compiled
        with ``instance.checkpointer`` then run fenced from any thread, as
        ``graph.ainvoke`` does on an async instance (:mod:`langgraph_fence.steps.graph_calls`).
        Takes the arguments of :meth:`open`.
        """
        from langgraph_fence.from_thread import loop_thread

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
        """Stop renewing the leases of every run still in flight (they then lapse), and
        give back the connections the run queue holds."""
        await self.host.keeper.aclose()
        queue = self.host.queue_made()
        if queue is not None:
            await queue.aclose()

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
        ``interrupt_before`` and ``interrupt_after`` (:mod:`langgraph_fence.lease.run_config`).
        Callbacks and other live objects are not carried over to a takeover; a value that
        cannot be recorded is refused with a ``ValueError`` naming it, before anything is
        written.

        Raises:
            ExecutionFencedError: the lease was taken over during the run.
            ExecutionLeaseLostError: the lease could not be renewed in time.
            ExecutionLeaseHeldError: another live instance holds the lease.
            InstanceFullError: the instance holds ``max_held`` executions already, or the
                renewals of those it holds ran late for the whole lease TTL the start
                waited; nothing was written.
            ExecutionEndedError: the execution was dead-lettered: it runs again only after
                an operator's ``langgraph-fence resolve``.
            ExecutionDeadLetteredError: the run was dead-lettered (a non-idempotent
                write may have happened and is not repeated).
            ExecutionThreadBoundError: the tenant's thread belongs to another execution id
                (a ``ValueError``); refused before anything runs.
            ValueError: bad arguments (a default-named graph without ``graph_name``, a run
                config value that cannot be recorded), before anything runs or is written.
        """
        async with running(
            self.host, graph, input, config, tenant_id, execution_id, kwargs, graph_name=graph_name
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
        async with running(
            self.host, graph, input, config, tenant_id, execution_id, kwargs, graph_name=graph_name
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
        async with running(self.host, graph, None, config, tenant_id, execution_id, {}) as run:
            updated: RunnableConfig = await graph.aupdate_state(
                run.config, values, as_node=as_node, task_id=task_id
            )
        configurable = {
            k: v
            for k, v in dict(updated.get("configurable") or {}).items()
            if k != FENCE_CONFIG_KEY
        }
        return {**updated, "configurable": configurable}

    # -- runs any worker can take

    async def submit(
        self,
        graph_name: str,
        input: Any,
        config: RunnableConfig | None = None,
        *,
        tenant_id: str,
        execution_id: str | None = None,
        on_busy: OnBusy = "reject",
        not_before: NotBefore | None = None,
        flow: Flow | None = None,
        stream_mode: str | Sequence[str] | None = None,
        webhook: str | None = None,
        callback: str | None = None,
        **options: Any,
    ) -> SubmittedRun:
        """Hand a run to any worker: record it pending and return its handle at once.

        The execution (graph name, thread, input, and the run config as :meth:`ainvoke`
        records it) is recorded and its lease set ``pending`` in one transaction; any
        instance whose :meth:`serve` serves ``graph_name`` claims it at the next token and
        runs it (:mod:`langgraph_fence.queue`). A graph name no worker serves yet is
        accepted (``langgraph-fence runs`` shows it waiting, unserved).

        Idempotent: the same graph, input and run config submitted again while that run is
        pending, running or queued returns that run and writes nothing. Other input for a
        busy execution (a run pending or running, or runs queued) is handled by
        ``on_busy``: ``"reject"`` raises :class:`~langgraph_fence.ExecutionBusyError`;
        ``"enqueue"`` queues it: it runs after the runs before it, in submit order, each
        once, with its own handle and output; ``"interrupt"`` fences the run in flight
        (none of its later writes lands, it ends ``failed``) and the new input runs next
        on the thread (runs queued behind stay queued, after it).

        Args:
            graph_name: the name a worker serves the graph under.
            input: the graph's input (storable data).
            config: the run config; ``config["configurable"]["thread_id"]`` is required.
            tenant_id: the tenant the execution and its thread belong to.
            execution_id: the lease's execution id (default: the thread id).
            on_busy: ``"reject"`` (default), ``"enqueue"`` or ``"interrupt"``.
            not_before: no worker starts the run before this: an aware ``datetime``, or a
                delay (seconds or a ``timedelta``) from the submit, judged by the
                database's clock, never a worker's. Until then it is pending, listed with
                its time (``RunState.not_before``), and cancellable.
            flow: the flow key the run counts against and the key's limits
                (``Flow("user-42", max_running=2, max_starts=5, per=1.0)``): it starts only
                when no more than ``max_running`` of the key's runs would run and no more
                than ``max_starts`` would have started in the last ``per`` seconds, across
                every worker; until then it is pending, held back.
            stream_mode: record the run's stream in these modes (``"values"``,
                ``"updates"``, ``"custom"``, ``"messages"``), for
                :meth:`SubmittedRun.astream <langgraph_fence.queue.SubmittedRun.astream>` in
                any process: each step's events are written under the run's lease before
                its checkpoint, and a takeover withdraws what it runs again. Default: not
                recorded (nothing written per event).
            webhook: an ``http(s)`` URL the serving workers POST the run's end to (JSON:
                a :class:`~langgraph_fence.execution.callbacks.RunEnd`), at least once,
                retried after a failure (an ``Idempotency-Key`` header names the run).
            callback: the name of a Python callback a serving worker registers
                (``serve(callbacks={name: fn})``), called with the run's end, at least
                once, retried after a failure.
            **options: recorded ``ainvoke`` options (``context``, ``durability``, ...).

        Raises:
            ValueError: a bad argument or a non-serialisable input, named; nothing written.
            ExecutionBusyError: busy with other input and ``on_busy="reject"``.
            ExecutionThreadBoundError: the thread belongs to another execution id.
            ExecutionEndedError: the execution was dead-lettered.
            TypeError: the instance is not on a SQL database.
        """
        queue = self._run_queue()
        key, thread_id, run = queue.check(
            graph_name, input, config, tenant_id, execution_id, on_busy, options
        )
        start = check_not_before(not_before)
        modes = () if stream_mode is None else check_stream_mode(stream_mode)
        targets = callback_targets(webhook, callback)
        if flow is not None and not isinstance(flow, Flow):
            raise TypeError(f"flow must be a langgraph_fence.queue.Flow, got {flow!r}")
        refuse_child_ids(thread_id, execution_id)
        check_thread_binding(key, thread_id, await self.records.bind(key, thread_id))
        listed = not isinstance(stream_mode, str)
        run_id = await queue.submit(
            key, graph_name, thread_id, input, run, on_busy, start, flow, modes, listed, targets
        )
        return SubmittedRun(queue, key, run_id, checkpointer=self.checkpointer)

    @property
    def schedules(self) -> Schedules:
        """The schedules on this instance's database: ``await instance.schedules.create(
        "nightly", "report", input, config, tenant_id=..., cron="0 2 * * *")`` submits one
        run at each tick, fired exactly once by whichever worker's :meth:`serve` looks
        first (:class:`~langgraph_fence.queue.Schedules`).

        Raises:
            TypeError: the instance is not on a SQL database.
        """
        return self._run_queue().schedules

    def get_run(
        self, execution_id: str, *, tenant_id: str, run_id: str | None = None
    ) -> SubmittedRun:
        """A handle on a run of ``(tenant_id, execution_id)``, from any process: the
        submitted run ``run_id`` (:attr:`SubmittedRun.run_id`), or without it the
        execution's run, whichever is the latest."""
        return SubmittedRun(
            self._run_queue(),
            LeaseKey(tenant_id, execution_id),
            run_id,
            checkpointer=self.checkpointer,
        )

    def queue_or_none(self) -> SubmittedRuns | None:
        """The run queue, or ``None`` where there is none (not a SQL store)."""
        return self.host.queue_or_none()

    def _run_queue(self) -> SubmittedRuns:
        """The run queue on the lease table's database (SQL stores only)."""
        return self.host.run_queue()

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
        listen: bool = True,
        run_retries: Mapping[str, RunRetry] | None = None,
        callbacks: Mapping[str, RunEndCallback] | None = None,
        callback_retry: RunRetry | None = None,
        **kwargs: Any,
    ) -> None:
        """Take over expired executions and claim submitted runs, and run them to their end,
        until ``stop`` is set.

        A submitted run (:meth:`submit`) is a pending execution with no holder: it is taken
        as any handed-back one, fairly across tenants (round-robin by tenant, each
        tenant's oldest first), and its output is kept with it (:mod:`langgraph_fence.queue`).

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
        take; the input checkpoint a run writes before its first step is not progress)
        starts the count again; so does a run that ends or reaches an interrupt, and
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
            listen: on PostgreSQL, wake at once when an execution becomes runnable (a
                submit, a child recorded, a run handed back by its instance: LISTEN/NOTIFY
                on one pooled connection, opened again if the database drops it);
                ``False``: find them by polling only. An expired lease whose instance died
                is found by polling.
            run_retries: graph name -> :class:`~langgraph_fence.execution.retries.RunRetry`:
                a submitted run of that graph that fails with an error the policy retries
                runs again from its last checkpoint after the backoff (on the store's
                clock, by any worker, at the next token), up to its attempts; never while
                a non-idempotent stamp of it stands. ``RunState.attempts`` counts them.
            callbacks: name -> callable (sync or async) of a :class:`~langgraph_fence.
                execution.callbacks.RunEnd`: called, at least once, when a run submitted
                with ``callback=`` that name ends (by whichever worker registering it
                looks first). Every serving loop POSTs the webhooks of runs submitted with
                ``webhook=``.
            callback_retry: how a failed delivery is retried (a ``RunRetry``; default 5
                attempts, 2 s doubling), then its callback is ``failed``.
            **kwargs: passed to each ``graph.ainvoke`` (``durability``, ...); an option the
                run recorded (e.g. its ``durability``) wins over these.
        """
        from langgraph_fence.execution.serve import Server

        server = Server(
            self.host,
            graphs,
            concurrency=concurrency,
            poll_interval=poll_interval,
            max_takeovers=self.max_takeovers if max_takeovers is None else max_takeovers,
            kwargs=kwargs,
            listen=listen,
            run_retries=run_retries,
            callbacks=callbacks,
            callback_retry=callback_retry,
        )
        self.served_graphs.update(graphs)
        await server.run(
            stop if stop is not None else asyncio.Event(), handle_signals=handle_signals
        )

"""The life of one run: prepare, record, acquire, keep, settle, release.

:func:`running` is the whole life of a run of an :class:`~langgraph_fence.Instance`, as a
context manager around the graph's call: its arguments are checked and its record written
before the lease is taken; its handle goes into the run's config and is kept (renewed and
watched, :mod:`langgraph_fence.execution.keeper`) while the graph runs; its end is decided by
:func:`langgraph_fence.execution.outcome.decide_outcome` and the lease released with that outcome in
one guarded statement.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator, Mapping, Sequence
from contextlib import asynccontextmanager
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from langchain_core.callbacks import AsyncCallbackManager, BaseCallbackManager
from langchain_core.runnables import RunnableConfig
from langgraph.callbacks import GraphCallbackHandler, GraphInterruptEvent
from langgraph.runtime import RunControl
from langgraph.types import Command

from langgraph_fence.database.retry import FixedWindow, retry_window
from langgraph_fence.errors import (
    ExecutionDeadLetteredError,
    ExecutionEndedError,
    ExecutionFencedError,
    ExecutionLeaseHeldError,
    ExecutionLeaseLostError,
)
from langgraph_fence.events import EventKind, Listeners
from langgraph_fence.execution.children import parse_child_execution_id, refuse_child_ids
from langgraph_fence.execution.outcome import Settle, decide_outcome
from langgraph_fence.fence import RunHandle
from langgraph_fence.fence.tree_activity import wake_parent
from langgraph_fence.keys import FENCE_CONFIG_KEY
from langgraph_fence.lease import Lease, LeaseKey, LeaseStatus
from langgraph_fence.lease.faults import fault_point
from langgraph_fence.lease.records import ExecutionRecord, SqlExecutionRecords, check_thread_binding
from langgraph_fence.lease.run_config import record_run, run_allowlist
from langgraph_fence.lease.sql import SqlLeaseRepository
from langgraph_fence.queue.notifications import NOTIFY_CHANNEL
from langgraph_fence.redact import bounded_reason, failure_reason
from langgraph_fence.validate import MAX_ID_BYTES, text_id

if TYPE_CHECKING:
    from langgraph_fence.execution.host import InstanceHost

__all__ = ["DEFAULT_GRAPH_NAME", "GraphEnd", "Run", "announce_dead_letter", "running"]

logger = logging.getLogger(__name__)

#: The name ``StateGraph.compile()`` gives a graph compiled without ``name=``.
DEFAULT_GRAPH_NAME = "LangGraph"


class GraphEnd(GraphCallbackHandler):
    """How the run's graph ended, as LangGraph tells its lifecycle callbacks: a root graph
    that ran to its end (``on_chain_end``) and whether it stopped at an interrupt
    (``on_interrupt``: ``interrupt()`` or a static breakpoint).

    Attached to the run's config for the root graph only (not inherited by its steps), so
    the run's end is known without reading the thread's state back.
    """

    run_inline = True  # nothing to hand to a thread: it only notes what it heard

    def __init__(self) -> None:
        super().__init__()
        self.returned = False
        self.interrupted: str | None = None  # the loop's status at the interrupt

    # Only the graph's own start, end and interrupts are of interest.
    ignore_llm = ignore_retry = ignore_agent = ignore_retriever = True
    ignore_chat_model = ignore_custom_event = True

    async def on_interrupt(self, event: GraphInterruptEvent) -> None:
        self.interrupted = event.status

    async def on_chain_end(self, outputs: Any, **kwargs: Any) -> None:
        self.returned = True

    def status(self) -> LeaseStatus | None:
        """``done`` or ``waiting`` when the graph said how it ended; ``None`` when only the
        thread's state can tell (the graph did not run its loop, as ``aupdate_state``; or
        it stopped after a step with ``interrupt_after``, which LangGraph reports as an
        interrupt even when no step is left)."""
        if not self.returned or self.interrupted == "interrupt_after":
            return None
        return LeaseStatus.DONE if self.interrupted is None else LeaseStatus.WAITING

    def attach(self, callbacks: Any) -> Any:
        """``callbacks`` (a run config's) with this handler added for the root graph only;
        callbacks of an unknown kind are left as they are (the state is read instead)."""
        if callbacks is None:
            return AsyncCallbackManager(handlers=[self])
        if isinstance(callbacks, list):
            return AsyncCallbackManager(
                handlers=[*callbacks, self], inheritable_handlers=list(callbacks)
            )
        if isinstance(callbacks, BaseCallbackManager):
            joined = callbacks.copy()
            joined.add_handler(self, inherit=False)
            return joined
        return callbacks


@dataclass(slots=True, eq=False)
class Run:
    """One run in flight: its config, handle and control, and how its graph ended."""

    config: RunnableConfig
    handle: RunHandle
    control: RunControl
    base_config: RunnableConfig
    end: GraphEnd


@asynccontextmanager
async def running(
    host: InstanceHost,
    graph: Any,
    input: Any,
    config: RunnableConfig | None,
    tenant_id: str,
    execution_id: str | None,
    kwargs: Mapping[str, Any],
    *,
    graph_name: str | None = None,
    taken: Lease | None = None,
) -> AsyncIterator[Run]:
    """One run of ``graph`` under its execution's lease, for the body of the block.

    A new run (``taken`` None) takes one of the instance's slots first (else
    :class:`~langgraph_fence.InstanceFullError`, nothing written), waits while the renewals
    of the runs held run late and then its turn to start, binds the thread, records the
    execution (when it has input) and takes the lease; a run ``serve()`` took over comes
    with its lease and its slot. The block runs the graph with ``run.config`` and
    ``run.control``; leaving it settles the outcome and releases the lease (or raises the
    fencing error that stands), then gives the slot back.
    """
    what = f"execution {tenant_id!r}/{execution_id or 'its thread'!r}"
    if taken is None:
        host.keeper.admit(what)
    # A new run's start (its binding, record, lease) waits its turn: a burst of starts
    # queues here, not on the connection pool (``keeper.MAX_STARTING``).
    starting = host.keeper.starting if taken is None else None
    my_turn = False
    try:
        if starting is not None:
            # The leases held come first: while their renewals run late, wait (each start
            # at most one TTL, however many wait, not one after another in turn).
            await host.keeper.in_time(what)
            await starting.acquire()
            my_turn = True
        async with _running(
            host,
            graph,
            input,
            config,
            tenant_id,
            execution_id,
            kwargs,
            graph_name=graph_name,
            taken=taken,
        ) as run:
            if starting is not None and my_turn:
                my_turn = False
                starting.release()
            yield run
    finally:
        if starting is not None and my_turn:
            starting.release()
        host.keeper.leave()


@asynccontextmanager
async def _running(
    host: InstanceHost,
    graph: Any,
    input: Any,
    config: RunnableConfig | None,
    tenant_id: str,
    execution_id: str | None,
    kwargs: Mapping[str, Any],
    *,
    graph_name: str | None,
    taken: Lease | None,
) -> AsyncIterator[Run]:
    # A run that records its input needs a name serve() finds the graph by: said with
    # every other problem of the graph at once.
    records = taken is None and input is not None and not isinstance(input, Command)
    problem = graph_name_problem(graph, graph_name) if records else None
    key, base = prepare(
        graph,
        config,
        tenant_id,
        execution_id,
        kwargs,
        from_caller=taken is None,
        also=() if problem is None else (problem,),
    )
    if graph_name is not None:
        text_id("graph_name", graph_name, what="the name serve() finds the graph under")
    if taken is None:
        thread_id = str(base["configurable"]["thread_id"])
        # A start of your own: a child's ids are refused (a takeover or a claim, taken,
        # runs the child as spawned).
        refuse_child_ids(thread_id, execution_id)
        record = None
        if input is not None and not isinstance(input, Command):
            # Checked before anything is written: the name serve() finds the graph
            # under, and a run config a takeover can run with again.
            record = ExecutionRecord(
                key,
                recorded_graph_name(graph, graph_name),
                thread_id,
                input,
                record_run(
                    base,
                    kwargs,
                    serde=host.record_serde,
                    allow=run_allowlist(graph),
                ),
            )
        handle, record = await take(host, key, thread_id, record)
        await host.keeper.confirm_start(handle)
    else:
        record = None
        handle = RunHandle(host.repository, taken, host.lease_ttl, clock=host.clock)
    handle.host = host
    control = RunControl()
    run_config: dict[str, Any] = dict(base)
    run_config["configurable"] = {
        **base["configurable"],
        FENCE_CONFIG_KEY: handle,
        "tenant_id": key.tenant_id,
        "execution_id": key.execution_id,
    }
    end = GraphEnd()
    run_config["callbacks"] = end.attach(base.get("callbacks"))
    run = Run(run_config, handle, control, base, end)  # type: ignore[arg-type]
    events = host.events

    def drain(error: BaseException) -> None:
        control.request_drain(f"langgraph-fence: {error}")
        fenced = isinstance(error, ExecutionFencedError)
        kind = EventKind.FENCED if fenced else EventKind.LOST
        events.emit(kind, key.scope_key, handle.token, str(error))

    handle.on_stop(drain)
    host.keeper.keep(handle)
    host.runs.add(run)
    logger.info(
        "run %s started at token %d on %s",
        key.scope_key,
        handle.token,
        host.instance_id,
        extra={"scope_key": key.scope_key, "token": handle.token},
    )
    try:
        try:
            if record is not None:
                # The lease was held (expired) when the record was skipped; it is ours now.
                await host.records.record(record)
            yield run
        finally:
            await host.keeper.release(handle)
    except BaseException as exc:
        await _settle(host, graph, run, exc)
        raise  # _settle raises what stands; this is for the type checker
    else:
        await _settle(host, graph, run, None)
    finally:
        parent = parse_child_execution_id(key.execution_id)
        if parent is not None:
            # A child ended: its parent, yielded while it waits, may now be runnable.
            await wake_parent(handle, parent[0])
        host.runs.discard(run)


def prepare(
    graph: Any,
    config: RunnableConfig | None,
    tenant_id: str,
    execution_id: str | None,
    kwargs: Mapping[str, Any],
    *,
    from_caller: bool = True,
    also: Sequence[str] = (),
) -> tuple[LeaseKey, RunnableConfig]:
    """The run's lease key and its config (with its tenant), every argument checked;
    ``ValueError`` naming the argument and the fix, before anything is written (the graph's
    problems, with ``also``, in one refusal).

    ``from_caller``: the ids come from a caller (a new run), so each is at most
    :data:`~langgraph_fence.validate.MAX_ID_BYTES` long; a run resumed by a take
    (``False``) has the ids it was recorded with (a child's are derived from its parent's).
    """
    limit = MAX_ID_BYTES if from_caller else None
    from langgraph_fence.execution.fail_closed import refuse_unfenced
    from langgraph_fence.saver.checkpoint import FencedCheckpointer

    if not isinstance(getattr(graph, "checkpointer", None), FencedCheckpointer):
        raise ValueError(
            "graph was compiled without a fenced checkpointer: compile it with "
            "builder.compile(checkpointer=instance.checkpointer)"
        )
    refuse_unfenced(graph, also)
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
        max_bytes=limit,
    )
    text_id(
        "tenant_id",
        tenant_id,
        what="the tenant the execution and its thread belong to",
        max_bytes=limit,
    )
    if execution_id is not None:
        text_id("execution_id", execution_id, what="the lease's execution id", max_bytes=limit)
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


async def take(
    host: InstanceHost, key: LeaseKey, thread_id: str, record: ExecutionRecord | None
) -> tuple[RunHandle, ExecutionRecord | None]:
    """Start a new run of ``key``: bind the thread, take the lease (the next token), record
    the run's input; its handle, and the record still to write once it holds the lease
    (``None``: written).

    One thread, one execution: a run under another execution id of the thread's tenant
    would hold a lease of its own and fork the thread, so it is refused before the lease
    and the record are written. The record is written with the take (a process that dies
    after it leaves the record for the instance that takes the execution over), and only
    when the lease is taken: a refused start never rewrites the record of the run in
    flight. On the SQL store with its records (``Instance.open``) all of it is one
    statement on PostgreSQL, one transaction on SQLite (``SqlLeaseRepository.take``).

    A standing non-idempotent stamp dead-letters the execution instead, inside the
    acquire's statement (``transitions.decide_acquire``, the same decision as ``serve()``'s
    take-over); standing idempotent entries are cleared by that statement too.

    Raises:
        ExecutionThreadBoundError: the tenant's thread belongs to another execution id.
        ExecutionBusyError: new input while a submitted run of the execution waits.
        ExecutionLeaseHeldError: another live run holds the lease.
        ExecutionEndedError: the execution is dead-lettered.
        ExecutionDeadLetteredError: this take found a non-idempotent stamp standing.
    """
    repository = host.repository
    sent_at = host.clock()
    store = _take_store(host)
    # Every run may reopen a done or failed execution, whatever its input: new input is a
    # new turn, None or a Command resumes (or replays, or forks) from the checkpoint its
    # config names, as LangGraph does. Either is a new run at the next token; only a
    # dead-lettered execution stays shut (decide_acquire).
    if record is None:
        # A resume (None, a Command) writes no record, so no statement's guard sees the
        # submitted runs waiting on the thread: one read refuses it before the take would
        # take their pending lease (a start with input pays nothing: its take's guard sees).
        await _refuse_beside_waiting_submits(host, key)
    if store is not None:
        assert isinstance(host.records, SqlExecutionRecords)
        columns = None if record is None else host.records.columns(record)
        for _ in range(_TAKE_TRIES):
            taken = await store.take(
                key, host.instance_id, host.lease_ttl, thread_id=thread_id, record=columns
            )
            if taken.bound is not None:
                break
        else:
            raise ExecutionLeaseHeldError(
                f"thread {thread_id!r} of tenant {key.tenant_id!r} was bound by another run "
                f"while this one asked for it, {_TAKE_TRIES} times; try again"
            )
        check_thread_binding(key, thread_id, taken.bound)
        lease = taken.lease
        if lease is None and record is not None:
            await _refuse_beside_waiting_submits(host, key)
        record = None
    else:
        check_thread_binding(key, thread_id, await host.records.bind(key, thread_id))
        # Skipped while the lease is held (written again once this run holds it).
        if record is not None and await host.records.record(record, unless_held=True):
            record = None
        elif record is not None:
            await _refuse_beside_waiting_submits(host, key)
        lease = await repository.acquire(key, host.instance_id, host.lease_ttl, reopen=True)
    if lease is None:
        raise refusal(key, await repository.get(key), host.instance_id)
    host.events.emit(EventKind.ACQUIRED, key.scope_key, lease.epoch)
    if lease.status is LeaseStatus.DEAD_LETTERED:
        # A non-idempotent write stood: acquire dead-lettered the execution in its statement.
        reason = lease.reason or ""
        announce_dead_letter(host.events, key.scope_key, lease.epoch, reason)
        raise ExecutionDeadLetteredError(f"execution {key.scope_key!r} was dead-lettered: {reason}")
    handle = RunHandle(repository, lease, host.lease_ttl, clock=host.clock, confirmed_from=sent_at)
    return handle, record


#: How often a take is sent again when a racing first run bound the thread meanwhile.
_TAKE_TRIES = 3


def _take_store(host: InstanceHost) -> SqlLeaseRepository | None:
    """The SQL lease store when the instance's records are in its very engine (the take is
    then one statement or one transaction); else ``None`` (each part on its own)."""
    repository = host.repository
    records = host.records
    if (
        isinstance(repository, SqlLeaseRepository)
        and isinstance(records, SqlExecutionRecords)
        and records.engine is repository.engine
    ):
        return repository
    return None


async def _settle(host: InstanceHost, graph: Any, run: Run, exc: BaseException | None) -> None:
    """Carry out the outcome of a run that ended with ``exc`` (None: returned); raises the
    error that stands, or returns for ``exc`` to propagate as it is."""
    handle = run.handle
    task = asyncio.current_task()
    outcome = decide_outcome(
        exc,
        fence_error=handle.error,
        dead_letter=handle.dead_letter,
        stopped=task is not None and task.cancelling() > 0,
    )
    if outcome.settle is Settle.FENCED:
        # The fencing error is decided first, before cancellation, drains or anything else.
        if outcome.fence_error is not None:
            handle.record(outcome.fence_error)
        if exc is not None:
            await _classify_loss(host, handle)
        if not isinstance(handle.error, ExecutionFencedError):
            # Lapsed, and nobody took it over: the run has stopped, so its instance hands
            # it back for a serving instance to take at once, not once it expires.
            await _hand_back(host, run, f"its lease lapsed: {handle.error}")
        assert handle.error is not None
        raise handle.error
    if outcome.settle is Settle.DEAD_LETTER:
        # (A graph that ended "normally" because something caught the dead letter, a
        # tool-retry wrapper answering the model or a try/except, is dead all the same.)
        dead = outcome.dead_letter
        assert dead is not None
        assert outcome.reason is not None
        await host.repository.dead_letter(handle.key, outcome.reason, epoch=handle.token)
        announce_dead_letter(host.events, handle.scope_key, handle.token, outcome.reason)
        if outcome.raise_dead_letter:
            raise dead  # keeps its own cause: the error the write failed with
        return
    if outcome.settle is Settle.HAND_BACK:
        # Drained by request, or cancelled (not by a fence): hand the execution back for any
        # instance to resume at once.
        await _release(run, LeaseStatus.PENDING, outcome.reason)
        host.events.emit(EventKind.HANDED_BACK, handle.scope_key, handle.token, outcome.reason)
        await _wake_servers(host)
        return
    if outcome.settle is Settle.LOST_TO_STORE:
        # An infrastructure error, not the graph's: the store could not be reached while
        # the run's hold lasted (each call retried until then). The run stops as
        # lease-lost; its lease expires and serve() takes it over. Never ``failed``.
        assert exc is not None
        handle.record(_lost_to_the_store(handle, exc))
        await _classify_loss(host, handle)
        if not isinstance(handle.error, ExecutionFencedError):
            await _hand_back(host, run, f"the store could not be reached: {outcome.reason}")
        assert handle.error is not None
        raise handle.error from exc
    if outcome.settle is Settle.FAILED:
        await _release(run, LeaseStatus.FAILED, outcome.reason)
        return
    status = run.end.status()
    if status is None:
        # Where the thread stands now: its latest checkpoint, not the one a replay or a
        # fork named in the config (that one has the steps the run just ran still ahead).
        state = await graph.aget_state(_latest(run.base_config))
        status = LeaseStatus.WAITING if state.next else LeaseStatus.DONE
    await _release(run, status, None)
    logger.info(
        "run %s ended %s at token %d",
        handle.scope_key,
        status.value,
        handle.token,
        extra={"scope_key": handle.scope_key, "token": handle.token},
    )


async def _hand_back(host: InstanceHost, run: Run, reason: str) -> None:
    """Release the run's lease as ``pending`` so serve() resumes it at once; a store
    still out of reach leaves it to expire (then it is taken over all the same)."""
    try:
        await _release(run, LeaseStatus.PENDING, bounded_reason(reason))
        host.events.emit(EventKind.HANDED_BACK, run.handle.scope_key, run.handle.token, reason)
        await _wake_servers(host)
    except ExecutionLeaseLostError:
        pass  # recorded on the handle: it was taken over
    except Exception as exc:
        logger.warning(
            "could not hand %s back (%s): it is taken over once its lease expires",
            run.handle.scope_key,
            failure_reason(exc),
        )


async def _wake_servers(host: InstanceHost) -> None:
    """Say that an execution was handed back: on PostgreSQL a serving instance is woken
    (NOTIFY) and takes it at once, not at its next poll; elsewhere polling finds it."""
    queue = host.queue_or_none()
    if queue is not None:
        await queue.notify(NOTIFY_CHANNEL, "")


async def _classify_loss(host: InstanceHost, handle: RunHandle) -> None:
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
        with retry_window(FixedWindow.lasting(host.lease_ttl)):
            await asyncio.wait_for(handle.renew(), timeout=host.lease_ttl)
    except (ExecutionLeaseLostError, TimeoutError):
        pass
    except Exception:
        logger.warning("could not classify the loss of %s", handle.scope_key, exc_info=True)


async def _release(run: Run, status: LeaseStatus, reason: str | None) -> None:
    handle = run.handle
    await fault_point("release.before", handle=handle, status=status)
    try:
        await handle.repository.release(handle.lease, status, reason)
    except ExecutionFencedError as exc:
        raise handle.record(exc) from None


def announce_dead_letter(events: Listeners, scope_key: str, token: int, reason: str | None) -> None:
    """Say (to the listeners and the log) that an execution was dead-lettered."""
    events.emit(EventKind.DEAD_LETTERED, scope_key, token, reason)
    logger.warning(
        "execution %s dead-lettered at token %d: %s",
        scope_key,
        token,
        reason,
        extra={"scope_key": scope_key, "token": token},
    )


async def _refuse_beside_waiting_submits(host: InstanceHost, key: LeaseKey) -> None:
    """Refuse a start while submitted runs wait on the thread (``ExecutionBusyError``,
    :mod:`langgraph_fence.queue`); nothing to refuse where there is no queue (no SQL)."""
    queue = host.queue_or_none()
    if queue is not None:
        await queue.refuse_beside_waiting(key)


def recorded_graph_name(graph: Any, graph_name: str | None) -> str:
    """The name an execution of ``graph`` is recorded under: the one ``serve()`` finds it by.

    Raises:
        ValueError: neither ``graph_name`` nor a ``name=`` of the compiled graph says which
            graph it is (LangGraph's default name would strand the execution: no
            ``serve({"orders": graph})`` finds a record named ``"LangGraph"``).
    """
    problem = graph_name_problem(graph, graph_name)
    if problem is not None:
        raise ValueError(problem)
    return graph_name or str(graph.name)


def graph_name_problem(graph: Any, graph_name: str | None) -> str | None:
    """Why an execution of ``graph`` could not be recorded under a name ``serve()`` finds,
    or ``None``."""
    if graph_name is not None:
        return None
    name = getattr(graph, "name", None)
    if not isinstance(name, str) or not name or name == DEFAULT_GRAPH_NAME:
        return (
            f"the graph has LangGraph's default name {name!r} and no graph_name was given: an "
            "execution is recorded under its graph's name, and another instance takes it over "
            "only if it serves a graph of that name, so this one could never be taken over. "
            'Name it: builder.compile(checkpointer=instance.checkpointer, name="orders") and '
            'serve({"orders": graph}) (the worker\'s --graphs factory returns that mapping), '
            'or pass instance.ainvoke(..., graph_name="orders"). Refused before anything was '
            "written"
        )
    return None


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


def refusal(
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

"""The life of one run: prepare, record, acquire, keep, settle, release.

:func:`running` is the whole life of a run of an :class:`~langgraph_fence.Instance`, as a
context manager around the graph's call: its arguments are checked and its record written
before the lease is taken; its handle goes into the run's config and is kept (renewed and
watched, :mod:`langgraph_fence.keeper`) while the graph runs; its end is decided by
:func:`langgraph_fence.outcome.decide_outcome` and the lease released with that outcome in
one guarded statement.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator, Mapping
from contextlib import asynccontextmanager
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from langchain_core.runnables import RunnableConfig
from langgraph.runtime import RunControl
from langgraph.types import Command

from .children import parse_child_execution_id
from .errors import (
    ExecutionBusyError,
    ExecutionDeadLetteredError,
    ExecutionEndedError,
    ExecutionFencedError,
    ExecutionLeaseHeldError,
    ExecutionLeaseLostError,
)
from .events import EventKind, Listeners
from .faults import fault_point
from .fence import FENCE_CONFIG_KEY, RunHandle
from .lease import (
    Lease,
    LeaseKey,
    LeaseStatus,
)
from .outcome import Settle, decide_outcome
from .records import ExecutionRecord, check_thread_binding
from .redact import bounded_reason, failure_reason
from .retry import FixedWindow, retry_window
from .run_config import record_run, run_allowlist
from .tree_activity import wake_parent
from .validate import text_id

if TYPE_CHECKING:
    from .instance import Instance

__all__ = ["DEFAULT_GRAPH_NAME", "Run", "announce_dead_letter", "running"]

logger = logging.getLogger(__name__)

#: The name ``StateGraph.compile()`` gives a graph compiled without ``name=``.
DEFAULT_GRAPH_NAME = "LangGraph"


@dataclass(slots=True, eq=False)
class Run:
    """One run in flight: its config, handle and control."""

    config: RunnableConfig
    handle: RunHandle
    control: RunControl
    base_config: RunnableConfig


@asynccontextmanager
async def running(
    instance: Instance,
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
    :class:`~langgraph_fence.InstanceFullError`, nothing written), binds the thread, records
    the execution (when it has input) and takes the lease; a run ``serve()`` took over comes
    with its lease and its slot. The block runs the graph with ``run.config`` and
    ``run.control``; leaving it settles the outcome and releases the lease (or raises the
    fencing error that stands), then gives the slot back.
    """
    if taken is None:
        instance._keeper.admit(f"execution {tenant_id!r}/{execution_id or 'its thread'!r}")
    try:
        async with _running(
            instance,
            graph,
            input,
            config,
            tenant_id,
            execution_id,
            kwargs,
            graph_name=graph_name,
            taken=taken,
        ) as run:
            yield run
    finally:
        instance._keeper.leave()


@asynccontextmanager
async def _running(
    instance: Instance,
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
    key, base = prepare(graph, config, tenant_id, execution_id, kwargs)
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
                recorded_graph_name(graph, graph_name),
                thread_id,
                input,
                record_run(
                    base,
                    kwargs,
                    serde=instance._record_serde,
                    allow=run_allowlist(graph),
                ),
            )
        # One thread, one execution: a run under another execution id of the thread's
        # tenant would hold a lease of its own and fork the thread. Checked before the
        # record and the lease, so a refused run leaves nothing behind.
        check_thread_binding(key, thread_id, await instance.records.bind(key, thread_id))
        # Recorded before the lease is taken: a process that dies after its acquire must
        # leave a record for the instance that takes the execution over (one that dies
        # before it leaves no lease, so nothing to take over). Skipped while the lease is
        # held: a start that is refused must not rewrite the record of the run in flight.
        if record is not None and await instance.records.record(record, unless_held=True):
            record = None
        elif record is not None:
            await _refuse_a_waiting_submit(instance, key)
        handle = await acquire(instance, key)
    else:
        record = None
        handle = RunHandle(instance.repository, taken, instance.lease_ttl, clock=instance.clock)
    handle.instance = instance
    control = RunControl()
    run_config: dict[str, Any] = dict(base)
    run_config["configurable"] = {
        **base["configurable"],
        FENCE_CONFIG_KEY: handle,
        "tenant_id": key.tenant_id,
        "execution_id": key.execution_id,
    }
    run = Run(run_config, handle, control, base)  # type: ignore[arg-type]
    events = instance._events

    def drain(error: BaseException) -> None:
        control.request_drain(f"langgraph-fence: {error}")
        fenced = isinstance(error, ExecutionFencedError)
        kind = EventKind.FENCED if fenced else EventKind.LOST
        events.emit(kind, key.scope_key, handle.token, str(error))

    handle.on_stop(drain)
    instance._keeper.keep(handle)
    instance._runs.add(run)
    logger.info(
        "run %s started at token %d on %s",
        key.scope_key,
        handle.token,
        instance.instance_id,
        extra={"scope_key": key.scope_key, "token": handle.token},
    )
    try:
        try:
            if record is not None:
                # The lease was held (expired) when the record was skipped; it is ours now.
                await instance.records.record(record)
            yield run
        finally:
            await instance._keeper.release(handle)
    except BaseException as exc:
        await _settle(instance, graph, run, exc)
        raise  # _settle raises what stands; this is for the type checker
    else:
        await _settle(instance, graph, run, None)
    finally:
        parent = parse_child_execution_id(key.execution_id)
        if parent is not None:
            # A child ended: its parent, yielded while it waits, may now be runnable.
            await wake_parent(handle, parent[0])
        instance._runs.discard(run)


def prepare(
    graph: Any,
    config: RunnableConfig | None,
    tenant_id: str,
    execution_id: str | None,
    kwargs: Mapping[str, Any],
) -> tuple[LeaseKey, RunnableConfig]:
    """The run's lease key and its config (with its tenant), every argument checked;
    ``ValueError`` naming the argument and the fix, before anything is written."""
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


async def acquire(instance: Instance, key: LeaseKey) -> RunHandle:
    """Take ``key``'s lease for a new run (the next token); its handle.

    A standing non-idempotent stamp dead-letters the execution instead, inside acquire's
    one statement (``lease.decide_acquire``, the same decision as ``serve()``'s take-over);
    standing idempotent entries are cleared by that statement too.

    Raises:
        ExecutionLeaseHeldError: another live run holds the lease.
        ExecutionEndedError: the execution is dead-lettered.
        ExecutionDeadLetteredError: this acquire found a non-idempotent stamp standing.
    """
    repository = instance.repository
    sent_at = instance.clock()
    # Every run may reopen a done or failed execution, whatever its input: new input is a
    # new turn, None or a Command resumes (or replays, or forks) from the checkpoint its
    # config names, as LangGraph does. Either is a new run at the next token; only a
    # dead-lettered execution stays shut (decide_acquire).
    lease = await repository.acquire(key, instance.instance_id, instance.lease_ttl, reopen=True)
    if lease is None:
        raise refusal(key, await repository.get(key), instance.instance_id)
    instance._events.emit(EventKind.ACQUIRED, key.scope_key, lease.epoch)
    if lease.status is LeaseStatus.DEAD_LETTERED:
        # A non-idempotent write stood: acquire dead-lettered the execution in its statement.
        reason = lease.reason or ""
        announce_dead_letter(instance._events, key.scope_key, lease.epoch, reason)
        raise ExecutionDeadLetteredError(f"execution {key.scope_key!r} was dead-lettered: {reason}")
    return RunHandle(
        repository, lease, instance.lease_ttl, clock=instance.clock, confirmed_from=sent_at
    )


async def _settle(instance: Instance, graph: Any, run: Run, exc: BaseException | None) -> None:
    """Carry out the outcome of a run that ended with ``exc`` (None: returned); raises the
    error that stands, or returns for ``exc`` to propagate as it is."""
    handle = run.handle
    outcome = decide_outcome(exc, fence_error=handle.error, dead_letter=handle.dead_letter)
    if outcome.settle is Settle.FENCED:
        # The fencing error is decided first, before cancellation, drains or anything else.
        if outcome.fence_error is not None:
            handle.record(outcome.fence_error)
        if exc is not None:
            await _classify_loss(instance, handle)
        assert handle.error is not None
        raise handle.error
    if outcome.settle is Settle.DEAD_LETTER:
        # (A graph that ended "normally" because something caught the dead letter, a
        # tool-retry wrapper answering the model or a try/except, is dead all the same.)
        dead = outcome.dead_letter
        assert dead is not None
        assert outcome.reason is not None
        await instance.repository.dead_letter(handle.key, outcome.reason, epoch=handle.token)
        announce_dead_letter(instance._events, handle.scope_key, handle.token, outcome.reason)
        if outcome.raise_dead_letter:
            raise dead  # keeps its own cause: the error the write failed with
        return
    if outcome.settle is Settle.HAND_BACK:
        # Drained by request (not by a fence): hand the execution back for any instance.
        await _release(run, LeaseStatus.PENDING, outcome.reason)
        instance._events.emit(EventKind.HANDED_BACK, handle.scope_key, handle.token, outcome.reason)
        return
    if outcome.settle is Settle.LOST_TO_STORE:
        # An infrastructure error, not the graph's: the store could not be reached while
        # the run's hold lasted (each call retried until then). The run stops as
        # lease-lost; its lease expires and serve() takes it over. Never ``failed``.
        assert exc is not None
        handle.record(_lost_to_the_store(handle, exc))
        await _classify_loss(instance, handle)
        if not isinstance(handle.error, ExecutionFencedError):
            await _hand_back(instance, run, f"the store could not be reached: {outcome.reason}")
        assert handle.error is not None
        raise handle.error from exc
    if outcome.settle is Settle.FAILED:
        await _release(run, LeaseStatus.FAILED, outcome.reason)
        return
    # Where the thread stands now: its latest checkpoint, not the one a replay or a fork
    # named in the config (that one has the steps the run just ran still ahead of it).
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


async def _hand_back(instance: Instance, run: Run, reason: str) -> None:
    """Release the run's lease as ``pending`` so serve() resumes it at once; a store
    still out of reach leaves it to expire (then it is taken over all the same)."""
    try:
        await _release(run, LeaseStatus.PENDING, bounded_reason(reason))
        instance._events.emit(EventKind.HANDED_BACK, run.handle.scope_key, run.handle.token, reason)
    except ExecutionLeaseLostError:
        pass  # recorded on the handle: it was taken over
    except Exception as exc:
        logger.warning(
            "could not hand %s back (%s): it is taken over once its lease expires",
            run.handle.scope_key,
            failure_reason(exc),
        )


async def _classify_loss(instance: Instance, handle: RunHandle) -> None:
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
        with retry_window(FixedWindow.lasting(instance.lease_ttl)):
            await asyncio.wait_for(handle.renew(), timeout=instance.lease_ttl)
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


async def _refuse_a_waiting_submit(instance: Instance, key: LeaseKey) -> None:
    """Refuse new input while the thread's submitted run waits for a worker.

    A submitted run that is pending (not claimed yet, or handed back) is the thread's run in
    flight, though no one holds its lease: a start with new input would take that lease and
    its input would never run (its ``result()`` would read another run's end). Refused as a
    submit with ``on_busy="reject"`` is, with nothing written. Read only when the record was
    not written (held, dead-lettered, or such a run): off the path of an ordinary start.
    """
    queue = instance.queue_or_none()
    found = None if queue is None else await queue.state(key)
    if found is None:
        return
    state = found[0]
    if state.submitted and state.status is LeaseStatus.PENDING:
        raise ExecutionBusyError(
            f"execution {key.scope_key!r} has a submitted run waiting for a worker: new "
            "input refused, nothing written. Wait for it (await instance.get_run(...)"
            ".result()), or submit the new input with on_busy='interrupt'",
            scope_key=key.scope_key,
            status=state.status.value,
        )


def recorded_graph_name(graph: Any, graph_name: str | None) -> str:
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

"""A run's start: its arguments checked, its thread bound, its input recorded and its lease
taken (the next token), before anything of the graph runs.

Every argument is checked before anything is written (:func:`prepare`); a new run's take is
one statement, or one transaction, where the records share the lease table's database
(:func:`take`); a take refused says why (:func:`refusal`).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any

from langchain_core.runnables import RunnableConfig
from langgraph.types import Command

from langgraph_fence._compat import server_saver_inner
from langgraph_fence.database.retry import backoff
from langgraph_fence.errors import (
    ExecutionDeadLetteredError,
    ExecutionEndedError,
    ExecutionLeaseHeldError,
)
from langgraph_fence.events import EventKind, Listeners
from langgraph_fence.fence import RunHandle
from langgraph_fence.keys import FENCE_CONFIG_KEY
from langgraph_fence.lease import Lease, LeaseKey, LeaseStatus
from langgraph_fence.lease.attempts import (
    Attempt,
    attempt_store,
    server_attempt,
    superseded_error,
)
from langgraph_fence.lease.records import ExecutionRecord, SqlExecutionRecords, check_thread_binding
from langgraph_fence.lease.run_config import record_run, run_allowlist
from langgraph_fence.lease.sql import SqlLeaseRepository
from langgraph_fence.validate import MAX_ID_BYTES, text_id

if TYPE_CHECKING:
    from langgraph_fence.execution.host import InstanceHost

# Its records are the run's: one logger for an operator to set.
logger = logging.getLogger("langgraph_fence.run")

#: The name ``StateGraph.compile()`` gives a graph compiled without ``name=``.
DEFAULT_GRAPH_NAME = "LangGraph"


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

    saver = server_saver_inner(getattr(graph, "checkpointer", None))
    if not isinstance(saver, FencedCheckpointer):
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


async def start(
    host: InstanceHost,
    graph: Any,
    input: Any,
    key: LeaseKey,
    base: RunnableConfig,
    kwargs: Mapping[str, Any],
    graph_name: str | None,
) -> tuple[RunHandle, ExecutionRecord | None]:
    """Start a new run of ``key`` (its arguments checked by :func:`prepare`): its input
    recorded with the take when it has input, its lease taken and confirmed held. Its
    handle, and the record still to write once it holds the lease (``None``: written).
    """
    thread_id = str(base["configurable"]["thread_id"])
    attempt = server_attempt(base)  # an Agent Server run: which attempt of which run
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
    host.events.describe(key.scope_key, thread_id, graph_name or getattr(graph, "name", None))
    handle, record = await take(host, key, thread_id, record, attempt=attempt)
    await host.keeper.confirm_start(handle)
    return handle, record


async def take(
    host: InstanceHost,
    key: LeaseKey,
    thread_id: str,
    record: ExecutionRecord | None,
    *,
    attempt: Attempt | None = None,
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

    ``attempt``: the run is an Agent Server attempt (:mod:`langgraph_fence.lease.attempts`):
    recorded as its run's newest before the take, taking the lease over from an earlier
    attempt of the run that holds it; an attempt older than its run's newest is refused.

    Raises:
        ExecutionSupersededError: a newer attempt of the server run started.
        ExecutionThreadBoundError: the tenant's thread belongs to another execution id.
        ExecutionBusyError: new input while a submitted run of the execution waits.
        ExecutionLeaseHeldError: another live run holds the lease.
        ExecutionEndedError: the execution is dead-lettered.
        ExecutionDeadLetteredError: this take found a non-idempotent stamp standing.
    """
    if attempt is not None:
        return await _take_as_attempt(host, key, thread_id, record, attempt)
    return await _take_once(host, key, thread_id, record)


async def _take_once(
    host: InstanceHost, key: LeaseKey, thread_id: str, record: ExecutionRecord | None
) -> tuple[RunHandle, ExecutionRecord | None]:
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


async def _take_as_attempt(
    host: InstanceHost,
    key: LeaseKey,
    thread_id: str,
    record: ExecutionRecord | None,
    attempt: Attempt,
) -> tuple[RunHandle, ExecutionRecord | None]:
    """The take of Agent Server ``attempt``: recorded as its run's newest, in one transaction
    with the take-over of the lease from an earlier attempt of the run holding it; else a
    take as any run's, whose epoch is then recorded for the run.

    A take waits (asks again with backoff, up to one lease TTL) while another holder holds
    the lease: the run before (the server starts the next run of a thread once the one
    before ended or was cancelled, which lets its lease go), or an older attempt of the run
    whose take landed after this one recorded itself (frozen right before its take): that
    one finds this attempt when it records its epoch, and gives the lease back at once.
    """
    store = attempt_store(host.repository)
    if store is None:
        raise ValueError(
            f"the lease store {type(host.repository).__name__} cannot tell Agent Server "
            "attempts apart (it is no AttemptStore): open the instance on SQL "
            "(Instance.open(url)), as langgraph_fence.server does"
        )
    deadline = time.monotonic() + host.lease_ttl
    tries = 0
    while True:
        sent_at = host.clock()
        taken = await store.supersede(key, attempt, host.instance_id, host.lease_ttl)
        if taken is not None:
            logger.warning(
                "execution %s: Agent Server %s took the thread over from an earlier attempt "
                "of its run (fenced at token %d)",
                key.scope_key,
                attempt,
                taken.epoch - 1,
            )
            return _handle_of(host, key, taken, sent_at), None
        try:
            handle, rest = await _take_once(host, key, thread_id, record)
        except ExecutionLeaseHeldError:
            if time.monotonic() >= deadline:
                raise
            await asyncio.sleep(backoff(tries))
            tries += 1
            continue
        if not await store.record_epoch(key, attempt, handle.lease.epoch):
            # A newer attempt of the run started between this one's record and its take:
            # give the thread back as found (nothing of this attempt ran), and stop.
            await handle.repository.release(handle.lease, LeaseStatus.DONE, None)
            newest = await store.newest_attempt(key, attempt.run_id)
            raise superseded_error(key, attempt, int(newest or attempt.number + 1))
        return handle, rest


def _handle_of(host: InstanceHost, key: LeaseKey, lease: Lease, sent_at: float) -> RunHandle:
    """The run's handle on ``lease``, taken by a server attempt's take-over; refused with
    the dead letter when the take-over found a non-idempotent stamp standing."""
    host.events.emit(EventKind.ACQUIRED, key.scope_key, lease.epoch)
    if lease.status is LeaseStatus.DEAD_LETTERED:
        reason = lease.reason or ""
        announce_dead_letter(host.events, key.scope_key, lease.epoch, reason)
        raise ExecutionDeadLetteredError(f"execution {key.scope_key!r} was dead-lettered: {reason}")
    return RunHandle(
        host.repository, lease, host.lease_ttl, clock=host.clock, confirmed_from=sent_at
    )


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


async def _refuse_beside_waiting_submits(host: InstanceHost, key: LeaseKey) -> None:
    """Refuse a start while submitted runs wait on the thread (``ExecutionBusyError``,
    :mod:`langgraph_fence.queue`); nothing to refuse where there is no queue (no SQL)."""
    queue = host.queue_or_none()
    if queue is not None:
        await queue.refuse_beside_waiting(key)


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

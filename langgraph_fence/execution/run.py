"""The life of one run: prepare, record, acquire, keep, settle, release.

:func:`running` is the whole life of a run of an :class:`~langgraph_fence.Instance`, as a
context manager around the graph's call: its arguments are checked and its record written
before the lease is taken (:mod:`langgraph_fence.execution._start`); its handle goes into the
run's config and is kept (renewed and watched, :mod:`langgraph_fence.execution.keeper`) while
the graph runs; its end is decided by :func:`langgraph_fence.execution.outcome.decide_outcome`
and the lease released with that outcome in one guarded statement.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator, Callable, Mapping
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
    ExecutionFencedError,
    ExecutionLeaseLostError,
    ServerAttemptSuperseded,
)
from langgraph_fence.events import EventKind
from langgraph_fence.execution._start import (
    DEFAULT_GRAPH_NAME,
    announce_dead_letter,
    graph_name_problem,
    prepare,
    start,
)
from langgraph_fence.execution.children import (
    parse_child_execution_id,
    queue_of,
    refuse_child_ids,
)
from langgraph_fence.execution.outcome import Settle, decide_outcome
from langgraph_fence.execution.retries import RunRetry, stamp_stands
from langgraph_fence.execution.sleeps import release_sleeping
from langgraph_fence.fence import RunHandle
from langgraph_fence.fence.tree_activity import wake_parent
from langgraph_fence.keys import FENCE_CONFIG_KEY
from langgraph_fence.lease import Lease, LeaseKey, LeaseStatus
from langgraph_fence.lease.attempts import attempt_store, server_attempt
from langgraph_fence.lease.faults import fault_point
from langgraph_fence.queue.notifications import NOTIFY_CHANNEL
from langgraph_fence.redact import bounded_reason, failure_reason
from langgraph_fence.validate import text_id

if TYPE_CHECKING:
    from langgraph_fence.execution.host import InstanceHost

__all__ = ["DEFAULT_GRAPH_NAME", "GraphEnd", "Run", "announce_dead_letter", "running"]

logger = logging.getLogger("langgraph_fence.run")


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
    #: How a failure of the graph's own is retried (serve(run_retries=...)), or None.
    retry: RunRetry | None = None


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
    retry: RunRetry | None = None,
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
    async with _admitted(host, what, new=taken is None) as started:
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
            # A start of your own: a child's ids are refused (a takeover or a claim, taken,
            # runs the child as spawned).
            refuse_child_ids(str(base["configurable"]["thread_id"]), execution_id)
            handle, record = await start(host, graph, input, key, base, kwargs, graph_name)
        else:
            record = None
            handle = RunHandle(host.repository, taken, host.lease_ttl, clock=host.clock)
        run = _kept(host, key, base, handle)
        run.retry = retry
        try:
            try:
                if record is not None:
                    # The lease was held (expired) when the record was skipped; it is ours now.
                    await host.records.record(record)
                started()
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


@asynccontextmanager
async def _admitted(
    host: InstanceHost, what: str, *, new: bool
) -> AsyncIterator[Callable[[], None]]:
    """The run's slot among the instance's runs for the block, given back when it ends.

    A new run takes one here (else :class:`~langgraph_fence.InstanceFullError`, nothing
    written) and then waits while the renewals of the runs held run late, and for its turn
    to start; the block calls what this yields once the run has started, ending its turn.
    A run ``serve()`` took over came with its slot.
    """
    if new:
        host.keeper.admit(what)
    # A new run's start (its binding, record, lease) waits its turn: a burst of starts
    # queues here, not on the connection pool (``keeper.MAX_STARTING``).
    starting = host.keeper.starting if new else None
    my_turn = False

    def started() -> None:
        nonlocal my_turn
        if starting is not None and my_turn:
            my_turn = False
            starting.release()

    try:
        if starting is not None:
            # The leases held come first: while their renewals run late, wait (each start
            # at most one TTL, however many wait, not one after another in turn).
            await host.keeper.in_time(what)
            await starting.acquire()
            my_turn = True
        yield started
    finally:
        started()
        host.keeper.leave()


def _kept(host: InstanceHost, key: LeaseKey, base: RunnableConfig, handle: RunHandle) -> Run:
    """The run of ``handle`` in flight: its config carries the handle, a fencing error
    recorded on the handle drains it, and its lease is kept from now on."""
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
    return run


async def _end_if_superseded(host: InstanceHost, run: Run, error: BaseException) -> None:
    """End an Agent Server attempt fenced by a newer attempt of its run as
    :class:`ServerAttemptSuperseded` (the newer attempt writes the run's status); any
    other fenced run keeps its fencing error (the server then marks the run failed)."""
    if not isinstance(error, ExecutionFencedError):
        return
    attempt = server_attempt(run.base_config)
    store = attempt_store(host.repository)
    if attempt is None or store is None:
        return
    try:
        number = await store.newest_attempt(run.handle.lease.key, attempt.run_id)
    except Exception:
        logger.warning("could not read the newest attempt of %s", attempt, exc_info=True)
        return
    if number is not None and number > attempt.number:
        raise ServerAttemptSuperseded(
            f"{error} (superseded by attempt {number} of run {attempt.run_id})"
        ) from error


async def _settle(host: InstanceHost, graph: Any, run: Run, exc: BaseException | None) -> None:
    """Carry out the outcome of a run that ended with ``exc`` (None: returned); raises the
    error that stands, or returns for ``exc`` to propagate as it is. An Agent Server attempt
    fenced by a newer attempt of its run (found fenced at any point of its end, its release
    included: the server may stop it once the newer attempt ended) ends as
    :class:`ServerAttemptSuperseded`."""
    try:
        await _carry_out(host, graph, run, exc)
    except ExecutionFencedError as fenced:
        await _end_if_superseded(host, run, fenced)
        raise


async def _carry_out(host: InstanceHost, graph: Any, run: Run, exc: BaseException | None) -> None:
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
    if outcome.settle is Settle.SLEEP:
        # A step sleeps: the lease goes back pending until it wakes, the slot is free, and
        # the sleep propagates to the caller (serve() logs it; ainvoke raises it).
        assert outcome.sleeping is not None
        await fault_point("release.before", handle=handle, status=LeaseStatus.PENDING)
        try:
            await release_sleeping(handle, queue_of(handle), outcome.sleeping)
        except ExecutionFencedError as fenced:
            raise handle.record(fenced) from None
        host.events.emit(
            EventKind.HANDED_BACK, handle.scope_key, handle.token, str(outcome.sleeping)
        )
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
        assert exc is not None
        if await _retried(host, run, exc, outcome.reason):
            return
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


async def _retried(host: InstanceHost, run: Run, exc: BaseException, reason: str | None) -> bool:
    """Hand a submitted run that failed with its graph's own error back for another
    attempt, when its policy retries the error, attempts remain, and no non-idempotent
    stamp stands; whether it was."""
    handle, retry = run.handle, run.retry
    if retry is None or not retry.retries(exc):
        return False
    # The store's stamp set, not the handle's: a stamp whose write landed while its step was
    # cancelled (a sibling step failed) stands there, unknown to the handle.
    stored = await host.repository.get(handle.key)
    if stored is None or stored.epoch != handle.token or stamp_stands(stored.pending_effects):
        return False
    queue = host.queue_or_none()
    attempts = None if queue is None else await queue.attempts(handle.key)
    if queue is None or attempts is None or attempts >= retry.attempts:
        return False
    delay = retry.delay(attempts)
    said = f"attempt {attempts} of {retry.attempts} failed ({reason}): retried in {delay:g}s"
    try:
        if not await queue.release_for_retry(handle.lease, delay, said):
            await handle.renew()  # raises the fencing error the refusal means
            return False
    except ExecutionFencedError as fenced:
        raise handle.record(fenced) from None
    host.events.emit(EventKind.HANDED_BACK, handle.scope_key, handle.token, said)
    logger.info("run %s: %s", handle.scope_key, said)
    return True


async def _release(run: Run, status: LeaseStatus, reason: str | None) -> None:
    handle = run.handle
    await fault_point("release.before", handle=handle, status=status)
    try:
        await handle.repository.release(handle.lease, status, reason)
    except ExecutionFencedError as exc:
        raise handle.record(exc) from None


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

"""Child executions: a step spawns children and waits for their outputs.

``child = await get_execution_context().spawn_child(graph_name, input, placement=..., key=...)``,
``children = await ctx.spawn_children(graph_name, {key: input, ...}, placement=...)`` (a batch,
recorded in one statement however large), and ``results = await ctx.wait_children(children)``.

``ChildPlacement.ANY_INSTANCE``: the child is an execution of its own, of the parent's tenant,
whose execution id is derived from the parent's scope key and ``key``
(:func:`child_execution_id`: collision-free, never the id of a run of your own, and
:func:`parse_child_execution_id` decodes it); the lease row records its parent, so a cancel
or a wake of the parent reaches exactly its own children.
It is recorded by the parent step in one transaction guarded by the parent's hold, as a
submitted run (:mod:`langgraph_fence.queue`): a re-run of the parent step finds the child of
the same key and spawns nothing new; a parent that was taken over spawns nothing (the guard
refuses, and the step stops with :class:`~langgraph_fence.ExecutionFencedError`). Any
instance whose ``serve()`` serves ``graph_name`` claims it and runs it under its own lease,
epoch and scope key; its output, or its failure or dead letter with the reason, is stored
with the execution. :meth:`wait_children` looks at them, every pending child in one read
per look (woken by their ends on PostgreSQL), and returns their outputs in the order given,
or raises :class:`~langgraph_fence.ChildFailedError` within one look of a child's end.

While a step waits for ``ANY_INSTANCE`` children and nothing else of the tree runs, the root
lease is yielded, and taken again (epoch + 1) before anything of the tree runs or the wait
ends (:mod:`langgraph_fence.fence.tree_activity`). If another instance took the tree meanwhile
(after a wake, or a waiter that stalled past its lease while it held it), the new holder
re-runs the waiting step, which finds the children it spawned and their results, and the
stalled waiter stops with :class:`~langgraph_fence.ExecutionFencedError` at its next look.

``ChildPlacement.PARENT_INSTANCE``: the child graph starts at once in this process, as a
subgraph of the spawning step (LangGraph gives each subgraph call of a step a checkpoint
namespace of its own), under the root's lease: its steps' fences are the root's, with the
root's token, and its checkpoints are written under it. The graph is ``graph=`` or the one
this instance serves under ``graph_name``. ``wait_children`` awaits it; its own error is
raised as it is (a fencing error always, whatever ``return_exceptions`` says). A re-run of
the spawning step runs it again (it is part of the step).
"""

from __future__ import annotations

import asyncio
import contextlib
import weakref
from collections.abc import Collection, Mapping, Sequence
from contextlib import nullcontext
from dataclasses import dataclass, field
from enum import StrEnum
from typing import TYPE_CHECKING, Any

from langgraph.errors import GraphBubbleUp

from langgraph_fence.errors import (
    ChildFailedError,
    ExecutionFencedError,
    ExecutionLeaseLostError,
    find_fence_error,
)
from langgraph_fence.lease import LeaseKey, LeaseStatus
from langgraph_fence.lease.scope import (
    CHILD_ID_PREFIX,
    parse_scope_key,
    refuse_child_ids,
    scope_key,
)
from langgraph_fence.validate import positive_seconds, text_id

if TYPE_CHECKING:
    from langgraph_fence.fence import ExecutionFence, RunHandle
    from langgraph_fence.queue import RunState, SubmittedRuns

__all__ = [
    "CHILD_ID_PREFIX",
    "Child",
    "ChildPlacement",
    "child_execution_id",
    "parse_child_execution_id",
    "queue_of",
    "refuse_child_ids",
    "spawn_child",
    "spawn_children",
    "wait_children",
]


_OUTPUT_ENDS = (LeaseStatus.DONE, LeaseStatus.WAITING)
_FAILED_ENDS = (LeaseStatus.FAILED, LeaseStatus.DEAD_LETTERED, LeaseStatus.CANCELLED)


class ChildPlacement(StrEnum):
    """Where a child execution runs.

    ``PARENT_INSTANCE``: in this process, as a subgraph of the step, under the root's lease
    and token.
    ``ANY_INSTANCE``: an execution of its own, claimed by any instance's ``serve()``.
    """

    PARENT_INSTANCE = "parent_instance"
    ANY_INSTANCE = "any_instance"


@dataclass(frozen=True, slots=True)
class Child:
    """A child execution a step spawned (what :meth:`ExecutionContext.spawn_child` returns).

    Attributes:
        execution: the child execution's lease key (the parent's tenant, a derived id); for
            a ``PARENT_INSTANCE`` child, the root's (it runs under the root's lease).
        key: the key it was spawned under (unique among the parent's children).
        graph_name: the graph a worker runs it with.
        placement: where it runs.
        spawned: whether this call recorded it (``False``: an earlier run of the parent
            step did, and this one found it).
    """

    execution: LeaseKey
    key: str
    graph_name: str
    placement: ChildPlacement
    spawned: bool
    # A PARENT_INSTANCE child: its run in this process.
    _local: asyncio.Task[Any] | None = field(default=None, compare=False, repr=False)

    @property
    def scope_key(self) -> str:
        """The child execution's scope key (its fences' and sinks' key)."""
        return self.execution.scope_key


def child_execution_id(parent: LeaseKey, key: str) -> str:
    """The execution id of ``parent``'s child of ``key``:
    ``"lgf-child:" + scope_key(tenant, parent id, key)``.

    Collision-free among children (each part is encoded, so no ``:`` of a part is a
    separator), never equal to the id of a run of your own (:func:`refuse_child_ids`), and
    decoded by :func:`parse_child_execution_id`; a grandchild's id nests its parent's.
    Every child id is made here.

    Raises:
        ValueError: ``key`` is empty or not a ``str``.
    """
    return CHILD_ID_PREFIX + scope_key(parent.tenant_id, parent.execution_id, key)


def parse_child_execution_id(execution_id: str) -> tuple[LeaseKey, str] | None:
    """``(parent key, child key)`` of a child execution id, or ``None`` for an id that is
    not one (an execution started by ``ainvoke`` or ``submit``)."""
    if not isinstance(execution_id, str) or not execution_id.startswith(CHILD_ID_PREFIX):
        return None
    try:
        parts = parse_scope_key(execution_id[len(CHILD_ID_PREFIX) :])
    except ValueError:
        return None
    if len(parts) != 3:
        return None
    tenant, parent, key = parts
    return LeaseKey(tenant, parent), key


@dataclass(frozen=True, slots=True)
class Step:
    """The step that spawns children or waits for them: its run's handle and its fence
    (:class:`~langgraph_fence.ExecutionContext` passes its own)."""

    handle: RunHandle
    fence: ExecutionFence


async def spawn_child(
    step: Step, placement: ChildPlacement, graph_name: str, key: str, input: Any, graph: Any
) -> Child:
    """Spawn the child ``key`` of ``step`` (see :meth:`ExecutionContext.spawn_child`).

    ``ANY_INSTANCE`` children spawned by calls of one run made in the same turn of its
    event loop (``asyncio.gather`` of ``spawn_child`` calls) are recorded together, one
    statement per graph name, as :func:`spawn_children` records a batch."""
    text_id("key", key, what="the child's key, unique among this execution's children")
    if placement is not ChildPlacement.ANY_INSTANCE or graph is not None:
        (child,) = await spawn_children(step, placement, graph_name, {key: input}, graph)
        return child
    text_id("graph_name", graph_name, what="the name a worker serves the child's graph under")
    handle = step.handle
    await _still_held(step)
    (stored,) = queue_of(handle).serialize_inputs({key: input})  # refused here, alone
    loop = asyncio.get_running_loop()
    gathered = _gathering.get(handle)
    if gathered is None:
        gathered = _gathering[handle] = []
        # Runs after the calls of this turn of the loop have joined.
        task = loop.create_task(_spawn_gathered(handle, gathered))
        _recording.add(task)
        task.add_done_callback(_recording.discard)
    spawned: asyncio.Future[Child] = loop.create_future()
    gathered.append((step, graph_name, key, stored, spawned))
    return await spawned


# The spawn_child calls of a run waiting to be recorded together (see spawn_child).
_Call = tuple["Step", str, str, tuple[str, bytes], "asyncio.Future[Child]"]
_gathering: weakref.WeakKeyDictionary[RunHandle, list[_Call]] = weakref.WeakKeyDictionary()
_recording: set[asyncio.Task[None]] = set()  # referenced until done


async def _spawn_gathered(handle: RunHandle, gathered: list[_Call]) -> None:
    """Record the gathered calls, one batch per graph name, and answer each call."""
    if _gathering.get(handle) is gathered:
        del _gathering[handle]
    for graph_name in dict.fromkeys(call[1] for call in gathered):
        calls = [call for call in gathered if call[1] == graph_name]
        first: dict[str, _Call] = {}  # a key spawned twice at once: recorded once
        for call in calls:
            first.setdefault(call[2], call)
        try:
            children = await _record_remote(
                calls[0][0],
                graph_name,
                list(first),
                [call[3] for call in first.values()],
            )
        except BaseException as exc:
            for *_, spawned in calls:
                if not spawned.done():
                    spawned.set_exception(exc)
            if not isinstance(exc, Exception):
                raise
            continue
        found = dict(zip(first, children, strict=True))
        for call in calls:
            child = found[call[2]]
            if call is not first[call[2]]:
                child = Child(child.execution, child.key, graph_name, child.placement, False)
            if not call[4].done():
                call[4].set_result(child)


async def spawn_children(
    step: Step, placement: ChildPlacement, graph_name: str, inputs: Mapping[str, Any], graph: Any
) -> list[Child]:
    """Spawn children of ``step``, one per key of ``inputs`` (see
    :meth:`ExecutionContext.spawn_children`)."""
    text_id("graph_name", graph_name, what="the name a worker serves the child's graph under")
    if not isinstance(inputs, Mapping):
        raise TypeError(
            f"inputs must be a dict of child key -> the child graph's input, got {inputs!r}"
        )
    for key in inputs:
        text_id("key", key, what="the child's key, unique among this execution's children")
    if not isinstance(placement, ChildPlacement):
        raise TypeError(
            f"placement must be a ChildPlacement (ChildPlacement.ANY_INSTANCE or "
            f"ChildPlacement.PARENT_INSTANCE), got {placement!r}"
        )
    if placement is ChildPlacement.PARENT_INSTANCE:
        return [
            await _spawn_here(step, graph_name, input, key, graph) for key, input in inputs.items()
        ]
    if graph is not None:
        raise ValueError(
            "graph= is for ChildPlacement.PARENT_INSTANCE: an ANY_INSTANCE child runs on "
            "the worker that serves graph_name; leave graph out"
        )
    await _still_held(step)
    stored = queue_of(step.handle).serialize_inputs(inputs)  # all checked before writing
    return await _record_remote(step, graph_name, list(inputs), stored)


async def _record_remote(
    step: Step, graph_name: str, keys: list[str], stored: list[tuple[str, bytes]]
) -> list[Child]:
    """Record ANY_INSTANCE children of ``keys`` (their inputs serialized) in one batch,
    under the parent's hold; a parent no longer held spawns none of them."""
    handle = step.handle
    parent = handle.key
    executions = [LeaseKey(parent.tenant_id, child_execution_id(parent, key)) for key in keys]
    written = await queue_of(handle).submit_children(
        handle.lease, graph_name, list(zip(executions, stored, strict=True))
    )
    if written is None:
        # The parent's hold is gone: the strict renewal says how (taken over: fenced).
        await handle.renew()
        spawned = ", ".join(map(repr, keys))
        raise handle.record(
            ExecutionLeaseLostError(
                f"execution {handle.scope_key!r} at token {handle.token} no longer holds its "
                f"lease: children {spawned} were not spawned",
                scope_key=handle.scope_key,
                token_held=handle.token,
            )
        )
    return [
        Child(execution, key, graph_name, ChildPlacement.ANY_INSTANCE, new)
        for execution, key, new in zip(executions, keys, written, strict=True)
    ]


async def wait_children(
    step: Step,
    children: Sequence[Child],
    timeout: float | None,  # noqa: ASYNC109 - gather-like API: timeout=
    return_exceptions: bool,
    poll_interval: float,
    allow: Collection[tuple[str, ...]],
) -> list[Any]:
    """Wait for ``children`` (see :meth:`ExecutionContext.wait_children`, whose arguments
    these are)."""
    if isinstance(children, Child) or not isinstance(children, Sequence):
        raise TypeError(
            f"children must be a list of the Child values spawn_child returned, got {children!r}"
        )
    for child in children:
        if not isinstance(child, Child):
            raise TypeError(f"children must hold Child values (from spawn_child), got {child!r}")
    if timeout is not None:
        timeout = positive_seconds("timeout", timeout, what="how long wait_children() waits")
    pause = positive_seconds("poll_interval", poll_interval, what="between looks at children")
    from langgraph_fence.queue.notifications import ENDS_CHANNEL

    handle = step.handle
    remote = [child for child in children if child._local is None]
    queue = queue_of(handle) if remote else None
    loop = asyncio.get_running_loop()
    deadline = None if timeout is None else loop.time() + timeout
    results: list[Any] = [None] * len(children)
    pending = dict(enumerate(children))
    wait = min(0.005, pause)
    ended = asyncio.Event()
    heard: set[str] = set()  # the scope keys of the ends notified since the last look
    notifications = None if queue is None else queue.notifications
    # On PostgreSQL a child's end (and a cancel of the parent) wakes the wait: subscribed
    # before the first look, so an end after it is not missed.
    woken_by = frozenset([handle.scope_key, *(child.scope_key for child in remote)])
    # Every pending child is read at the first look, then (when woken by ends) the ones
    # heard of, and all of them again every max(poll_interval, 1 s) in case a notification
    # was lost (an end no run of serve() made: a dead letter by a takeover or an operator).
    full_every = max(pause, 1.0)
    full_at = -float("inf")
    # A wait for remote children may yield the root lease (tree_activity.py): only while
    # every running part of the tree waits so; re-taken before the wait returns or raises.
    activity = handle.activity if queue is not None else None
    if activity is not None:
        activity.begin_wait()
    try:
        async with (
            notifications.subscribe(ENDS_CHANNEL, ended, woken_by, heard=heard)
            if notifications is not None
            else nullcontext(False)
        ) as listening:
            while True:
                ended.clear()
                await _still_held(step)
                remote_left = [c for c in pending.values() if c._local is None]
                if not listening or loop.time() - full_at >= full_every:
                    full_at = loop.time()
                    asked = remote_left
                else:
                    asked = [c for c in remote_left if c.scope_key in heard]
                heard.clear()
                # The children asked about, in ONE read whatever their number.
                ends = {}
                if asked:
                    assert queue is not None
                    ends = await queue.child_ends([c.execution for c in asked])
                for index, child in list(pending.items()):
                    if child._local is not None:
                        done, value = _local_end(child, return_exceptions)
                    else:
                        done, value = _remote_end(handle, child, ends, return_exceptions, allow)
                    if done:
                        results[index] = value
                        del pending[index]
                if not pending:
                    if activity is not None:
                        ending, activity = activity, None  # ended once, even if it raises
                        await ending.end_wait()
                    await _still_held(step)
                    return results
                if deadline is not None and loop.time() >= deadline:
                    left = ", ".join(repr(child.scope_key) for child in pending.values())
                    raise TimeoutError(
                        f"children {left} of {handle.scope_key!r} had not ended after "
                        f"{timeout:g} s: is a worker serving their graph? See "
                        "`langgraph-fence runs`"
                    )
                left_s = float("inf") if deadline is None else max(0.0, deadline - loop.time())
                local = [c._local for c in pending.values() if c._local is not None]
                if len(local) == len(pending):  # only children of this process: woken by them
                    await asyncio.wait(
                        local, timeout=min(pause, left_s), return_when=asyncio.FIRST_COMPLETED
                    )
                    continue
                if activity is not None and not local:
                    await activity.maybe_yield()
                if listening and not local:
                    # Woken by a child's end, or at the next look at all of them.
                    next_full = max(0.0, full_at + full_every - loop.time())
                    with contextlib.suppress(TimeoutError):
                        await asyncio.wait_for(ended.wait(), min(next_full, left_s))
                else:
                    await asyncio.sleep(min(wait, left_s))
                    wait = min(wait * 2, pause)
    finally:
        # A wait that raised leaves no child of this process running on its own.
        for child in pending.values():
            if child._local is not None:
                child._local.cancel()
        if activity is not None:
            await activity.end_wait()  # re-taken first if yielded


def _local_end(child: Child, return_exceptions: bool) -> tuple[bool, Any]:
    """Whether a PARENT_INSTANCE child ended, and its output (or its error, placed)."""
    task = child._local
    assert task is not None
    if not task.done():
        return False, None
    failure = task.exception()
    if failure is None:
        return True, task.result()
    # A durable sleep or an interrupt() of the child's step (LangGraph's GraphBubbleUp) is the
    # tree's stop, never the child's result: it propagates (the root's run gives its lease
    # back until the wake time, or waits for its resume) as a fence does.
    if (
        return_exceptions
        and find_fence_error(failure) is None
        and not isinstance(failure, GraphBubbleUp)
    ):
        return True, failure
    raise failure


def _remote_end(
    handle: RunHandle,
    child: Child,
    ends: Mapping[LeaseKey, tuple[RunState, tuple[Any, Any]] | None],
    return_exceptions: bool,
    allow: Collection[tuple[str, ...]],
) -> tuple[bool, Any]:
    """Whether an ANY_INSTANCE child ended (by the look's read of every pending child,
    :meth:`SubmittedRuns.child_ends`), and its output (or error, placed)."""
    if child.execution not in ends:
        return False, None  # pending, running, or waiting for children of its own
    found = ends[child.execution]
    if found is None:
        raise LookupError(
            f"child execution {child.scope_key!r} (key {child.key!r}) is gone: it was "
            "erased while its parent waited"
        )
    state, stored = found
    if state.status in _OUTPUT_ENDS:
        queue = queue_of(handle)
        return True, queue.decode_output(child.execution, stored, allow)
    error = ChildFailedError(
        f"child execution {child.scope_key!r} (key {child.key!r}, graph "
        f"{child.graph_name!r}) of {handle.scope_key!r} ended {state.status.value} at token "
        f"{state.epoch}: {state.reason or 'no reason recorded'}",
        scope_key=child.scope_key,
        status=state.status.value,
        reason=state.reason,
    )
    if not return_exceptions:
        raise error
    return True, error


async def _still_held(step: Step) -> None:
    """Raise unless the waiting step still holds its lease; a hold that ran out is asked
    about once, so a waiter that was taken over stops with ``ExecutionFencedError``."""
    handle = step.handle
    handle.check_alive()
    if await handle.activity.check_yielded():
        # Given up on purpose: nothing to prove until the re-take, which a stop still
        # comes to (the wait's end re-takes before the drain hands the run back).
        _stopping(handle)
        return
    try:
        step.fence.assert_held()
    except ExecutionFencedError:
        raise
    except ExecutionLeaseLostError:
        await handle.renew()  # raises ExecutionFencedError if another instance took it
        raise
    _stopping(handle)


def _stopping(handle: RunHandle) -> None:
    if handle.stop_reason is not None:
        # The instance is stopping (SIGTERM, serve()'s stop): a wait would hold its drain
        # for as long as the children take. Handed back instead; the step run again finds
        # the children it spawned.
        from langgraph.errors import GraphDrained

        raise GraphDrained(handle.stop_reason)


async def _spawn_here(step: Step, graph_name: str, input: Any, key: str, graph: Any) -> Child:
    """Start a PARENT_INSTANCE child: the graph as a subgraph of the step, in a task that
    inherits the step's context (its config, hence the root's handle)."""
    from langchain_core.runnables.config import ensure_config

    from langgraph_fence.execution.fail_closed import refuse_unfenced
    from langgraph_fence.saver.checkpoint import FencedCheckpointer

    await _still_held(step)
    handle = step.handle
    if graph is None:
        served = {} if handle.host is None else handle.host.served_graphs
        graph = served.get(graph_name)
    if graph is None or not hasattr(graph, "ainvoke"):
        raise ValueError(
            f"graph must be the compiled graph of a PARENT_INSTANCE child (graph=...), or "
            f"this instance must serve one named {graph_name!r}; got {graph!r}"
        )
    own = getattr(graph, "checkpointer", None)
    if own not in (None, True) and not isinstance(own, FencedCheckpointer):
        raise ValueError(
            f"the graph of child {key!r} has a checkpointer of its own that is not fenced: "
            "compile it without one (it inherits the root's) or with instance.checkpointer"
        )
    refuse_unfenced(graph)  # it runs under the root's token: fenced, or refused here
    config = ensure_config()  # the step's config: its checkpointer, namespace and handle
    task = asyncio.ensure_future(graph.ainvoke(input, config))
    return Child(handle.key, key, graph_name, ChildPlacement.PARENT_INSTANCE, True, task)


def queue_of(handle: RunHandle) -> SubmittedRuns:
    """The run queue of the instance ``handle``'s run belongs to.

    Raises:
        RuntimeError: the run was not started by an Instance.
    """
    from langgraph_fence.execution.host import InstanceHost

    host = handle.host
    if not isinstance(host, InstanceHost):
        raise RuntimeError(
            f"execution {handle.scope_key!r} runs without an Instance: children and durable "
            "sleeps need a step of a run started by an Instance (ainvoke, submit or serve)"
        )
    return host.run_queue()

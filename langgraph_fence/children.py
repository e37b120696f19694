"""Child executions: a step spawns children and waits for their outputs.

``child = await get_execution_context().spawn_child(graph_name, input, placement=..., key=...)``
and ``results = await ctx.wait_children([child, ...])``.

``ChildPlacement.ANY_INSTANCE``: the child is an execution of its own, of the parent's tenant,
whose execution id is derived from the parent's scope key and ``key``
(:func:`child_execution_id`: collision-free, and :func:`parse_child_execution_id` decodes it).
It is recorded by the parent step in one transaction guarded by the parent's hold, as a
submitted run (:mod:`langgraph_fence.queue`): a re-run of the parent step finds the child of
the same key and spawns nothing new; a parent that was taken over spawns nothing (the guard
refuses, and the step stops with :class:`~langgraph_fence.ExecutionFencedError`). Any
instance whose ``serve()`` serves ``graph_name`` claims it and runs it under its own lease,
epoch and scope key; its output, or its failure or dead letter with the reason, is stored
with the execution. :meth:`wait_children` polls them and returns their outputs in the order
given, or raises :class:`~langgraph_fence.ChildFailedError` within one poll of a child's end.

While a step waits, the parent keeps its own lease (renewed as ever): the root lease is not
yielded during the wait (see README, "Child executions"). A waiter that stalls past its lease
is taken over like any run; the new holder re-runs the waiting step, which finds the
children it spawned and their results, and the stalled waiter stops with
:class:`~langgraph_fence.ExecutionFencedError` at its next look.

``ChildPlacement.PARENT_INSTANCE`` is not built yet: spawning one raises
``NotImplementedError`` (run the graph as a subgraph inside the node instead: it runs under
the root's lease and token).
"""

from __future__ import annotations

import asyncio
from collections.abc import Collection, Sequence
from dataclasses import dataclass
from enum import StrEnum
from typing import TYPE_CHECKING, Any

from .errors import ChildFailedError, ExecutionFencedError, ExecutionLeaseLostError
from .lease import LeaseKey, LeaseStatus
from .scope import parse_scope_key, scope_key
from .validate import positive_seconds, text_id

if TYPE_CHECKING:
    from .context import ExecutionContext
    from .fence import RunHandle
    from .queue import SubmittedRuns

__all__ = [
    "Child",
    "ChildPlacement",
    "child_execution_id",
    "parse_child_execution_id",
    "spawn_child",
    "wait_children",
]

_OUTPUT_ENDS = (LeaseStatus.DONE, LeaseStatus.WAITING)
_FAILED_ENDS = (LeaseStatus.FAILED, LeaseStatus.DEAD_LETTERED)


class ChildPlacement(StrEnum):
    """Where a child execution runs.

    ``PARENT_INSTANCE``: in this process, under the root's lease and token (not built yet).
    ``ANY_INSTANCE``: an execution of its own, claimed by any instance's ``serve()``.
    """

    PARENT_INSTANCE = "parent_instance"
    ANY_INSTANCE = "any_instance"


@dataclass(frozen=True, slots=True)
class Child:
    """A child execution a step spawned (what :meth:`ExecutionContext.spawn_child` returns).

    Attributes:
        execution: the child execution's lease key (the parent's tenant, a derived id).
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

    @property
    def scope_key(self) -> str:
        """The child execution's scope key (its fences' and sinks' key)."""
        return self.execution.scope_key


def child_execution_id(parent: LeaseKey, key: str) -> str:
    """The execution id of ``parent``'s child of ``key``: ``scope_key(tenant, parent id, key)``.

    Collision-free (each part is encoded, so no ``:`` of a part is a separator) and decoded
    by :func:`parse_child_execution_id`; a grandchild's id nests its parent's.

    Raises:
        ValueError: ``key`` is empty or not a ``str``.
    """
    return scope_key(parent.tenant_id, parent.execution_id, key)


def parse_child_execution_id(execution_id: str) -> tuple[LeaseKey, str] | None:
    """``(parent key, child key)`` of a child execution id, or ``None`` for an id that is
    not one (an execution started by ``ainvoke`` or ``submit``, with a plain id)."""
    try:
        parts = parse_scope_key(execution_id)
    except ValueError:
        return None
    if len(parts) != 3:
        return None
    tenant, parent, key = parts
    return LeaseKey(tenant, parent), key


async def spawn_child(
    frame: ExecutionContext,
    graph_name: str,
    input: Any,
    *,
    placement: ChildPlacement,
    key: str,
) -> Child:
    """Spawn a child of the step ``frame`` (see :meth:`ExecutionContext.spawn_child`)."""
    text_id("graph_name", graph_name, what="the name a worker serves the child's graph under")
    text_id("key", key, what="the child's key, unique among this execution's children")
    if not isinstance(placement, ChildPlacement):
        raise TypeError(
            f"placement must be a ChildPlacement (ChildPlacement.ANY_INSTANCE or "
            f"ChildPlacement.PARENT_INSTANCE), got {placement!r}"
        )
    if placement is ChildPlacement.PARENT_INSTANCE:
        raise NotImplementedError(
            "ChildPlacement.PARENT_INSTANCE is not built yet: call the child graph inside the "
            "node as a subgraph (it runs under the root's lease and token), or spawn it with "
            "placement=ChildPlacement.ANY_INSTANCE"
        )
    handle = frame._handle
    await _still_held(frame)
    queue = _queue_of(handle)
    parent = handle.key
    execution_id = child_execution_id(parent, key)
    config = {"configurable": {"thread_id": execution_id}}
    child_key, thread_id, run = queue.check(
        graph_name, input, config, parent.tenant_id, execution_id, "reject", {}
    )
    written = await queue.submit_child(handle.lease, child_key, graph_name, thread_id, input, run)
    if written is None:
        # The parent's hold is gone: the strict renewal says how (taken over: fenced).
        await handle.renew()
        raise handle.record(
            ExecutionLeaseLostError(
                f"execution {handle.scope_key!r} at token {handle.token} no longer holds its "
                f"lease: child {key!r} was not spawned",
                scope_key=handle.scope_key,
                token_held=handle.token,
            )
        )
    return Child(child_key, key, graph_name, placement, written)


async def wait_children(
    frame: ExecutionContext,
    children: Sequence[Child],
    *,
    timeout: float | None = None,  # noqa: ASYNC109 - gather-like API: timeout=
    return_exceptions: bool = False,
    poll_interval: float = 0.05,
    allow: Collection[tuple[str, ...]] = (),
) -> list[Any]:
    """Wait for ``children`` (see :meth:`ExecutionContext.wait_children`)."""
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
    handle = frame._handle
    queue = _queue_of(handle)
    loop = asyncio.get_running_loop()
    deadline = None if timeout is None else loop.time() + timeout
    results: list[Any] = [None] * len(children)
    pending = dict(enumerate(children))
    wait = min(0.005, pause)
    while True:
        await _still_held(frame)
        for index, child in list(pending.items()):
            found = await queue.state(child.execution)
            if found is None:
                raise LookupError(
                    f"child execution {child.scope_key!r} (key {child.key!r}) is gone: it was "
                    "erased while its parent waited"
                )
            state, stored = found
            if state.status in _OUTPUT_ENDS:
                results[index] = queue.decode_output(child.execution, stored, allow)
            elif state.status in _FAILED_ENDS:
                error = ChildFailedError(
                    f"child execution {child.scope_key!r} (key {child.key!r}, graph "
                    f"{child.graph_name!r}) of {handle.scope_key!r} ended "
                    f"{state.status.value} at token {state.epoch}: "
                    f"{state.reason or 'no reason recorded'}",
                    scope_key=child.scope_key,
                    status=state.status.value,
                    reason=state.reason,
                )
                if not return_exceptions:
                    raise error
                results[index] = error
            else:
                continue
            del pending[index]
        if not pending:
            await _still_held(frame)
            return results
        if deadline is not None and loop.time() >= deadline:
            left = ", ".join(repr(child.scope_key) for child in pending.values())
            raise TimeoutError(
                f"children {left} of {handle.scope_key!r} had not ended after {timeout:g} s: "
                "is a worker serving their graph? See `langgraph-fence runs`"
            )
        left_s = pause if deadline is None else max(0.0, deadline - loop.time())
        await asyncio.sleep(min(wait, left_s))
        wait = min(wait * 2, pause)


async def _still_held(frame: ExecutionContext) -> None:
    """Raise unless the waiting step still holds its lease; a hold that ran out is asked
    about once, so a waiter that was taken over stops with ``ExecutionFencedError``."""
    handle = frame._handle
    handle.check_alive()
    try:
        frame.fence.assert_held()
    except ExecutionFencedError:
        raise
    except ExecutionLeaseLostError:
        await handle.renew()  # raises ExecutionFencedError if another instance took it
        raise


def _queue_of(handle: RunHandle) -> SubmittedRuns:
    instance = handle.instance
    if instance is None:
        raise RuntimeError(
            f"execution {handle.scope_key!r} runs without an Instance: children are spawned "
            "from a step of a run started by an Instance (ainvoke, submit or serve)"
        )
    return instance._run_queue()

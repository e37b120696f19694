"""An approval inside a write step: ``interrupt()`` before the write, then ``side_effect()``.

A write step declared ``stamp="effect"`` (a node with ``@fenced(..., stamp="effect")``, a tool
in ``fence_tools(..., stamp_at_effect=[...])``) is stamped where its body enters
``side_effect()``, so an ``interrupt()`` before it (asking for approval) is safe to resume.
On the first version the stamp covered the whole body: the interrupt left it standing and
the resume was dead-lettered as "taken over ... by <the same instance>", though nothing was
taken over and the write never began.

Instance A runs the step; the kills are freezes (A's lease store and timers stop, as under
SIGSTOP) long enough for A's lease to lapse; instance B then takes the execution over with
``serve()``.
"""

from __future__ import annotations

import asyncio
import operator
from dataclasses import dataclass, field
from typing import Annotated, Any, TypedDict

import pytest
from langchain_core.messages import AIMessage, AnyMessage
from langchain_core.tools import tool
from langgraph.graph import END, START, StateGraph
from langgraph.graph.message import add_messages
from langgraph.prebuilt import ToolNode
from langgraph.types import Command, RetryPolicy, interrupt

from langgraph_fence import (
    Effect,
    ExecutionDeadLetteredError,
    ExecutionFencedError,
    Instance,
    LeaseStatus,
    fence_graph,
    fence_tools,
    fenced,
    get_execution_context,
)
from tests.support.databases import Database, unique
from tests.support.polling import eventually
from tests.support.stalls import WAIT, invoke, lease_of, stallable


@dataclass
class Refunds:
    """The external system, and where instance A's step waits to be frozen."""

    done: list[tuple[str, int]] = field(default_factory=list)
    hold_a_at: str | None = None  # "after-approval" or "inside-effect"
    a_reached: asyncio.Event = field(default_factory=asyncio.Event)
    a_go: asyncio.Event = field(default_factory=asyncio.Event)

    async def stop_here(self, stage: str) -> None:
        if get_execution_context().fence._handle.lease.holder == "A" and stage == self.hold_a_at:
            self.a_reached.set()
            await self.a_go.wait()

    async def approved_refund(self) -> str:
        answer = interrupt("refund order o1?")
        await self.stop_here("after-approval")
        frame = get_execution_context()
        async with frame.side_effect():
            self.done.append((frame.fence._handle.lease.holder or "", frame.fence.token))
            await self.stop_here("inside-effect")
        return f"refunded ({answer})"


class Log(TypedDict):
    log: Annotated[list[str], operator.add]


class Messages(TypedDict):
    messages: Annotated[list[AnyMessage], add_messages]


def build(kind: str, refunds: Refunds, instance: Instance, *, stamp: str = "effect") -> Any:
    if kind == "node":

        @fenced(effect=Effect.NON_IDEMPOTENT_WRITE, stamp=stamp)  # type: ignore[arg-type]
        async def refund(state: Log) -> dict[str, list[str]]:
            return {"log": [await refunds.approved_refund()]}

        node_graph = StateGraph(Log)
        node_graph.add_node("refund", refund)
        node_graph.add_edge(START, "refund")
        node_graph.add_edge("refund", END)
        return node_graph.compile(checkpointer=instance.checkpointer, name="refund_node")

    @tool
    async def refund_order(order: str) -> str:
        """Refund an order, once a person approved it."""
        return await refunds.approved_refund()

    deferred = ["refund_order"] if stamp == "effect" else []
    tool_graph = StateGraph(Messages)
    tool_graph.add_node("tools", ToolNode(fence_tools([refund_order], stamp_at_effect=deferred)))
    tool_graph.add_edge(START, "tools")
    tool_graph.add_edge("tools", END)
    return fence_graph(tool_graph).compile(checkpointer=instance.checkpointer, name="refund_tool")


def first_input(kind: str) -> Any:
    if kind == "node":
        return {"log": []}
    call = {"name": "refund_order", "args": {"order": "o1"}, "id": "call-1"}
    return {"messages": [AIMessage("", tool_calls=[call])]}


@pytest.mark.parametrize("kind", ["node", "tool"])
async def test_an_approval_before_the_write_resumes_from_another_instance(
    database: Database, kind: str
) -> None:
    refunds = Refunds()
    thread = unique("approval")
    async with stallable(database, "A") as (a, _), stallable(database, "B") as (b, _):
        out = await invoke(a, build(kind, refunds, a), first_input(kind), thread)
        assert "__interrupt__" in out
        waiting = await lease_of(a, thread)
        assert waiting.status is LeaseStatus.WAITING
        assert waiting.pending_effects == ()
        # The person approves; another worker resumes the thread.
        await invoke(b, build(kind, refunds, b), Command(resume="approved"), thread)
        done = await lease_of(b, thread)
        assert done.status is LeaseStatus.DONE, done
    assert refunds.done == [("B", 2)]


async def freeze_a_at(
    database: Database, kind: str, stage: str
) -> tuple[Refunds, Any, BaseException | None]:
    """A resumes the approved step and is frozen at ``stage``; B takes over and serves it.

    Returns the refunds, the lease after B's turn, and what A's run ended with.
    """
    refunds = Refunds(hold_a_at=stage)
    thread = unique("approval")
    async with stallable(database, "A") as (a, gate_a), stallable(database, "B") as (b, _):
        graph_a = build(kind, refunds, a)
        await invoke(a, graph_a, first_input(kind), thread)
        run_a = asyncio.create_task(invoke(a, graph_a, Command(resume="approved"), thread))
        await asyncio.wait_for(refunds.a_reached.wait(), WAIT)
        gate_a.stall()  # SIGSTOP: A's renewals stop, its lease lapses
        graph_b = build(kind, refunds, b)
        stop = asyncio.Event()
        serving = asyncio.create_task(
            b.serve({graph_b.name: graph_b}, poll_interval=0.05, stop=stop, handle_signals=False)
        )

        async def ended() -> Any:
            lease = await lease_of(b, thread)
            return lease if lease.status in (LeaseStatus.DONE, LeaseStatus.DEAD_LETTERED) else None

        try:
            lease = await eventually(ended, timeout=WAIT, what="B's takeover to end")
        finally:
            stop.set()
            await asyncio.wait_for(serving, WAIT)
        gate_a.resume()  # SIGCONT: A wakes up inside its step
        refunds.a_go.set()
        outcome: BaseException | None = None
        try:
            await asyncio.wait_for(run_a, WAIT)
        except BaseException as exc:
            outcome = exc
    return refunds, lease, outcome


@pytest.mark.parametrize("kind", ["node", "tool"])
async def test_frozen_after_the_approval_and_before_the_write_is_resumed_not_dead_lettered(
    database: Database, kind: str
) -> None:
    refunds, lease, outcome = await freeze_a_at(database, kind, "after-approval")
    assert lease.status is LeaseStatus.DONE, lease  # no stamp stood: B resumed the step
    assert refunds.done == [("B", 3)]  # A's later side_effect() stamped nothing, wrote nothing
    assert isinstance(outcome, ExecutionFencedError), outcome


@pytest.mark.parametrize("kind", ["node", "tool"])
async def test_frozen_inside_the_write_is_dead_lettered_naming_it(
    database: Database, kind: str
) -> None:
    refunds, lease, outcome = await freeze_a_at(database, kind, "inside-effect")
    assert lease.status is LeaseStatus.DEAD_LETTERED, lease
    node = "refund" if kind == "node" else "tools:refund_order"
    assert lease.reason is not None, lease.reason
    assert f"node '{node}' at token 2" in lease.reason, lease.reason
    assert refunds.done == [("A", 2)]  # once, by A; B did not repeat it
    assert isinstance(outcome, ExecutionFencedError), outcome


@pytest.mark.parametrize("kind", ["node", "tool"])
async def test_an_interrupt_under_a_body_wide_stamp_pauses_and_resumes_writing_once(
    database: Database, kind: str
) -> None:
    """Stamped before the body (the default), the step pauses at interrupt(): LangGraph runs
    it again from its start on resume, so the stamp is released at the pause and taken anew
    by the resumed step. (The first versions dead-lettered the thread here.)"""
    refunds = Refunds()
    thread = unique("approval")
    async with stallable(database, "A") as (a, _):
        graph = build(kind, refunds, a, stamp="body")
        await invoke(a, graph, first_input(kind), thread)
        paused = await lease_of(a, thread)
        assert paused.status is LeaseStatus.WAITING, paused
        assert paused.pending_effects == ()
        assert refunds.done == []
        await invoke(a, graph, Command(resume="yes"), thread)
        lease = await lease_of(a, thread)
    assert lease.status is LeaseStatus.DONE, lease
    assert refunds.done == [("A", 2)]  # once, under the resume's token


async def test_an_interrupt_after_the_write_began_is_refused_at_once(database: Database) -> None:
    """interrupt() inside side_effect(): the write began, and the resumed step would run it
    again from its start, so the execution is dead-lettered at the pause, naming the fix."""
    written: list[int] = []

    @fenced(effect=Effect.NON_IDEMPOTENT_WRITE, stamp="effect")
    async def refund(state: Log) -> dict[str, list[str]]:
        frame = get_execution_context()
        async with frame.side_effect():
            written.append(frame.fence.token)
            interrupt("was the refund right?")
        return {"log": ["refunded"]}

    thread = unique("approval")
    async with stallable(database, "A") as (a, _):
        builder = StateGraph(Log)
        builder.add_node("refund", refund)
        builder.add_edge(START, "refund")
        builder.add_edge("refund", END)
        graph = builder.compile(checkpointer=a.checkpointer, name="refund_node")
        with pytest.raises(ExecutionDeadLetteredError, match="after a non-idempotent write"):
            await invoke(a, graph, {"log": []}, thread)
        lease = await lease_of(a, thread)
    assert lease.status is LeaseStatus.DEAD_LETTERED
    assert "call interrupt() before" in lease.reason
    assert written == [1]


class FailsBeforeTheWrite:
    """A write step whose first ``failures`` attempts fail before ``side_effect()`` (a model
    call that timed out): nothing was stamped, nothing written, so it is safe to repeat."""

    def __init__(self, failures: int) -> None:
        self.failures = failures
        self.attempts = 0
        self.written: list[int] = []

    async def refund(self) -> str:
        self.attempts += 1
        if self.attempts <= self.failures:
            raise ConnectionError("the model call timed out")
        frame = get_execution_context()
        async with frame.side_effect():
            self.written.append(frame.fence.token)
        return "refunded"


def build_failing(kind: str, step: FailsBeforeTheWrite, instance: Instance, retries: int) -> Any:
    """``kind`` "node": a ``stamp="effect"`` node; "tool": a ``stamp_at_effect`` tool that a
    read-only node calls. ``retries`` attempts of the node on ``ConnectionError``."""

    @tool
    async def refund_order(order: str) -> str:
        """Refund an order."""
        return await step.refund()

    (fenced_tool,) = fence_tools([refund_order], stamp_at_effect=["refund_order"])

    async def call_tool(state: Log) -> dict[str, list[str]]:
        return {"log": [await fenced_tool.ainvoke({"order": "o1"})]}

    @fenced(effect=Effect.NON_IDEMPOTENT_WRITE, stamp="effect")
    async def refund(state: Log) -> dict[str, list[str]]:
        return {"log": [await step.refund()]}

    builder = StateGraph(Log)
    policy = RetryPolicy(
        max_attempts=retries, initial_interval=0.001, jitter=False, retry_on=ConnectionError
    )
    builder.add_node("refund", refund if kind == "node" else call_tool, retry_policy=policy)
    builder.add_edge(START, "refund")
    builder.add_edge("refund", END)
    return fence_graph(builder).compile(checkpointer=instance.checkpointer, name=f"fail_{kind}")


@pytest.mark.parametrize("kind", ["node", "tool"])
async def test_a_failure_before_side_effect_is_retried_not_dead_lettered(
    database: Database, kind: str
) -> None:
    step = FailsBeforeTheWrite(failures=1)
    thread = unique("before-effect")
    async with stallable(database, "A") as (a, _):
        out = await invoke(a, build_failing(kind, step, a, retries=2), {"log": []}, thread)
        lease = await lease_of(a, thread)
    assert out == {"log": ["refunded"]}
    assert lease.status is LeaseStatus.DONE, lease
    assert step.attempts == 2
    assert step.written == [1]  # written once, by the retried attempt


@pytest.mark.parametrize("kind", ["node", "tool"])
async def test_a_failure_before_side_effect_ends_failed_and_its_resume_writes_once(
    database: Database, kind: str
) -> None:
    step = FailsBeforeTheWrite(failures=1)
    thread = unique("before-effect")
    async with stallable(database, "A") as (a, _):
        graph = build_failing(kind, step, a, retries=1)
        with pytest.raises(ConnectionError, match="timed out"):
            await invoke(a, graph, {"log": []}, thread)
        failed = await lease_of(a, thread)
        assert failed.status is LeaseStatus.FAILED, failed  # not dead-lettered
        assert failed.pending_effects == ()
        out = await invoke(a, graph, None, thread)  # LangGraph's resume after an error
        done = await lease_of(a, thread)
    assert out == {"log": ["refunded"]}
    assert done.status is LeaseStatus.DONE, done
    assert step.written == [2]

"""LangGraph's human-in-the-loop patterns, written as its docs write them, fenced, and a
worker script that resumes one after the approval and is SIGKILLed mid-write.

The patterns (``build(instance, pattern, directory, doomed=...)``), each with one
non-idempotent write (``charge`` or ``send_email``) that appends a line to
``DIRECTORY/effects/<thread>``:

* ``node-async`` / ``node-sync``: a node that calls ``interrupt()`` and writes after it,
  declared ``NON_IDEMPOTENT_WRITE`` through ``fence_graph(builder, effects=...)``.
* ``tool-async`` / ``tool-sync``: ``interrupt()`` inside a tool (LangGraph's "interrupts in
  tools" example: approve, or anything else cancels), in ``create_agent``, fenced with
  ``fence_graph(agent)`` (the tool undeclared, so non-idempotent).
* ``before`` / ``after``: static breakpoints, ``compile(interrupt_before=["charge"])`` and
  ``compile(interrupt_after=["review"])``; a rejection is a state update
  (``approved=False``) before the resume.
* ``middleware``: LangChain's ``HumanInTheLoopMiddleware`` gating ``send_email`` in
  ``create_agent``, fenced with ``fence_graph(agent)``.

In a *doomed* process the write SIGKILLs the process right after its line is on disk: the
worker died mid-write, after the approval.

The script::

    python -m tests.support.approvals URL SCHEMA TENANT PATTERN THREAD DIRECTORY TTL

resumes THREAD (paused at its approval) with the pattern's approval, doomed.
"""

from __future__ import annotations

import asyncio
import operator
import os
import signal
import sys
from pathlib import Path
from typing import Annotated, Any, TypedDict

from langchain_core.messages import AIMessage
from langchain_core.tools import tool
from langgraph.graph import END, START, StateGraph
from langgraph.graph.message import add_messages
from langgraph.types import Command, interrupt

from langgraph_fence import Effect, Instance, fence_graph, get_execution_context
from tests.support.write_steps import open_doomed

PATTERNS = ("node-async", "node-sync", "tool-async", "tool-sync", "before", "after", "middleware")
AGENTS = ("tool-async", "tool-sync", "middleware")


class State(TypedDict, total=False):
    log: Annotated[list[str], operator.add]
    approved: bool


class Messages(TypedDict):
    messages: Annotated[list[Any], add_messages]


def effects_of(directory: Path, thread: str) -> list[str]:
    """The writes made for ``thread``, one entry per write."""
    path = directory / "effects" / thread
    return path.read_text().split() if path.exists() else []


def _effect(directory: Path, name: str, *, doomed: bool) -> None:
    thread = get_execution_context().thread_id
    fd = os.open(directory / "effects" / thread, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    try:
        os.write(fd, f"{name}\n".encode())  # on disk before a SIGKILL
    finally:
        os.close(fd)
    if doomed:
        os.kill(os.getpid(), signal.SIGKILL)  # mid-write: after the effect, before the step ends


def first_input(pattern: str) -> Any:
    if pattern in AGENTS:
        return {"messages": [("user", "e-mail Alice the report")]}
    return {"log": []}


def approval(pattern: str) -> Any:
    """What resumes ``pattern`` approved."""
    if pattern.startswith("node"):
        return Command(resume="approve")
    if pattern.startswith("tool"):
        return Command(resume={"action": "approve"})
    if pattern == "middleware":
        return Command(resume={"decisions": [{"type": "approve"}]})
    return None  # a static breakpoint: resume as it is


async def reject(graph: Any, config: Any, pattern: str) -> Any:
    """Prepare the rejection of ``pattern`` (a state update for a breakpoint); what then
    resumes it."""
    if pattern.startswith("node"):
        return Command(resume="reject")
    if pattern.startswith("tool"):
        return Command(resume={"action": "reject"})
    if pattern == "middleware":
        return Command(resume={"decisions": [{"type": "reject", "message": "not now"}]})
    await graph.aupdate_state(config, {"approved": False})
    return None


def build(instance: Instance, pattern: str, directory: Path, *, doomed: bool = False) -> Any:
    """The fenced graph of ``pattern``, compiled with ``instance.checkpointer``."""
    if pattern not in PATTERNS:
        raise ValueError(f"pattern must be one of {', '.join(PATTERNS)}, got {pattern!r}")
    if pattern in AGENTS:
        return _agent(instance, pattern, directory, doomed=doomed)

    def effect() -> None:
        _effect(directory, "charge", doomed=doomed)

    builder = StateGraph(State)
    if pattern.startswith("node"):

        async def approve_and_charge(state: State) -> dict[str, Any]:
            answer = interrupt({"action": "charge", "amount": 42})
            if answer == "approve":
                effect()
                return {"log": ["charged"]}
            return {"log": ["rejected"]}

        def approve_and_charge_sync(state: State) -> dict[str, Any]:
            answer = interrupt({"action": "charge", "amount": 42})
            if answer == "approve":
                effect()
                return {"log": ["charged"]}
            return {"log": ["rejected"]}

        node = approve_and_charge if pattern == "node-async" else approve_and_charge_sync
        builder.add_node("charge", node)
        builder.add_edge(START, "charge")
        builder.add_edge("charge", END)
        return fence_graph(builder, effects={"charge": Effect.NON_IDEMPOTENT_WRITE}).compile(
            checkpointer=instance.checkpointer, name=graph_name(pattern)
        )

    async def review(state: State) -> dict[str, Any]:
        return {"log": ["reviewed"]}

    async def charge(state: State) -> dict[str, Any]:
        if state.get("approved", True):
            effect()
            return {"log": ["charged"]}
        return {"log": ["rejected"]}

    builder.add_node("review", review)
    builder.add_node("charge", charge)
    builder.add_edge(START, "review")
    builder.add_edge("review", "charge")
    builder.add_edge("charge", END)
    breakpoint_ = {"interrupt_before": ["charge"]}
    if pattern == "after":
        breakpoint_ = {"interrupt_after": ["review"]}
    return fence_graph(builder, effects={"charge": Effect.NON_IDEMPOTENT_WRITE}).compile(
        checkpointer=instance.checkpointer, name=graph_name(pattern), **breakpoint_
    )


def _agent(instance: Instance, pattern: str, directory: Path, *, doomed: bool) -> Any:
    from langchain.agents import create_agent
    from langchain.agents.middleware import HumanInTheLoopMiddleware

    from tests.support.agents import ScriptedModel

    def send(to: str) -> str:
        _effect(directory, "send_email", doomed=doomed)
        return f"Email sent to {to}"

    # LangGraph's example, "interrupts in tools": pause before sending; approve or cancel.
    @tool("send_email")
    def send_email_sync(to: str, subject: str) -> str:
        """Send an email to a recipient."""
        response = interrupt({"action": "send_email", "to": to, "subject": subject})
        if response.get("action") == "approve":
            return send(to)
        return "Email cancelled by user"

    @tool("send_email")
    async def send_email_async(to: str, subject: str) -> str:
        """Send an email to a recipient."""
        response = interrupt({"action": "send_email", "to": to, "subject": subject})
        if response.get("action") == "approve":
            return send(to)
        return "Email cancelled by user"

    @tool("send_email")
    def send_email_plain(to: str, subject: str) -> str:
        """Send an email to a recipient."""
        return send(to)

    call = {"name": "send_email", "args": {"to": "alice@example.com", "subject": "report"}}
    model = ScriptedModel(
        turns=[
            AIMessage("", tool_calls=[{**call, "id": "call-1"}]),
            AIMessage("done"),
            AIMessage("", tool_calls=[{**call, "id": "call-2"}]),
            AIMessage("done again"),
        ]
    )
    if pattern == "middleware":
        agent = create_agent(
            model,
            tools=[send_email_plain],
            middleware=[HumanInTheLoopMiddleware(interrupt_on={"send_email": True})],
            checkpointer=instance.checkpointer,
            name=graph_name(pattern),
        )
    else:
        send_email = send_email_async if pattern == "tool-async" else send_email_sync
        agent = create_agent(
            model, tools=[send_email], checkpointer=instance.checkpointer, name=graph_name(pattern)
        )
    return fence_graph(agent)


def graph_name(pattern: str) -> str:
    return f"approval_{pattern.replace('-', '_')}"


async def doomed(
    url: str, schema: str, tenant: str, pattern: str, thread: str, directory: Path, ttl: float
) -> int:
    async with open_doomed(url, schema, ttl) as instance:
        graph = build(instance, pattern, directory, doomed=True)
        await instance.ainvoke(
            graph, approval(pattern), {"configurable": {"thread_id": thread}}, tenant_id=tenant
        )
    return 1  # the write kills the process: reaching here is a failure


def main(argv: list[str]) -> int:
    if len(argv) != 7:
        print(__doc__, file=sys.stderr)
        return 2
    url, schema, tenant, pattern, thread, directory, ttl = argv
    return asyncio.run(doomed(url, schema, tenant, pattern, thread, Path(directory), float(ttl)))


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))

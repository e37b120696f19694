"""LangGraph's human-in-the-loop patterns, as its docs write them, with a non-idempotent
write behind the approval: the run pauses; an approved resume writes once; a rejected one
writes nothing; the thread takes new input afterwards.

The patterns are those of ``tests/support/approvals.py``: ``interrupt()`` in a node (async and
sync), ``interrupt()`` inside a tool (async and sync, LangGraph's own example, in
``create_agent`` fenced with ``fence_graph(agent)``), ``interrupt_before`` and
``interrupt_after``, and LangChain's ``HumanInTheLoopMiddleware``. Each runs the documented
way (docs/langgraph.md): ``graph.ainvoke`` on a graph compiled with
``instance.checkpointer``, no tenant given. On the first versions ``interrupt()`` inside a
write step dead-lettered the thread on its first call.
``tests/chaos/test_approvals_killed.py`` kills a worker mid-write after the approval.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from langgraph_fence import Instance, LeaseKey, LeaseStatus
from tests.support.approvals import (
    AGENTS,
    PATTERNS,
    approval,
    build,
    effects_of,
    first_input,
    reject,
)
from tests.support.databases import Database, engine_options, unique


def _config(thread: str) -> dict[str, Any]:
    return {"configurable": {"thread_id": thread}}


async def _paused(instance: Instance, graph: Any, thread: str) -> None:
    """The thread waits for its approval: a next step or an interrupt, nothing held."""
    state = await graph.aget_state(_config(thread))
    assert state.next or state.interrupts, state
    lease = await instance.repository.get(LeaseKey(instance.tenant_id, thread))
    assert lease is not None
    assert lease.status is LeaseStatus.WAITING, lease
    assert lease.pending_effects == (), lease


@pytest.mark.parametrize("pattern", PATTERNS)
async def test_an_approval_writes_once_and_a_rejection_writes_nothing(
    database: Database, pattern: str, tmp_path: Path
) -> None:
    (tmp_path / "effects").mkdir()
    write = "send_email" if pattern in AGENTS else "charge"
    async with Instance.open(
        database.url, engine_options=engine_options(database.url, database.schema)
    ) as instance:
        graph = build(instance, pattern, tmp_path)
        approved, rejected = unique("approved"), unique("rejected")
        for thread in (approved, rejected):
            await graph.ainvoke(first_input(pattern), _config(thread))
            await _paused(instance, graph, thread)
            assert effects_of(tmp_path, thread) == []

        await graph.ainvoke(approval(pattern), _config(approved))
        resume = await reject(graph, _config(rejected), pattern)
        await graph.ainvoke(resume, _config(rejected))
        assert effects_of(tmp_path, approved) == [write]
        assert effects_of(tmp_path, rejected) == []
        for thread in (approved, rejected):
            lease = await instance.repository.get(LeaseKey(instance.tenant_id, thread))
            assert lease is not None
            assert lease.status is LeaseStatus.DONE, lease
            assert (await graph.aget_state(_config(thread))).next == ()

        # The thread goes on: new input runs up to its next approval, writing nothing.
        await graph.ainvoke(first_input(pattern), _config(approved))
        await _paused(instance, graph, approved)
        assert effects_of(tmp_path, approved) == [write]


def _unsafe_shapes(charges: list[str]) -> dict[str, Any]:
    """Write steps (stamped before their body, as by default) whose pause may follow their
    write: a second interrupt() after an answered one, an interrupt() after side_effect(),
    and an interrupt() raised in a subgraph the step calls after writing."""
    from langgraph.graph import END, START, StateGraph
    from langgraph.types import interrupt

    from langgraph_fence import fence_graph, get_execution_context
    from tests.support.approvals import State

    async def two_interrupts(state: State) -> dict[str, Any]:
        interrupt("charge?")
        charges.append("charge")
        interrupt("and e-mail the receipt?")
        return {"log": ["done"]}

    async def after_side_effect(state: State) -> dict[str, Any]:
        async with get_execution_context().side_effect():
            charges.append("charge")
        interrupt("was that right?")
        return {"log": ["done"]}

    async def ask(state: State) -> dict[str, Any]:
        interrupt("anything else?")
        return {"log": ["asked"]}

    sub = StateGraph(State)
    sub.add_node("ask", ask)
    sub.add_edge(START, "ask")
    sub.add_edge("ask", END)
    asking = fence_graph(sub).compile(name="asking")

    async def then_a_subgraph(state: State) -> dict[str, Any]:
        charges.append("charge")
        await asking.ainvoke({"log": []})
        return {"log": ["done"]}

    return {
        "two-interrupts": two_interrupts,
        "after-side-effect": after_side_effect,
        "then-a-subgraph": then_a_subgraph,
    }


@pytest.mark.parametrize("shape", ["two-interrupts", "after-side-effect", "then-a-subgraph"])
async def test_a_pause_that_may_follow_the_write_keeps_its_stamp(
    database: Database, shape: str, tmp_path: Path
) -> None:
    """Only a pause at the step's own first interrupt(), no answer consumed, side_effect()
    never entered, proves the write has not begun; any other pause keeps the stamp, so the
    execution is dead-lettered there and the write never runs twice."""
    from langgraph.graph import END, START, StateGraph
    from langgraph.types import Command

    from langgraph_fence import Effect, ExecutionDeadLetteredError, fence_graph
    from tests.support.approvals import State

    charges: list[str] = []
    node = _unsafe_shapes(charges)[shape]
    async with Instance.open(
        database.url, engine_options=engine_options(database.url, database.schema)
    ) as instance:
        builder = StateGraph(State)
        builder.add_node("charge", node)
        builder.add_edge(START, "charge")
        builder.add_edge("charge", END)
        graph = fence_graph(builder, effects={"charge": Effect.NON_IDEMPOTENT_WRITE}).compile(
            checkpointer=instance.checkpointer, name="unsafe"
        )
        thread = unique(shape)
        if shape == "two-interrupts":
            await graph.ainvoke({"log": []}, _config(thread))  # the first pause: released
            await _paused(instance, graph, thread)
            first = Command(resume="yes")
        else:
            first = {"log": []}
        with pytest.raises(ExecutionDeadLetteredError, match="after a non-idempotent write"):
            await graph.ainvoke(first, _config(thread))
        assert charges == ["charge"]
        lease = await instance.repository.get(LeaseKey(instance.tenant_id, thread))
        assert lease is not None
        assert lease.status is LeaseStatus.DEAD_LETTERED, lease
        with pytest.raises(Exception):  # noqa: B017, PT011 - refused, whatever the class
            await graph.ainvoke(Command(resume="yes"), _config(thread))
        assert charges == ["charge"]

"""LangGraph's human-in-the-loop patterns, as its docs write them, with a non-idempotent
write behind the approval: the run pauses; an approved resume writes once; a rejected one
writes nothing; the thread takes new input afterwards.

The patterns are those of ``tests/chaos/approvals.py``: ``interrupt()`` in a node (async and
sync), ``interrupt()`` inside a tool (async and sync, LangGraph's own example, in
``create_agent`` fenced with ``fence_graph(agent)``), ``interrupt_before`` and
``interrupt_after``, and LangChain's ``HumanInTheLoopMiddleware``. Each runs the README's way:
``graph.ainvoke`` on a graph compiled with ``instance.checkpointer``, no tenant given. On the
first versions ``interrupt()`` inside a write step dead-lettered the thread on its first call.
``tests/chaos/test_approvals_killed.py`` kills a worker mid-write after the approval.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from langgraph_fence import Instance, LeaseKey, LeaseStatus
from tests.chaos.approvals import (
    AGENTS,
    PATTERNS,
    approval,
    build,
    effects_of,
    first_input,
    reject,
)
from tests.chaos.write_steps import Database, engine_options
from tests.conftest import unique


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

"""SqlCheckpointer and FencedCheckpointer at their edges: bad input, sync twins, lifecycle.

Every refused call must name what is wrong and how to fix it, and leave no row behind.
"""

from __future__ import annotations

import asyncio
import operator
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Annotated, Any, TypedDict

import pytest
from langgraph.checkpoint.conformance.test_utils import generate_checkpoint, generate_metadata
from langgraph.checkpoint.memory import InMemorySaver
from langgraph.graph import END, START, StateGraph
from sqlalchemy import text
from sqlalchemy.ext.asyncio import AsyncEngine

from checkpointers import SqlCheckpointer
from langgraph_fence import (
    ExecutionContextUnavailableError,
    ExecutionFencedError,
    FencedCheckpointer,
    LeaseKey,
    MemoryLeaseRepository,
    SqlLeaseRepository,
)
from langgraph_fence.fence import RunHandle
from langgraph_fence.testing import ManualClock
from tests.support.databases import SQL_BACKENDS, pg_engine_options, unique

RUNS_ON = SQL_BACKENDS

TTL = 10.0


@pytest.fixture
async def saver(
    backend: str, make_engine: Callable[[str], AsyncEngine]
) -> AsyncIterator[SqlCheckpointer]:
    engine = make_engine(backend)
    saver = SqlCheckpointer(engine)
    await saver.setup()
    yield saver
    await engine.dispose()


async def count_rows(saver: SqlCheckpointer, thread_id: str) -> int:
    total = 0
    async with saver.engine.connect() as conn:
        for table in ("fence_checkpoints", "fence_checkpoint_blobs", "fence_checkpoint_writes"):
            result = await conn.execute(
                text(f"SELECT count(*) FROM {table} WHERE thread_id = :t"), {"t": thread_id}
            )
            total += int(result.scalar_one())
    return total


async def held(saver: SqlCheckpointer, thread_id: str) -> RunHandle:
    repo = SqlLeaseRepository(saver.engine)
    lease = await repo.acquire(LeaseKey("tenant", thread_id), "A", TTL)
    assert lease is not None
    return RunHandle(repo, lease, TTL)


def checkpoint_with_blob() -> Any:
    checkpoint = generate_checkpoint(channel_values={"big": {"k": [1, 2, 3]}})
    checkpoint["channel_versions"] = {"big": 1}
    return checkpoint


async def test_a_config_without_thread_id_is_refused(saver: SqlCheckpointer) -> None:
    for call in (
        saver.aput({"configurable": {}}, checkpoint_with_blob(), generate_metadata(), {"big": 1}),
        saver.aget_tuple({"configurable": {"checkpoint_ns": ""}}),
        saver.aput_writes({}, [("a", 1)], "task"),  # type: ignore[typeddict-item]
    ):
        with pytest.raises(ValueError, match=r'config\["configurable"\]\["thread_id"\]'):
            await call


async def test_a_nul_byte_in_the_namespace_is_refused(saver: SqlCheckpointer) -> None:
    thread = unique("thread")
    config: Any = {"configurable": {"thread_id": thread, "checkpoint_ns": "sub\x00graph"}}
    with pytest.raises(ValueError, match=r"checkpoint_ns.*NUL byte"):
        await saver.aput(config, checkpoint_with_blob(), generate_metadata(), {"big": 1})
    config["configurable"]["checkpoint_id"] = "x"
    with pytest.raises(ValueError, match=r"checkpoint_ns.*NUL byte"):
        await saver.aput_writes(config, [("a", 1)], "task")
    assert await count_rows(saver, thread) == 0


@pytest.mark.parametrize("wrapped", [False, True])
async def test_a_foreign_object_at_fence_is_refused(saver: SqlCheckpointer, wrapped: bool) -> None:
    thread = unique("thread")
    handle = await held(saver, thread)
    target = FencedCheckpointer(saver) if wrapped else saver
    for foreign in (handle.lease, handle.token, object()):
        config: Any = {
            "configurable": {"thread_id": thread, "checkpoint_ns": "", "__fence": foreign}
        }
        with pytest.raises(ValueError, match=r'\["__fence"\] must be the RunHandle'):
            await target.aput(config, checkpoint_with_blob(), generate_metadata(), {"big": 1})
    assert await count_rows(saver, thread) == 0


async def test_a_handle_it_cannot_guard_is_refused_not_ignored(saver: SqlCheckpointer) -> None:
    """The saver never pretends: a lease from another store is refused, and the wrapper is
    the way to use it (it checks the token before delegating)."""
    thread = unique("thread")
    repo = MemoryLeaseRepository(clock=ManualClock())
    lease = await repo.acquire(LeaseKey("tenant", thread), "A", TTL)
    assert lease is not None
    handle = RunHandle(repo, lease, TTL)
    assert not saver.guards(handle)
    config: Any = {"configurable": {"thread_id": thread, "checkpoint_ns": "", "__fence": handle}}
    with pytest.raises(ValueError, match="FencedCheckpointer"):
        await saver.aput(config, checkpoint_with_blob(), generate_metadata(), {"big": 1})
    assert await count_rows(saver, thread) == 0
    stored = await FencedCheckpointer(saver).aput(
        config, checkpoint_with_blob(), generate_metadata(), {"big": 1}
    )
    assert stored["configurable"]["thread_id"] == thread
    assert saver.guards(await held(saver, unique("thread")))


async def test_require_fence_refuses_writes_without_a_handle(saver: SqlCheckpointer) -> None:
    thread = unique("thread")
    strict = FencedCheckpointer(saver, require_fence=True)
    config: Any = {"configurable": {"thread_id": thread, "checkpoint_ns": ""}}
    with pytest.raises(ExecutionContextUnavailableError, match="require_fence"):
        await strict.aput(config, checkpoint_with_blob(), generate_metadata(), {"big": 1})
    config["configurable"]["checkpoint_id"] = "x"
    with pytest.raises(ExecutionContextUnavailableError):
        await strict.aput_writes(config, [("a", 1)], "task")
    assert await count_rows(saver, thread) == 0
    assert await strict.aget_tuple(config) is None, "reads need no handle"


async def test_a_closed_saver_is_refused(
    request: pytest.FixtureRequest, tmp_path: Path, saver: SqlCheckpointer
) -> None:
    if saver.engine.dialect.name == "sqlite":
        url, options = f"sqlite+aiosqlite:///{tmp_path / 'closed.db'}", {}
    else:
        pg_url, schema = request.getfixturevalue("pg_schema")
        url, options = pg_url, pg_engine_options(schema)
    async with SqlCheckpointer.from_conn_string(url, **options) as opened:
        config: Any = {"configurable": {"thread_id": unique("thread"), "checkpoint_ns": ""}}
        await opened.aput(config, checkpoint_with_blob(), generate_metadata(), {"big": 1})
    with pytest.raises(RuntimeError, match=r"closed.*from_conn_string"):
        await opened.aget_tuple(config)
    with pytest.raises(RuntimeError, match="closed"):
        await opened.aput(config, checkpoint_with_blob(), generate_metadata(), {"big": 1})


async def test_a_saver_whose_engine_was_disposed_is_refused(
    make_engine: Callable[[str], AsyncEngine],
) -> None:
    engine = make_engine("sqlite")
    saver = SqlCheckpointer(engine)
    await saver.setup()
    thread = unique("thread")
    config: Any = {"configurable": {"thread_id": thread, "checkpoint_ns": ""}}
    await saver.aput(config, checkpoint_with_blob(), generate_metadata(), {"big": 1})
    await engine.dispose()
    with pytest.raises(RuntimeError, match=r"engine was disposed.*new SqlCheckpointer"):
        await saver.aput(config, checkpoint_with_blob(), generate_metadata(), {"big": 1})
    with pytest.raises(RuntimeError, match="disposed"):
        await saver.aget_tuple(config)
    with pytest.raises(RuntimeError, match="disposed"):
        await asyncio.to_thread(saver.get_tuple, config)
    async with engine.connect() as conn:
        count = await conn.execute(
            text("SELECT count(*) FROM fence_checkpoints WHERE thread_id = :t"), {"t": thread}
        )
        assert count.scalar_one() == 1, "the refused write left a row"
    await engine.dispose()


async def test_a_saver_not_set_up_says_so(make_engine: Callable[[str], AsyncEngine]) -> None:
    fresh = SqlCheckpointer(make_engine("sqlite"))
    with pytest.raises(RuntimeError, match=r"await saver\.setup\(\)"):
        await fresh.aget_tuple({"configurable": {"thread_id": "t"}})
    with pytest.raises(ValueError, match="AsyncEngine"):
        SqlCheckpointer("sqlite:///x.db")  # type: ignore[arg-type]


class State(TypedDict):
    log: Annotated[list[str], operator.add]


def sync_graph(checkpointer: Any) -> Any:
    builder = StateGraph(State)
    builder.add_node("x", lambda state: {"log": ["x"]})
    builder.add_node("y", lambda state: {"log": ["y"]})
    builder.add_edge(START, "x")
    builder.add_edge("x", "y")
    builder.add_edge("y", END)
    return builder.compile(checkpointer=checkpointer)


async def test_sync_invoke_runs_fenced_from_a_worker_thread(saver: SqlCheckpointer) -> None:
    thread = unique("thread")
    handle = await held(saver, thread)
    graph = sync_graph(FencedCheckpointer(saver))
    config: Any = {"configurable": {"thread_id": thread, "__fence": handle}}
    assert await asyncio.to_thread(graph.invoke, {"log": []}, config) == {"log": ["x", "y"]}
    async with saver.engine.connect() as conn:
        tokens = (
            await conn.execute(
                text("SELECT DISTINCT fence_token FROM fence_checkpoints WHERE thread_id = :t"),
                {"t": thread},
            )
        ).scalars()
        assert list(tokens) == [handle.token]
    history = await asyncio.to_thread(lambda: list(graph.get_state_history(config)))
    assert len(history) == 4  # input, x, y, end

    # A stale handle is refused on the sync path too.
    repo = handle.repository
    assert isinstance(repo, SqlLeaseRepository)
    await repo.release(handle.lease, "pending")  # type: ignore[arg-type]
    await repo.acquire(handle.key, "B", TTL)
    with pytest.raises(ExecutionFencedError):
        await asyncio.to_thread(graph.invoke, {"log": []}, config)


async def test_sync_methods_refuse_the_loops_own_thread(saver: SqlCheckpointer) -> None:
    thread = unique("thread")
    config: Any = {"configurable": {"thread_id": thread, "checkpoint_ns": ""}}
    with pytest.raises(asyncio.InvalidStateError, match="other than its event loop"):
        saver.get_tuple(config)
    with pytest.raises(asyncio.InvalidStateError, match="other than its event loop"):
        saver.put(config, checkpoint_with_blob(), generate_metadata(), {"big": 1})
    config["configurable"]["__fence"] = await held(saver, thread)
    with pytest.raises(asyncio.InvalidStateError, match="other than its event loop"):
        FencedCheckpointer(saver).put(config, checkpoint_with_blob(), generate_metadata(), {})
    assert await count_rows(saver, thread) == 0


async def test_wrapper_over_a_sync_saver_passes_writes_through() -> None:
    inner = InMemorySaver()
    wrapper = FencedCheckpointer(inner)
    graph = sync_graph(wrapper)
    config: Any = {"configurable": {"thread_id": unique("thread")}}
    assert await asyncio.to_thread(graph.invoke, {"log": []}, config) == {"log": ["x", "y"]}
    assert inner.get_tuple(config) is not None


class Count(TypedDict):
    n: int


def _server_config(thread: str, attempt: int) -> dict[str, Any]:
    """What LangGraph's Agent Server puts in a run's config (langgraph-api 0.16.7, as seen
    under ``langgraph dev``): the run and its assistant under ``configurable``, the attempt
    and the server's version under ``metadata``."""
    return {
        "configurable": {
            "thread_id": thread,
            "run_id": f"run-{thread}",
            "assistant_id": "assistant",
            "graph_id": "agent",
        },
        "metadata": {"run_attempt": attempt, "langgraph_api_version": "0.16.7"},
    }


async def test_a_run_of_the_agent_server_is_told_loudly_that_it_is_not_fenced(
    saver: SqlCheckpointer, caplog: pytest.LogCaptureFixture
) -> None:
    """Fencing runs of the Agent Server is not built yet (issue 35): a bare SqlCheckpointer
    mounted there stores their checkpoints unfenced. It says so, once per saver, at its
    first write of a server run, never silently; a run of your own says nothing. Driven at
    the saver boundary with the config langgraph-api passes, not through the server."""

    async def add(state: Count) -> dict[str, int]:
        return {"n": state["n"] + 1}

    builder = StateGraph(Count)
    builder.add_node("add", add)
    builder.add_edge(START, "add")
    builder.add_edge("add", END)
    graph = builder.compile(checkpointer=saver)
    with caplog.at_level("WARNING", logger="langgraph_fence.checkpointers"):
        await graph.ainvoke({"n": 0}, {"configurable": {"thread_id": unique("own")}})
        assert [r for r in caplog.records if "NOT fenced" in r.getMessage()] == []
        thread = unique("server")
        assert await graph.ainvoke({"n": 0}, _server_config(thread, 1)) == {"n": 1}
        await graph.ainvoke({"n": 0}, _server_config(thread, 2))
    told = [r.getMessage() for r in caplog.records if "NOT fenced" in r.getMessage()]
    assert len(told) == 1
    assert "Agent Server (run_attempt 1)" in told[0]
    assert "docs/agent-server.md" in told[0]

"""The Agent Server's own features on fenced runs, through the real ``langgraph dev`` and
``langgraph_sdk``, on SQLite and PostgreSQL: a streamed run, a cancel, each multitask
strategy of a second run sent while the first is in flight, a fork from an earlier
checkpoint. A step of the first run waits on a gate file the test opens when it has
sent what it sends meanwhile."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Iterator
from pathlib import Path
from typing import Any, TypeVar

import pytest
from langgraph_sdk import get_client
from langgraph_sdk.errors import ConflictError

from tests.support.agent_server import agent_server, rows
from tests.support.polling import eventually
from tests.support.write_steps import Database

pytestmark = pytest.mark.processes

T = TypeVar("T")

AGENT = """
import asyncio
from pathlib import Path
from typing import Annotated, TypedDict
import operator

from langgraph.graph import END, START, StateGraph

from langgraph_fence import fence_graph, get_execution_context


class State(TypedDict, total=False):
    gate: str
    seen: Annotated[list[str], operator.add]
    tokens: Annotated[list[int], operator.add]


async def first(state: State) -> dict:
    return {"seen": ["first"], "tokens": [get_execution_context().fence.token]}


async def wait(state: State) -> dict:
    if state.get("gate"):
        gate = Path(state["gate"])
        (gate.parent / (gate.name + ".entered")).touch()
        while not gate.exists():
            await asyncio.sleep(0.05)
    return {"seen": ["wait"], "tokens": [get_execution_context().fence.token]}


builder = StateGraph(State)
builder.add_node("first", first)
builder.add_node("wait", wait)
builder.add_edge(START, "first")
builder.add_edge("first", "wait")
builder.add_edge("wait", END)
graph = fence_graph(builder).compile()
"""


@pytest.fixture
def server(database: Database, tmp_path: Path) -> Iterator[str]:
    with agent_server(database, tmp_path, {"agent.py": AGENT}, {"agent": "./agent.py:graph"}) as (
        url,
        _,
    ):
        yield url


async def bounded(call: Awaitable[T]) -> T:
    """``call``, failing the test after 120 s instead of hanging the suite."""
    return await asyncio.wait_for(call, 120)


async def _in_flight(client: Any, thread: str, gate: Path) -> dict[str, Any]:
    """A run of the thread started and waiting in its step on ``gate``."""
    run = await client.runs.create(thread, "agent", input={"gate": str(gate)})
    entered = gate.parent / (gate.name + ".entered")
    await eventually(entered.exists, what="the run to wait in its step")
    return dict(run)


async def test_a_streamed_run_streams_its_values_under_its_token(server: str) -> None:
    client = get_client(url=server)
    thread = (await client.threads.create())["thread_id"]
    chunks = [
        chunk async for chunk in client.runs.stream(thread, "agent", input={}, stream_mode="values")
    ]
    values = [c.data for c in chunks if c.event == "values"]
    assert values[-1]["seen"] == ["first", "wait"]
    assert values[-1]["tokens"] == [1, 1]


async def test_a_cancelled_run_gives_the_thread_back_and_the_next_run_takes_it(
    server: str, database: Database, tmp_path: Path
) -> None:
    client = get_client(url=server)
    thread = (await client.threads.create())["thread_id"]
    run = await _in_flight(client, thread, tmp_path / "gate")
    await bounded(client.runs.cancel(thread, run["run_id"], wait=True))
    assert (await client.runs.get(thread, run["run_id"]))["status"] == "interrupted"
    await eventually(
        lambda: (
            rows(database, "SELECT holder FROM fence_leases WHERE execution_id = :t", t=thread)
            == [(None,)]
        ),
        what="the cancelled run's lease to be given back",
    )
    (tmp_path / "gate").touch()  # the thread's state keeps the gate: the next run passes it
    done = await bounded(client.runs.wait(thread, "agent", input={}))
    assert done["seen"] == ["first", "first", "wait"]  # the cancelled run never left "wait"
    assert done["tokens"] == [1, 2, 2]


@pytest.mark.parametrize("strategy", ["reject", "enqueue", "interrupt", "rollback"])
async def test_each_multitask_strategy_keeps_one_run_on_the_thread_at_a_time(
    server: str, database: Database, tmp_path: Path, strategy: str
) -> None:
    client = get_client(url=server)
    thread = (await client.threads.create())["thread_id"]
    gate = tmp_path / "gate"
    first = await _in_flight(client, thread, gate)
    if strategy == "reject":
        with pytest.raises(ConflictError):
            await client.runs.create(thread, "agent", input={}, multitask_strategy="reject")
        gate.touch()
        await bounded(client.runs.join(thread, first["run_id"]))
        assert (await client.runs.get(thread, first["run_id"]))["status"] == "success"
        return
    second = await client.runs.create(thread, "agent", input={}, multitask_strategy=strategy)
    gate.touch()
    await bounded(client.runs.join(thread, second["run_id"]))
    assert (await client.runs.get(thread, second["run_id"]))["status"] == "success"
    state = (await client.threads.get_state(thread))["values"]
    expected_first = {
        "enqueue": "success",
        "interrupt": "interrupted",
        "rollback": None,  # rolled back: the run is deleted
    }[strategy]
    if expected_first is None:
        with pytest.raises(Exception, match=r"404|not found|Not Found"):
            await client.runs.get(thread, first["run_id"])
        assert state["seen"] == ["first", "wait"]  # the rolled-back run left nothing
    else:
        assert (await client.runs.get(thread, first["run_id"]))["status"] == expected_first
    # Every checkpoint of the thread was written under a token the lease gave out.
    tokens = rows(
        database, "SELECT fence_token FROM fence_checkpoints WHERE thread_id = :t", t=thread
    )
    assert tokens
    assert all(token is not None for (token,) in tokens)


async def test_a_fork_from_an_earlier_checkpoint_runs_under_the_next_token(
    server: str, database: Database
) -> None:
    client = get_client(url=server)
    thread = (await client.threads.create())["thread_id"]
    await bounded(client.runs.wait(thread, "agent", input={}))
    history = await client.threads.get_history(thread)
    after_first = next(h for h in history if h["next"] == ["wait"])
    forked = await bounded(
        client.runs.wait(thread, "agent", input=None, checkpoint_id=after_first["checkpoint_id"])
    )
    assert forked["seen"] == ["first", "wait"]  # replayed from after "first"
    assert forked["tokens"] == [1, 2]  # the fork's step ran under the next token
    leases = rows(
        database, "SELECT epoch, status FROM fence_leases WHERE execution_id = :t", t=thread
    )
    assert leases == [(2, "done")]


async def test_a_thread_copied_then_deleted_and_pruned_through_the_api(
    server: str, database: Database
) -> None:
    client = get_client(url=server)
    thread = (await client.threads.create())["thread_id"]
    await bounded(client.runs.wait(thread, "agent", input={}))
    copy = (await client.threads.copy(thread))["thread_id"]
    assert (await client.threads.get_state(copy))["values"]["seen"] == ["first", "wait"]
    # The copy is a thread of its own: its next run takes a lease of its own.
    again = await bounded(client.runs.wait(copy, "agent", input={}))
    assert again["seen"] == ["first", "wait", "first", "wait"]
    assert again["tokens"] == [1, 1, 1, 1]
    await client.threads.delete(thread)
    count = "SELECT count(*) FROM fence_checkpoints WHERE thread_id = :t"
    assert rows(database, count, t=thread) == [(0,)]  # erased under the thread's lease
    assert rows(database, count, t=copy)[0][0] > 0  # the copy keeps its own
    # Pruned (the in-memory runtime prunes by deleting; it refuses keep_latest itself).
    assert (await client.threads.prune([copy], strategy="delete"))["pruned_count"] == 1
    assert rows(database, count, t=copy) == [(0,)]

"""Runs under a lease through Instance, on real SQLite and PostgreSQL."""

from __future__ import annotations

import asyncio
import operator
from collections.abc import AsyncIterator, Callable
from typing import Annotated, Any, TypedDict

import pytest
from langgraph.checkpoint.memory import InMemorySaver
from langgraph.graph import END, START, StateGraph
from langgraph.types import Send
from sqlalchemy import text
from sqlalchemy.ext.asyncio import AsyncEngine

from checkpointers import SqlCheckpointer
from langgraph_fence import (
    ExecutionFencedError,
    ExecutionLeaseHeldError,
    LeaseKey,
    LeaseStatus,
    SqlLeaseRepository,
    fence_graph,
)
from langgraph_fence.instance import Instance
from langgraph_fence.lease.records import SqlExecutionRecords
from langgraph_fence.steps.context import get_execution_context
from tests.support.databases import SQL_BACKENDS, setup_all, unique

RUNS_ON = SQL_BACKENDS


class State(TypedDict, total=False):
    items: list[str]
    log: Annotated[list[str], operator.add]


class Item(TypedDict):
    item: str


@pytest.fixture
async def instance(
    backend: str, make_engine: Callable[[str], AsyncEngine]
) -> AsyncIterator[Instance]:
    engine = make_engine(backend)
    await setup_all(engine)
    repository = SqlLeaseRepository(engine)
    saver = SqlCheckpointer(engine)
    await saver.setup()  # on this loop
    records = SqlExecutionRecords(engine)
    inst = Instance(repository, saver, instance_id=unique("inst"), lease_ttl=10.0, records=records)
    yield inst
    await inst.aclose()
    await engine.dispose()


def _graph(instance: Instance, seen: list[tuple[str, int, str, str]]) -> Any:
    def note(node: str) -> None:
        frame = get_execution_context()
        frame.fence.assert_held()
        seen.append((node, frame.fence.token, frame.fence.scope_key, frame.checkpoint_ns))

    async def inner(state: State) -> dict[str, Any]:
        note("inner")
        return {"log": ["inner"]}

    sub = StateGraph(State)
    sub.add_node("inner", inner)
    sub.add_edge(START, "inner")
    sub.add_edge("inner", END)
    subgraph = fence_graph(sub).compile()

    async def plan(state: State) -> dict[str, Any]:
        note("plan")
        return {"log": ["plan"]}

    def fan_out(state: State) -> list[Send]:
        return [Send("work", {"item": item}) for item in state["items"]]

    def work(state: Item) -> dict[str, Any]:  # a sync node, run in a worker thread
        note("work")
        return {"log": [f"work:{state['item']}"]}

    async def nested(state: State) -> dict[str, Any]:
        note("nested")
        out = await subgraph.ainvoke(state)
        return {"log": [line for line in out["log"] if line == "inner"]}

    builder = StateGraph(State)
    builder.add_node("plan", plan)
    builder.add_node("work", work)
    builder.add_node("nested", nested)
    builder.add_node("sub", subgraph)
    builder.add_edge(START, "plan")
    builder.add_conditional_edges("plan", fan_out, ["work"])
    builder.add_edge("work", "nested")
    builder.add_edge("nested", "sub")
    builder.add_edge("sub", END)
    return fence_graph(builder).compile(checkpointer=instance.checkpointer, name="graph")


async def _tokens(instance: Instance, thread_id: str) -> set[Any]:
    engine = instance.repository.engine  # type: ignore[attr-defined]
    async with engine.connect() as conn:
        rows = await conn.execute(
            text(
                "SELECT fence_token FROM fence_checkpoints WHERE thread_id = :t "
                "UNION SELECT fence_token FROM fence_checkpoint_writes WHERE thread_id = :t"
            ),
            {"t": thread_id},
        )
        return {row[0] for row in rows}


async def test_every_step_and_checkpoint_runs_under_the_runs_token(instance: Instance) -> None:
    seen: list[tuple[str, int, str, str]] = []
    graph = _graph(instance, seen)
    thread = unique("thread")
    config = {"configurable": {"thread_id": thread}}
    out = await instance.ainvoke(
        graph, {"items": ["a", "b", "c"], "log": []}, config, tenant_id="acme"
    )
    assert set(out["log"]) == {"plan", "work:a", "work:b", "work:c", "inner"}
    assert sorted(n for n, *_ in seen) == ["inner", "inner", "nested", "plan"] + ["work"] * 3
    assert {token for _, token, _, _ in seen} == {1}
    assert {scope for _, _, scope, _ in seen} == {f"acme:{thread}"}
    # Subgraph steps (ParentInstance children) ran in namespaces of their own, same token.
    assert any(ns for node, _, _, ns in seen if node == "inner")
    assert await _tokens(instance, thread) == {1}
    lease = await instance.repository.get(LeaseKey("acme", thread))
    assert lease is not None
    assert lease.status is LeaseStatus.DONE
    assert lease.holder is None

    # A new turn on the finished thread is a new run: token 2, on every step and row.
    seen.clear()
    await instance.ainvoke(graph, {"items": ["d"], "log": []}, config, tenant_id="acme")
    assert {token for _, token, _, _ in seen} == {2}
    assert await _tokens(instance, thread) == {1, 2}


async def test_resuming_with_none_after_the_run_ended_is_a_new_run(instance: Instance) -> None:
    # As in LangGraph: None on a finished thread resumes it (here with nothing left to run).
    graph = _graph(instance, [])
    thread = unique("thread")
    config = {"configurable": {"thread_id": thread}}
    await instance.ainvoke(graph, {"items": [], "log": []}, config, tenant_id="acme")
    await instance.ainvoke(graph, None, config, tenant_id="acme")
    lease = await instance.repository.get(LeaseKey("acme", thread))
    assert lease is not None
    assert lease.status is LeaseStatus.DONE
    assert lease.epoch == 2


async def test_a_lease_held_by_a_live_instance_is_refused_naming_the_holder(
    instance: Instance,
) -> None:
    graph = _graph(instance, [])
    thread = unique("thread")
    other = await instance.repository.acquire(LeaseKey("acme", thread), "other-instance", 60.0)
    assert other is not None
    with pytest.raises(ExecutionLeaseHeldError, match="'other-instance' at token 1"):
        await instance.ainvoke(
            graph,
            {"items": [], "log": []},
            {"configurable": {"thread_id": thread}},
            tenant_id="acme",
        )


async def test_bad_input_is_refused_before_anything_runs(instance: Instance) -> None:
    graph = _graph(instance, [])
    thread = unique("thread")
    good = {"configurable": {"thread_id": thread}}
    cases: list[tuple[dict[str, Any], str]] = [
        ({"config": good, "tenant_id": ""}, "tenant_id"),
        ({"config": good, "tenant_id": None}, "tenant_id"),
        ({"config": {"configurable": {}}, "tenant_id": "t"}, "thread_id"),
        (
            {
                "config": {"configurable": {"thread_id": thread, "__fence": object()}},
                "tenant_id": "t",
            },
            "__fence",
        ),
    ]
    for kwargs, named in cases:
        with pytest.raises(ValueError, match=named):
            await instance.ainvoke(graph, {"items": [], "log": []}, **kwargs)
    unfenced = StateGraph(State)
    unfenced.add_node("n", lambda s: {})
    unfenced.add_edge(START, "n")
    plain = unfenced.compile(checkpointer=InMemorySaver())
    with pytest.raises(ValueError, match=r"instance\.checkpointer"):
        await instance.ainvoke(plain, {"items": []}, good, tenant_id="t")
    assert await instance.repository.get(LeaseKey("t", thread)) is None


def test_bad_options_are_refused_naming_them() -> None:
    from langgraph_fence import MemoryLeaseRepository

    store, saver = MemoryLeaseRepository(), InMemorySaver()
    with pytest.raises(ValueError, match="lease_ttl"):
        Instance(store, saver, lease_ttl=0)
    with pytest.raises(ValueError, match="lease_ttl"):
        Instance(store, saver, lease_ttl=-1)
    with pytest.raises(ValueError, match="renew_interval"):
        Instance(store, saver, lease_ttl=10, renew_interval=10)
    with pytest.raises(ValueError, match="renew_interval"):
        Instance(store, saver, lease_ttl=10, renew_interval=0)
    with pytest.raises(ValueError, match="repository"):
        Instance(object(), saver)  # type: ignore[arg-type]


async def test_an_interrupted_run_releases_its_lease_as_waiting(instance: Instance) -> None:
    from langgraph.types import Command, interrupt

    async def ask(state: State) -> dict[str, Any]:
        answer = interrupt("approve?")
        return {"log": [f"answer:{answer}"]}

    builder = StateGraph(State)
    builder.add_node("ask", ask)
    builder.add_edge(START, "ask")
    builder.add_edge("ask", END)
    graph = fence_graph(builder).compile(checkpointer=instance.checkpointer, name="graph")
    thread = unique("thread")
    config = {"configurable": {"thread_id": thread}}
    await instance.ainvoke(graph, {"log": []}, config, tenant_id="acme")
    lease = await instance.repository.get(LeaseKey("acme", thread))
    assert lease is not None
    assert lease.status is LeaseStatus.WAITING
    assert lease.epoch == 1
    out = await instance.ainvoke(graph, Command(resume="yes"), config, tenant_id="acme")
    assert out["log"] == ["answer:yes"]
    lease = await instance.repository.get(LeaseKey("acme", thread))
    assert lease is not None
    assert lease.status is LeaseStatus.DONE
    assert lease.epoch == 2


async def test_a_failing_run_is_released_failed_with_its_reason(instance: Instance) -> None:
    async def boom(state: State) -> dict[str, Any]:
        raise ValueError("no such customer")

    builder = StateGraph(State)
    builder.add_node("boom", boom)
    builder.add_edge(START, "boom")
    builder.add_edge("boom", END)
    graph = fence_graph(builder).compile(checkpointer=instance.checkpointer, name="graph")
    thread = unique("thread")
    with pytest.raises(ValueError, match="no such customer"):
        await instance.ainvoke(
            graph, {"log": []}, {"configurable": {"thread_id": thread}}, tenant_id="acme"
        )
    lease = await instance.repository.get(LeaseKey("acme", thread))
    assert lease is not None
    assert lease.status is LeaseStatus.FAILED
    assert lease.reason == "ValueError: no such customer"


async def test_astream_runs_under_the_lease_too(instance: Instance) -> None:
    seen: list[tuple[str, int, str, str]] = []
    graph = _graph(instance, seen)
    thread = unique("thread")
    chunks = [
        chunk
        async for chunk in instance.astream(
            graph,
            {"items": ["x"], "log": []},
            {"configurable": {"thread_id": thread}},
            tenant_id="acme",
            stream_mode="updates",
        )
    ]
    assert {next(iter(c)) for c in chunks} >= {"plan", "work", "nested", "sub"}
    assert {token for _, token, _, _ in seen} == {1}
    lease = await instance.repository.get(LeaseKey("acme", thread))
    assert lease is not None
    assert lease.status is LeaseStatus.DONE


async def test_a_renewal_refused_mid_run_stops_it_with_the_fencing_error(
    instance: Instance,
) -> None:
    entered, taken = asyncio.Event(), asyncio.Event()

    async def slow(state: State) -> dict[str, Any]:
        entered.set()
        await taken.wait()
        await get_execution_context().fence.confirm_now()
        return {"log": ["never"]}

    builder = StateGraph(State)
    builder.add_node("slow", slow)
    builder.add_edge(START, "slow")
    builder.add_edge("slow", END)
    graph = fence_graph(builder).compile(checkpointer=instance.checkpointer, name="graph")
    thread = unique("thread")
    run = asyncio.create_task(
        instance.ainvoke(
            graph, {"log": []}, {"configurable": {"thread_id": thread}}, tenant_id="acme"
        )
    )
    await asyncio.wait_for(entered.wait(), 10)
    # Another worker takes the execution over (its store said the lease expired).
    key = LeaseKey("acme", thread)
    repo = instance.repository
    engine = repo.engine  # type: ignore[attr-defined]
    async with engine.begin() as conn:
        await conn.execute(
            text("UPDATE fence_leases SET expires_at = 0 WHERE scope_key = :s"),
            {"s": key.scope_key},
        )
    other = await repo.acquire(key, "other", 60.0)
    assert other is not None
    assert other.epoch == 2
    taken.set()
    with pytest.raises(ExecutionFencedError) as info:
        await asyncio.wait_for(run, 10)
    assert info.value.token_held == 1
    assert info.value.token_seen == 2
    assert await _tokens(instance, thread) <= {1, None}


async def test_a_refused_start_leaves_the_record_of_the_run_in_flight(instance: Instance) -> None:
    from langgraph_fence.lease.records import ExecutionRecord

    graph = _graph(instance, [])
    thread = unique("thread")
    key = LeaseKey("acme", thread)
    original = ExecutionRecord(key, "orders", thread, {"items": ["a"], "log": []})
    await instance.records.record(original)
    assert await instance.repository.acquire(key, "other-instance", 60.0) is not None
    with pytest.raises(ExecutionLeaseHeldError):
        await instance.ainvoke(
            graph,
            {"items": ["b"], "log": []},
            {"configurable": {"thread_id": thread}},
            tenant_id="acme",
            graph_name="refunds",
        )
    assert await instance.records.get(key) == original


async def test_an_interrupt_under_a_body_wide_non_idempotent_stamp_pauses_and_resumes(
    instance: Instance,
) -> None:
    from langgraph.types import Command, interrupt

    from langgraph_fence import Effect

    charged: list[str] = []

    async def approve_and_charge(state: State) -> dict[str, Any]:
        answer = interrupt("charge the card?")  # the step re-runs from the top on resume
        charged.append(answer)
        return {"log": ["charged"]}

    builder = StateGraph(State)
    builder.add_node("charge", approve_and_charge)
    builder.add_edge(START, "charge")
    builder.add_edge("charge", END)
    graph = fence_graph(builder, effects={"charge": Effect.NON_IDEMPOTENT_WRITE}).compile(
        checkpointer=instance.checkpointer, name="graph"
    )
    thread = unique("thread")
    config = {"configurable": {"thread_id": thread}}
    # LangGraph runs the step again from its start on resume, so its write comes after the
    # interrupt(): the stamp made before the body is released at the pause, and taken anew.
    await instance.ainvoke(graph, {"log": []}, config, tenant_id="acme")
    paused = await instance.repository.get(LeaseKey("acme", thread))
    assert paused is not None
    assert paused.status is LeaseStatus.WAITING
    assert paused.pending_effects == ()
    assert charged == []
    await instance.ainvoke(graph, Command(resume="yes"), config, tenant_id="acme")
    assert charged == ["yes"]
    lease = await instance.repository.get(LeaseKey("acme", thread))
    assert lease is not None
    assert lease.status is LeaseStatus.DONE

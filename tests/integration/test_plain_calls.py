"""The LangGraph way: a graph compiled with ``instance.checkpointer`` runs fenced when called
as LangGraph graphs are called (issue 12), on SQLite and PostgreSQL.

Each test calls only LangGraph's own methods (``graph.ainvoke``, ``astream``,
``astream_events``, ``abatch``, ``aupdate_state``, ``invoke``, ``stream``,
``update_state``) and checks what a user relies on: the node sees its token, the lease
moved (one epoch per call) and ended ``done``, a second live instance is refused.
"""

from __future__ import annotations

import asyncio
import operator
import uuid
from collections.abc import AsyncIterator
from typing import Annotated, Any, TypedDict

import pytest
from langchain_core.runnables import RunnableConfig
from langgraph.graph import END, START, StateGraph

from langgraph_fence import (
    ExecutionContextUnavailableError,
    ExecutionLeaseHeldError,
    Instance,
    LeaseKey,
    LeaseStatus,
    fence_graph,
    get_execution_context,
)
from tests.support.databases import Database, pg_engine_options


class State(TypedDict, total=False):
    n: int
    tokens: Annotated[list[int], operator.add]
    inner: int


class Inner(TypedDict, total=False):
    n: int
    inner: int


def engine_options(database: Database) -> dict[str, Any]:
    return pg_engine_options(database.schema) if database.schema else {}


async def step(state: State) -> State:
    return {"n": state.get("n", 0) + 1, "tokens": [get_execution_context().fence.token]}


async def inner_step(state: Inner) -> Inner:
    return {"inner": get_execution_context().fence.token}


def inner_graph() -> Any:
    """A fenced subgraph (compiled without a checkpointer: it runs under its parent's)."""
    builder = StateGraph(Inner)
    builder.add_node("inner", inner_step)
    builder.add_edge(START, "inner")
    builder.add_edge("inner", END)
    return fence_graph(builder).compile()


def order_graph(instance: Instance, name: str = "orders") -> Any:
    builder = StateGraph(State)
    builder.add_node("first", step)
    builder.add_node("sub", inner_graph())
    builder.add_edge(START, "first")
    builder.add_edge("first", "sub")
    builder.add_edge("sub", END)
    return fence_graph(builder).compile(checkpointer=instance.checkpointer, name=name)


@pytest.fixture
async def instance(database: Database) -> AsyncIterator[Instance]:
    async with Instance.open(database.url, engine_options=engine_options(database)) as opened:
        yield opened


def thread() -> RunnableConfig:
    return {"configurable": {"thread_id": f"plain-{uuid.uuid4().hex}"}}


async def lease_of(instance: Instance, config: RunnableConfig, tenant: str = "default") -> Any:
    return await instance.repository.get(LeaseKey(tenant, config["configurable"]["thread_id"]))


async def test_ainvoke_astream_and_events_run_under_the_lease(instance: Instance) -> None:
    graph = order_graph(instance)
    config = thread()

    result = await graph.ainvoke({"n": 0}, config)
    # Both steps (the subgraph's too: no second acquire) saw the run's token.
    assert result == {"n": 1, "tokens": [1], "inner": 1}
    lease = await lease_of(instance, config)
    assert lease.epoch == 1
    assert lease.status is LeaseStatus.DONE
    assert lease.holder is None

    chunks = [
        chunk
        async for chunk in graph.astream(
            {"n": 0}, config, stream_mode=["updates", "values"], subgraphs=True
        )
    ]
    # The subgraph's own step streams under its namespace, at the run's token (2).
    inner = [c for c in chunks if c[0] and c[1] == "updates"]
    assert inner
    assert inner[0][2]["inner"] == {"inner": 2}
    assert chunks[-1] == ((), "values", {"n": 1, "tokens": [1, 2], "inner": 2})

    events = [e async for e in graph.astream_events({"n": 0}, config, version="v2")]
    assert events[-1]["event"] == "on_chain_end"
    assert events[-1]["data"]["output"]["inner"] == 3

    lease = await lease_of(instance, config)
    assert lease.epoch == 3
    assert lease.status is LeaseStatus.DONE
    state = await graph.aget_state(config)  # a plain read finds the default tenant's thread
    assert state.values["tokens"] == [1, 2, 3]


async def test_with_config_abatch_and_tenants(instance: Instance) -> None:
    graph = order_graph(instance)
    config = thread()
    bound = graph.with_config(config)
    assert (await bound.ainvoke({"n": 0}))["tokens"] == [1]

    others = [thread(), thread()]
    results = await graph.abatch([{"n": 0}, {"n": 0}], others)
    assert [r["tokens"] for r in results] == [[1], [1]]

    # configurable["tenant_id"] names the tenant; another tenant's thread is another.
    acme: RunnableConfig = {"configurable": {**config["configurable"], "tenant_id": "acme"}}
    assert (await graph.ainvoke({"n": 0}, acme))["tokens"] == [1]
    assert (await lease_of(instance, config, "acme")).epoch == 1
    assert (await lease_of(instance, config)).epoch == 1


async def test_aupdate_state_takes_the_lease(instance: Instance) -> None:
    graph = order_graph(instance)
    config = thread()
    await graph.ainvoke({"n": 0}, config)

    updated = await graph.aupdate_state(config, {"n": 10})
    assert "__fence" not in updated["configurable"]
    lease = await lease_of(instance, config)
    assert lease.epoch == 2
    assert lease.status is LeaseStatus.DONE
    assert (await graph.aget_state(config)).values["n"] == 10


async def test_a_second_instance_on_the_same_thread_is_refused(database: Database) -> None:
    inside, go = asyncio.Event(), asyncio.Event()

    async def wait(state: State) -> State:
        inside.set()
        await go.wait()
        return {"tokens": [get_execution_context().fence.token]}

    def graph_of(instance: Instance) -> Any:
        builder = StateGraph(State)
        builder.add_node("wait", wait)
        builder.add_edge(START, "wait")
        return fence_graph(builder).compile(checkpointer=instance.checkpointer, name="waits")

    options = engine_options(database)
    async with (
        Instance.open(database.url, engine_options=options, instance_id="A") as a,
        Instance.open(database.url, engine_options=options, instance_id="B") as b,
    ):
        config = thread()
        running = asyncio.create_task(graph_of(a).ainvoke({"n": 0}, config))
        await asyncio.wait_for(inside.wait(), 10)
        with pytest.raises(ExecutionLeaseHeldError, match="'A'"):
            await graph_of(b).ainvoke({"n": 0}, config)
        with pytest.raises(ExecutionLeaseHeldError):
            await graph_of(b).aupdate_state(config, {"n": 5})
        go.set()
        assert (await asyncio.wait_for(running, 10))["tokens"] == [1]
        lease = await lease_of(a, config)
        assert lease.epoch == 1
        assert lease.status is LeaseStatus.DONE


async def test_a_write_outside_any_run_is_refused_naming_the_fix(instance: Instance) -> None:
    graph = order_graph(instance)
    config = thread()
    await graph.ainvoke({"n": 0}, config)
    latest = await instance.checkpointer.aget_tuple(config)
    assert latest is not None
    with pytest.raises(ExecutionContextUnavailableError, match=r"graph\.ainvoke"):
        await instance.checkpointer.aput(latest.config, latest.checkpoint, latest.metadata, {})


def test_sync_invoke_stream_and_update_state_with_open_sync(database: Database) -> None:
    with Instance.open_sync(database.url, engine_options=engine_options(database)) as instance:
        graph = order_graph(instance)
        config = thread()
        assert graph.invoke({"n": 0}, config) == {"n": 1, "tokens": [1], "inner": 1}
        chunks = list(graph.stream({"n": 0}, config, stream_mode="values"))
        assert chunks[-1]["tokens"] == [1, 2]
        graph.update_state(config, {"n": 7})
        assert graph.get_state(config).values["n"] == 7
        lease = asyncio.run_coroutine_threadsafe(lease_of(instance, config), instance.loop).result()  # type: ignore[arg-type]
        assert lease.epoch == 3
        assert lease.status is LeaseStatus.DONE


async def test_sync_invoke_on_the_instances_own_loop_is_refused(instance: Instance) -> None:
    graph = order_graph(instance)
    with pytest.raises(ExecutionContextUnavailableError, match=r"await graph\.ainvoke"):
        graph.invoke({"n": 0}, thread())

"""A takeover resumes the run as it was started, and only runs it can find (issue 9 items 2, 4).

On SQLite and PostgreSQL, with the ``leases`` fixture's instances and controlled clock: a run
started with configurable keys, a runtime context, a recursion limit, tags, metadata and
options is frozen mid-step, its lease expires, and another instance's ``serve()`` finishes it
with all of them; a value that cannot be recorded, and a graph with LangGraph's default
name (no ``serve()`` would ever find it), are refused before anything is written.
"""

from __future__ import annotations

import asyncio
import logging
import signal
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypedDict

import pytest
from langchain_core.runnables import RunnableConfig
from langgraph.graph import END, START, StateGraph
from langgraph.runtime import Runtime

from langgraph_fence import Effect, ExecutionFencedError, LeaseKey, LeaseStatus, fence_graph
from langgraph_fence.database import schema_options
from langgraph_fence.instance import Instance
from langgraph_fence.lease.records import ExecutionRecord
from langgraph_fence.steps.context import get_execution_context
from langgraph_fence.testing import Leases
from tests.support.databases import SQL_BACKENDS, Database, unique
from tests.support.quickstart import env_importing, start_worker, until_done
from tests.support.serving import serving, until_status

TENANT = "acme"


@dataclass(frozen=True)
class Context:
    currency: str


#: The ``db`` fixture's instances (tests/conftest.py), on SQLite and on PostgreSQL.
RUNS_ON = SQL_BACKENDS
CONTEXT_TYPE = {(Context.__module__, Context.__qualname__)}


class Order(TypedDict, total=False):
    order: str
    receipt: str


class Checkout:
    """plan (instance A can be held inside it) then charge, which notes what it sees."""

    def __init__(self) -> None:
        self.seen: list[dict[str, Any]] = []
        self.a_inside = asyncio.Event()
        self.a_go = asyncio.Event()

    def graph(self, instance: Instance, *, name: str | None = "checkout") -> Any:
        async def plan(state: Order) -> dict[str, Any]:
            if instance.instance_id == "A":
                self.a_inside.set()
                await self.a_go.wait()
            return {}

        async def charge(
            state: Order, config: RunnableConfig, runtime: Runtime[Context]
        ) -> dict[str, Any]:
            self.seen.append(
                {
                    "by": instance.instance_id,
                    "token": get_execution_context().fence.token,
                    "user_id": config["configurable"].get("user_id"),
                    "context": runtime.context,
                    "recursion_limit": config.get("recursion_limit"),
                    "tags": config.get("tags"),
                    "channel": config.get("metadata", {}).get("channel"),
                }
            )
            return {"receipt": f"{state['order']} charged"}

        builder = StateGraph(Order, context_schema=Context)
        builder.add_node("plan", plan)
        builder.add_node("charge", charge)
        builder.add_edge(START, "plan")
        builder.add_edge("plan", "charge")
        builder.add_edge("charge", END)
        fence_graph(builder, effects={"charge": Effect.NON_IDEMPOTENT_WRITE})
        if name is None:
            return builder.compile(checkpointer=instance.checkpointer)
        return builder.compile(checkpointer=instance.checkpointer, name=name)


def started_with(thread: str, **configurable: Any) -> dict[str, Any]:
    return {
        "configurable": {"thread_id": thread, **configurable},
        "recursion_limit": 7,
        "tags": ["checkout", "web"],
        "metadata": {"channel": "web"},
    }


async def nothing_written(db: Leases, key: LeaseKey, thread: str) -> None:
    """No lease, no record, and the thread bound to no execution (another id binds it)."""
    assert await db.store.get(key) is None
    assert await db.records.get(key) is None
    other = LeaseKey(key.tenant_id, unique("other"))
    assert await db.records.bind(other, thread) == other.execution_id


async def test_a_takeover_runs_with_the_config_context_and_options_the_run_started_with(
    db: Leases,
) -> None:
    shop = Checkout()
    a, b = db.instance("A"), db.instance("B")
    thread = unique("order")
    key = LeaseKey(TENANT, thread)
    graph_a = shop.graph(a)
    run_a = asyncio.create_task(
        a.ainvoke(
            graph_a,
            {"order": "42"},
            started_with(thread, user_id="u-7"),
            tenant_id=TENANT,
            context=Context("EUR"),
            durability="sync",
        )
    )
    try:
        await asyncio.wait_for(shop.a_inside.wait(), 30)
        # A freezes inside plan; its lease expires; B takes the execution over.
        db.stall(a)
        db.advance(31.0)
        async with serving(b, {"checkout": shop.graph(b)}):
            await until_status(db, key, LeaseStatus.DONE)
        assert shop.seen == [
            {
                "by": "B",
                "token": 2,
                "user_id": "u-7",
                "context": Context("EUR"),
                "recursion_limit": 7,
                "tags": ["checkout", "web"],
                "channel": "web",
            }
        ]
    finally:
        db.resume(a)
        shop.a_go.set()
    with pytest.raises(ExecutionFencedError):
        await asyncio.wait_for(run_a, 30)
    # Recorded with the execution, in the one write of its start; the context comes back
    # as the graph's context_schema, which its takeover allows.
    record = await db.records.get(key, allow=CONTEXT_TYPE)
    assert record is not None
    assert record.graph == "checkout"
    assert dict(record.run.configurable) == {"user_id": "u-7"}
    assert dict(record.run.options) == {"context": Context("EUR"), "durability": "sync"}


@pytest.mark.parametrize(
    ("where", "configurable", "config", "options"),
    [
        ("config['configurable']['db']", {"db": object()}, {}, {}),
        ("config['tags']", {}, {"tags": [object()]}, {}),
        ("context=", {}, {}, {"context": object()}),
    ],
)
async def test_a_run_config_value_that_cannot_be_recorded_is_refused_before_anything_is_written(
    db: Leases,
    where: str,
    configurable: dict[str, Any],
    config: dict[str, Any],
    options: dict[str, Any],
) -> None:
    shop = Checkout()
    shop.a_go.set()  # nothing holds A in plan (if the run started, it would end)
    a = db.instance("A")
    thread = unique("order")
    run_config = {**started_with(thread, **configurable), **config}
    with pytest.raises(ValueError, match=r"cannot be recorded") as refused:
        await a.ainvoke(shop.graph(a), {"order": "42"}, run_config, tenant_id=TENANT, **options)
    assert str(refused.value).startswith(where)
    assert shop.seen == []
    await nothing_written(db, LeaseKey(TENANT, thread), thread)


async def test_a_graph_with_langgraphs_default_name_is_refused_before_anything_is_written(
    db: Leases,
) -> None:
    shop = Checkout()
    shop.a_go.set()  # nothing holds A in plan (if the run started, it would end)
    a = db.instance("A")
    thread = unique("order")
    unnamed = shop.graph(a, name=None)
    with pytest.raises(ValueError, match=r"default name 'LangGraph'") as refused:
        await a.ainvoke(
            unnamed, {"order": "42"}, started_with(thread, user_id="u-7"), tenant_id=TENANT
        )
    assert 'name="orders"' in str(refused.value)
    assert "graph_name" in str(refused.value)
    assert shop.seen == []
    await nothing_written(db, LeaseKey(TENANT, thread), thread)
    # Named by the call instead, it runs, recorded under the name a worker serves.
    other = unique("order")
    await a.ainvoke(
        unnamed,
        {"order": "43"},
        started_with(other, user_id="u-7"),
        tenant_id=TENANT,
        context=Context("EUR"),
        graph_name="checkout",
    )
    record = await db.records.get(LeaseKey(TENANT, other), allow=CONTEXT_TYPE)
    assert record is not None
    assert record.graph == "checkout"


WORKER_GRAPHS = """
from langgraph.graph import END, START, StateGraph
from typing import TypedDict

from langgraph_fence import fence_graph


class Log(TypedDict, total=False):
    log: list[str]


def graphs(instance):
    async def step(state: Log) -> dict:
        return {"log": ["step"]}

    builder = StateGraph(Log)
    builder.add_node("step", step)
    builder.add_edge(START, "step")
    builder.add_edge("step", END)
    fence_graph(builder)
    return {"served": builder.compile(checkpointer=instance.checkpointer, name="served")}
"""


async def test_the_worker_warns_once_at_default_level_of_an_execution_it_cannot_serve(
    tmp_path: Path, database: Database
) -> None:
    """``langgraph-fence worker`` without ``-v``: an expired execution of a graph it does not
    serve is named once, at WARNING, with the graph name it would need."""
    (tmp_path / "worker_graphs.py").write_text(WORKER_GRAPHS)
    schema = ["--schema", database.schema] if database.schema else []
    async with Instance.open(database.url, engine_options=schema_options(database.schema)) as setup:
        stranded = LeaseKey(TENANT, unique("refund"))
        await setup.records.record(
            ExecutionRecord(stranded, "refunds", stranded.execution_id, {"log": []})
        )
        assert await setup.repository.acquire(stranded, "dead-worker", 0.5) is not None
        worker = await start_worker(
            database.url, "worker_graphs:graphs", *schema, cwd=tmp_path, env=env_importing(tmp_path)
        )
        try:
            # A servable execution, expired after the stranded one: once it is done, the
            # worker has polled past the stranded one many times.
            served = LeaseKey(TENANT, unique("served"))
            await setup.records.record(
                ExecutionRecord(served, "served", served.execution_id, {"log": []})
            )
            assert await setup.repository.acquire(served, "dead-worker", 0.5) is not None
            await until_done(setup.repository, served, within=120)
            lease = await setup.repository.get(stranded)
            assert lease is not None
            assert lease.holder == "dead-worker"  # left untouched
        finally:
            worker.send_signal(signal.SIGTERM)
            _, err = await asyncio.wait_for(worker.communicate(), 60)
    stderr = err.decode()
    warnings = [line for line in stderr.splitlines() if stranded.scope_key in line]
    assert len(warnings) == 1, stderr
    assert "WARNING" in warnings[0], stderr
    assert "'refunds'" in warnings[0], stderr


async def test_serving_a_graph_under_another_name_than_its_own_is_warned_of(
    db: Leases, caplog: pytest.LogCaptureFixture
) -> None:
    """Runs of a graph named "checkout" are recorded as "checkout": served as "orders", none
    of them would be found; serve() says so when it starts."""
    b = db.instance("B")
    with caplog.at_level(logging.WARNING, logger="langgraph_fence"):
        async with serving(b, {"orders": Checkout().graph(b)}):
            pass
    assert "graph 'checkout' is served as 'orders'" in caplog.text

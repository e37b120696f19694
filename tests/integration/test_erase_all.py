"""Issue 32 items 1 and 6: a thread run the LangGraph way and erased the LangGraph way is gone.

The documented way (docs/erasure.md): no tenant anywhere (the run is of the one default
tenant), and
``instance.checkpointer.adelete_thread(thread_id)`` with no tenant either. Everything derived
from the thread goes: its checkpoints, blobs and writes, its record and its runs (a queued
one too), the store items its steps wrote, and its ``ANY_INSTANCE`` child (record,
checkpoints, store items: what the parent passed it). On SQLite and PostgreSQL (the
``database`` fixture: a database of the test's own).
"""

from __future__ import annotations

import json
from typing import Any, TypedDict

import pytest
from langgraph.checkpoint.conformance.test_utils import generate_checkpoint
from langgraph.checkpoint.serde.jsonplus import JsonPlusSerializer
from langgraph.config import get_store
from langgraph.graph import END, START, StateGraph
from sqlalchemy import text

from checkpointers.schema import CHECKPOINT_MIGRATIONS
from checkpointers.store import STORE_MIGRATIONS
from langgraph_fence import (
    ChildPlacement,
    Instance,
    LeaseKey,
    LeaseStatus,
    fence_graph,
    get_execution_context,
)
from langgraph_fence.database import create_engine, schema_options, transaction
from langgraph_fence.database.migrations import migrate
from langgraph_fence.execution.children import child_execution_id
from langgraph_fence.fence.tenancy import DEFAULT_TENANT, LEGACY_TENANT
from langgraph_fence.instance import DEFAULT_TENANT_ID
from langgraph_fence.lease.schema import LEASE_MIGRATIONS
from tests.support.databases import Database, unique
from tests.support.serving import cfg, opened, serving
from tests.support.tables import TABLES, stored_anywhere

SINK = ("fence_applied", "fence_high_water")


class Order(TypedDict, total=False):
    secret: str
    child: bool
    results: list[str]


class Job(TypedDict, total=False):
    text: str
    out: str


def one_step(instance: Instance, schema: Any, step: Any, *, name: str) -> Any:
    """A fenced graph of one step, with the instance's checkpointer and store."""
    builder = StateGraph(schema)
    builder.add_node(step.__name__, step)
    builder.add_edge(START, step.__name__)
    builder.add_edge(step.__name__, END)
    return fence_graph(builder).compile(
        checkpointer=instance.checkpointer, store=instance.store, name=name
    )


def order_graph(instance: Instance) -> Any:
    """Remembers the secret in the store; with ``child``, passes it to a child and waits."""

    async def take(state: Order) -> dict[str, Any]:
        ctx = get_execution_context()
        await get_store().aput(("orders", ctx.thread_id), "secret", {"secret": state["secret"]})
        if not state.get("child"):
            return {"results": []}
        child = await ctx.spawn_child(
            "shout", {"text": state["secret"]}, placement=ChildPlacement.ANY_INSTANCE, key="c"
        )
        [done] = await ctx.wait_children([child], timeout=30)
        return {"results": [done["out"]]}

    return one_step(instance, Order, take, name="orders")


def shout_graph(instance: Instance) -> Any:
    async def shout(state: Job) -> dict[str, Any]:
        await get_store().aput(("shouted",), state["text"], {"heard": state["text"]})
        return {"out": state["text"].upper()}

    return one_step(instance, Job, shout, name="shout")


async def stored(instance: Instance, needle: str) -> set[str]:
    """The tables (store items too, no sink: not set up here) whose rows hold ``needle``."""
    engine = instance._run_queue()._engine
    tables = (*(t for t in TABLES if t not in SINK), "fence_store_items")
    found = await stored_anywhere(engine, needle, tables)
    return {place.split(".")[0] for place in found}


async def leases_of_tenant(instance: Instance, tenant: str) -> list[tuple[str, str, Any]]:
    engine = instance._run_queue()._engine
    async with engine.connect() as conn:
        rows = await conn.execute(
            text("SELECT execution_id, status, reason FROM fence_leases WHERE tenant_id = :t"),
            {"t": tenant},
        )
        return sorted((r.execution_id, r.status, r.reason) for r in rows)


def test_there_is_one_default_tenant() -> None:
    assert DEFAULT_TENANT == DEFAULT_TENANT_ID == "default"


async def test_a_thread_run_the_langgraph_way_is_erased_the_langgraph_way(
    database: Database,
) -> None:
    secret = unique("secret")
    async with opened(database, "app") as app:
        graph = order_graph(app)
        thread = unique("order")
        out = await graph.ainvoke({"secret": secret}, cfg(thread))  # no tenant: the default
        assert out["results"] == []
        # A run queued behind it on the same thread (no worker serves it): a queue entry.
        await app.submit(
            "orders", {"secret": f"{secret}-queued"}, cfg(thread), tenant_id=app.tenant_id
        )
        # A schedule that would run the thread again with the secret.
        await app.schedules.create(
            unique("nightly"), "orders", {"secret": secret}, cfg(thread),
            tenant_id=app.tenant_id, cron="0 2 * * *",
        )  # fmt: skip
        assert {
            "fence_checkpoints",
            "fence_checkpoint_blobs",
            "fence_checkpoint_writes",
            "fence_executions",
            "fence_runs",
            "fence_schedules",
            "fence_store_items",
        } <= await stored(app, secret)

        await app.checkpointer.adelete_thread(thread)  # no tenant, as LangGraph calls it

        assert await stored(app, secret) == set()
        assert (await graph.aget_state(cfg(thread))).values == {}
        # The lease row stays, done with no reason: its token never goes back.
        assert await leases_of_tenant(app, DEFAULT_TENANT) == [(thread, "done", None)]


@pytest.mark.parametrize("tenant", [None, "acme"], ids=["no-tenant", "named-tenant"])
async def test_erasing_a_parent_erases_its_any_instance_child(
    database: Database, tenant: str | None
) -> None:
    secret = unique("secret")
    async with opened(database, "app") as app, opened(database, "worker") as worker:
        graph = order_graph(app)
        thread = unique("order")
        config: Any = cfg(thread)
        if tenant is not None:
            config["configurable"]["tenant_id"] = tenant
        async with serving(worker, {"shout": shout_graph(worker)}):
            out = await graph.ainvoke({"secret": secret, "child": True}, config)
        assert out["results"] == [secret.upper()]
        of = tenant or DEFAULT_TENANT
        child = child_execution_id(LeaseKey(of, thread), "c")
        assert (await app.get_run(child, tenant_id=of).state()).status is LeaseStatus.DONE
        # What the parent passed its child is in the child's rows and its store item.
        held = await stored(app, secret)
        assert {"fence_checkpoint_blobs", "fence_executions", "fence_store_items"} <= held

        if tenant is None:
            await app.checkpointer.adelete_thread(thread)
        else:
            await app.checkpointer.adelete_thread(thread, tenant_id=tenant)

        # The child's own record and checkpoints first (item 6), then every row of the tree.
        child_config: Any = {"configurable": {"thread_id": child, "tenant_id": of}}
        assert await app.records.get(LeaseKey(of, child)) is None
        assert await app.checkpointer.aget_tuple(child_config) is None
        assert await stored(app, secret) == set()
        assert await stored(app, secret.upper()) == set()  # the child's output
        assert await leases_of_tenant(app, of) == sorted(
            [(thread, "done", None), (child, "done", None)]
        )


async def test_rows_of_the_old_default_tenant_are_the_default_tenants_after_migrating(
    database: Database,
) -> None:
    # A database as the old default left it: a bare saver's thread and store item under ''.
    engine = create_engine(database.url, **schema_options(database.schema))
    try:
        await migrate(engine, "leases", LEASE_MIGRATIONS)
        await migrate(engine, "checkpoints", CHECKPOINT_MIGRATIONS[:2])
        await migrate(engine, "store", STORE_MIGRATIONS[:1])
        type_, blob = JsonPlusSerializer().dumps_typed(generate_checkpoint())
        async with transaction(engine) as conn:
            for tenant, thread, checkpoint_id in (
                ("", "old", "c1"),  # the bare saver's: moves to 'default'
                ("", "both", "c1"),  # 'default' has this thread too: never merged, stays
                ("default", "both", "c2"),
            ):
                await conn.execute(
                    text(
                        "INSERT INTO fence_checkpoints (tenant_id, thread_id, checkpoint_ns, "
                        "checkpoint_id, type, checkpoint, channel_versions, metadata) "
                        "VALUES (:tenant, :thread, '', :id, :type, :blob, '{}', '{}')"
                    ),
                    {"tenant": tenant, "thread": thread, "id": checkpoint_id, "type": type_,
                     "blob": blob},
                )  # fmt: skip
            for tenant, key, value in (
                ("", "k", "old"),
                ("", "dup", "old"),
                ("default", "dup", "new"),
            ):
                await conn.execute(
                    text(
                        "INSERT INTO fence_store_items (tenant_id, prefix, key, value, "
                        "created_at, updated_at) VALUES (:tenant, 'memories', :key, :value, 1, 1)"
                    ),
                    {"tenant": tenant, "key": key, "value": json.dumps({"v": value})},
                )
    finally:
        await engine.dispose()

    async with Instance.open(
        database.url, engine_options=schema_options(database.schema)
    ) as instance:
        saver = instance.checkpointer

        def at(thread: str, tenant: str | None = None) -> Any:
            configurable = {"thread_id": thread}
            return {
                "configurable": configurable | ({} if tenant is None else {"tenant_id": tenant})
            }

        old = await saver.aget_tuple(at("old"))  # no tenant: the default tenant's
        assert old is not None
        both = await saver.aget_tuple(at("both"))
        assert both is not None
        assert both.config["configurable"]["checkpoint_id"] == "c2"
        kept = await saver.aget_tuple(at("both", LEGACY_TENANT))  # read with tenant_id=""
        assert kept is not None
        assert kept.config["configurable"]["checkpoint_id"] == "c1"
        assert (await instance.store.aget(("memories",), "k")).value == {"v": "old"}  # type: ignore[union-attr]
        assert (await instance.store.aget(("memories",), "dup")).value == {"v": "new"}  # type: ignore[union-attr]

        await saver.adelete_thread("old")  # no tenant: erases what the old default wrote
        assert await saver.aget_tuple(at("old")) is None


async def test_admin_calls_with_no_tenant_act_on_the_thread_a_plain_run_wrote(
    database: Database,
) -> None:
    async with opened(database, "app") as app:
        graph = order_graph(app)
        saver = app.checkpointer
        thread, copy = unique("order"), unique("copy")
        for n in range(2):
            await graph.ainvoke({"secret": f"turn-{n}"}, cfg(thread))

        async def checkpoints(of: str) -> list[Any]:
            return [item async for item in saver.alist(cfg(of))]

        assert len(await checkpoints(thread)) > 1
        await saver.acopy_thread(thread, copy)  # type: ignore[attr-defined]
        assert (await graph.aget_state(cfg(copy))).values["secret"] == "turn-1"
        await saver.aprune([thread])  # type: ignore[attr-defined]
        assert len(await checkpoints(thread)) == 1

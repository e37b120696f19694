"""The graph of the failover test's worker processes (``tests/chaos/test_failover.py``).

``langgraph-fence worker --graphs tests.support.failover_graphs:shop_graphs`` serves
``failover_shop`` = prepare -> charge -> finish. ``charge`` calls "the payment API": one row
in ``calls`` on ANOTHER database (``$LGF_FAILOVER_SINK_URL``, schema
``$LGF_FAILOVER_SINK_SCHEMA``), which a failover of the workers' database does not touch.
Each node takes a little while, so the failover lands inside steps. A thread whose name
is a file in ``$LGF_FAILOVER_HOLD_DIR`` waits in ``prepare`` while that file exists, after
writing ``<thread>.inside`` beside it: a run held in flight across the failover.
"""

from __future__ import annotations

import asyncio
import operator
import os
import random
from pathlib import Path
from typing import Annotated, Any, TypedDict

import sqlalchemy as sa
from langgraph.graph import END, START, StateGraph

from langgraph_fence import Effect, Instance, fence_graph, get_execution_context
from langgraph_fence.database import create_engine

__all__ = [
    "CALLS",
    "HOLD_DIR_ENV",
    "SHOP_GRAPH",
    "SINK_SCHEMA_ENV",
    "SINK_URL_ENV",
    "shop_graphs",
]

SHOP_GRAPH = "failover_shop"
SINK_URL_ENV = "LGF_FAILOVER_SINK_URL"
SINK_SCHEMA_ENV = "LGF_FAILOVER_SINK_SCHEMA"
HOLD_DIR_ENV = "LGF_FAILOVER_HOLD_DIR"
CALLS = (
    "CREATE TABLE IF NOT EXISTS calls (id BIGSERIAL PRIMARY KEY, thread TEXT NOT NULL, "
    "token BIGINT NOT NULL, worker TEXT NOT NULL)"
)
_CALL = sa.text("INSERT INTO calls (thread, token, worker) VALUES (:thread, :token, :worker)")


class Order(TypedDict, total=False):
    log: Annotated[list[str], operator.add]


def shop_graphs(instance: Instance) -> dict[str, Any]:
    """``--graphs`` factory: ``failover_shop``, its charge recorded on the sink database."""
    sink = create_engine(os.environ[SINK_URL_ENV], schema=os.environ[SINK_SCHEMA_ENV])
    worker = instance.instance_id

    async def pause() -> None:
        await asyncio.sleep(random.uniform(0.05, 0.3))  # a model call: the failover lands in it

    async def prepare(state: Order) -> dict[str, Any]:
        held = Path(os.environ[HOLD_DIR_ENV]) / get_execution_context().thread_id
        if held.exists():
            held.with_suffix(".inside").write_text(str(os.getpid()))
            while held.exists():  # noqa: ASYNC110 (the test removes it: no event crosses processes)
                await asyncio.sleep(0.05)
        await pause()
        return {"log": ["prepared"]}

    async def charge(state: Order) -> dict[str, Any]:
        context = get_execution_context()
        await pause()
        async with sink.connect() as conn:  # autocommit: the call is made at once
            await conn.execute(
                _CALL,
                {"thread": context.thread_id, "token": context.fence.token, "worker": worker},
            )
        await pause()
        return {"log": [f"charged at {context.fence.token}"]}

    async def finish(state: Order) -> dict[str, Any]:
        await pause()
        return {"log": ["finished"]}

    builder = StateGraph(Order)
    for name, node in (("prepare", prepare), ("charge", charge), ("finish", finish)):
        builder.add_node(name, node)
    builder.add_edge(START, "prepare")
    builder.add_edge("prepare", "charge")
    builder.add_edge("charge", "finish")
    builder.add_edge("finish", END)
    effects = {"prepare": Effect.READ_ONLY, "charge": Effect.NON_IDEMPOTENT_WRITE}
    graph = fence_graph(builder, effects=effects).compile(
        checkpointer=instance.checkpointer, name=SHOP_GRAPH
    )
    return {SHOP_GRAPH: graph}

"""Issue 32 item 2: a failure's stored reason never holds a value a database driver quoted.

The card number a node's statement was given comes back in the driver's message (asyncpg's
``invalid input for query argument $1: '4111-...'``, PostgreSQL's ``invalid input syntax
for type bigint: "4111-..."``); the reason keeps what went wrong and the SQLSTATE, not the
value. On both databases, a card number in any message is masked.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, TypedDict

import pytest
from langgraph.graph import END, START, StateGraph
from sqlalchemy import text
from sqlalchemy.ext.asyncio import AsyncEngine

from langgraph_fence import LeaseKey, LeaseStatus, fence_graph
from langgraph_fence.testing import Leases, ManualClock
from tests.support.databases import SQL_BACKENDS, unique

RUNS_ON = SQL_BACKENDS

TENANT = "acme"
CARD = "4111-1111-1111-1111"


class State(TypedDict, total=False):
    done: bool


async def failed_reason(db: Leases, node: Any) -> str:
    """The reason stored for a run whose one node raises."""
    builder = StateGraph(State)
    builder.add_node("node", node)
    builder.add_edge(START, "node")
    builder.add_edge("node", END)
    instance = db.instance(unique("i"))
    graph = fence_graph(builder).compile(checkpointer=instance.checkpointer, name="cards")
    key = LeaseKey(TENANT, unique("charge"))
    config: Any = {"configurable": {"thread_id": key.execution_id}}
    with pytest.raises(Exception, match=r"."):  # each node raises its own driver's error
        await instance.ainvoke(graph, {}, config, tenant_id=TENANT)
    lease = await db.store.get(key)
    assert lease is not None
    assert lease.status is LeaseStatus.FAILED
    assert lease.reason is not None
    return lease.reason


async def test_a_drivers_quoted_value_never_reaches_the_reason(
    backend: str, make_engine: Callable[[str], AsyncEngine]
) -> None:
    db = Leases(make_engine(backend), ManualClock())
    await db.setup()

    async def wrapped(state: State) -> State:
        raise RuntimeError(f"charge declined for card {CARD.replace('-', ' ')}")

    reasons = {"wrapped": await failed_reason(db, wrapped)}
    if backend == "postgresql":

        async def argument(state: State) -> State:
            async with db.engine.connect() as conn:  # asyncpg: a str for a bigint argument
                await conn.execute(text("SELECT 1 WHERE 1 = :card"), {"card": CARD})
            return {}

        async def cast(state: State) -> State:
            async with db.engine.connect() as conn:  # PostgreSQL: text that is no bigint
                await conn.execute(
                    text("SELECT CAST(CAST(:card AS text) AS bigint)"), {"card": CARD}
                )
            return {}

        reasons["argument"] = await failed_reason(db, argument)
        reasons["cast"] = await failed_reason(db, cast)
        assert "query argument $1" in reasons["argument"]
        assert "invalid input syntax for type bigint" in reasons["cast"]
        assert "SQLSTATE 22P02" in reasons["cast"]
    for reason in reasons.values():
        assert "4111" not in reason, reason
        assert "1111" not in reason, reason
    assert reasons["wrapped"] == "RuntimeError: charge declined for card [number]"

"""The driver connections the hot paths hold (``database.driver.Connections``) under cancels.

LangGraph cancels a step's task when a sibling fails, and what users wrap around us (a
timeout, a task group) may cancel it again while the first cancel is being handled. A call
cut off on its connection must never hand that connection back to the pool before its close
ends: the next operation would be given a connection closed under it, and a run would end
on "Cannot operate on a closed database" (a resumed run lost its settle this way).
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable

import pytest
from sqlalchemy import event, literal_column, select, text
from sqlalchemy.ext.asyncio import AsyncEngine

from langgraph_fence.database.driver import Connections
from tests.support.databases import SQL_BACKENDS

ONE = select(literal_column("1").label("one"))


async def returned(engine: AsyncEngine) -> None:
    """Until every connection of ``engine``'s pool is back in it."""
    pool = engine.sync_engine.pool
    back = asyncio.Event()

    def checked_in(*_: object) -> None:
        back.set()

    event.listen(pool, "checkin", checked_in)
    try:
        while pool.checkedout():  # type: ignore[attr-defined]
            await back.wait()
            back.clear()
    finally:
        event.remove(pool, "checkin", checked_in)


@pytest.mark.parametrize("backend", SQL_BACKENDS)
async def test_a_call_cancelled_again_while_it_closes_its_connection_leaves_the_pool_sound(
    backend: str, make_engine: Callable[[str], AsyncEngine]
) -> None:
    engine = make_engine(backend)
    connections = Connections(engine)
    await connections.rows(ONE, {})  # a held connection, as the hot paths keep one
    in_call = asyncio.Event()
    task: asyncio.Task[None] | None = None

    def cancel_again(*_: object) -> None:
        # The second cancel lands while the first one's close of the connection is under way.
        assert task is not None
        task.cancel()

    event.listen(engine.sync_engine.pool, "invalidate", cancel_again)

    async def call() -> None:
        async with connections():
            in_call.set()
            await asyncio.Event().wait()  # a statement that never ends

    task = asyncio.ensure_future(call())
    await in_call.wait()
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    event.remove(engine.sync_engine.pool, "invalidate", cancel_again)

    for _ in range(5):  # every connection the pool hands out next works
        async with engine.connect() as conn:
            assert (await conn.execute(text("SELECT 1"))).scalar() == 1
        assert [row["one"] for row in await connections.rows(ONE, {})] == [1]
    await connections.aclose()
    await asyncio.wait_for(returned(engine), 10)

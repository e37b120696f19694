"""Instances a test can stall inside a step (``stallable``) and the runs they invoke, for
the approval and sync-step tests."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from typing import Any

from checkpointers import SqlCheckpointer
from langgraph_fence import (
    Instance,
    LeaseKey,
    SqlLeaseRepository,
)
from langgraph_fence.database import create_engine
from langgraph_fence.lease.faults import StallableRepository, StallGate
from langgraph_fence.lease.records import SqlExecutionRecords
from tests.support.databases import Database, engine_options, setup_all

# A woken worker asks the store once whether it was taken over, within one renew interval
# (TTL / 3): long enough for that round trip on a busy box.
TTL = 1.5

TENANT = "acme"


WAIT = 20.0


@asynccontextmanager
async def stallable(
    database: Database,
    name: str,
    *,
    ttl: float = TTL,
    clock: Callable[[], float] | None = None,
) -> AsyncIterator[tuple[Instance, StallGate]]:
    """An instance on ``database`` whose lease store and timers a test can freeze.

    ``clock`` (default ``time.monotonic``) is the instance's own: a clock that never moves
    freezes its sense of time too, so its local checks still trust a lapsed hold.
    """
    engine = create_engine(database.url, **engine_options(database.url, database.schema))
    try:
        await setup_all(engine)
        store = SqlLeaseRepository(engine)
        saver = SqlCheckpointer(engine)
        await saver.setup()  # on this loop
        records = SqlExecutionRecords(engine)
        gate = StallGate()
        instance = Instance(
            StallableRepository(store, gate),
            saver,
            records=records,
            instance_id=name,
            lease_ttl=ttl,
            clock=clock,
            sleep=gate.gated_sleep(asyncio.sleep),
        )
        try:
            yield instance, gate
        finally:
            gate.resume()
            await instance.aclose()
            await saver.aclose()
    finally:
        await engine.dispose()


async def invoke(instance: Instance, graph: Any, value: Any, thread: str) -> Any:
    config: Any = {"configurable": {"thread_id": thread}}
    return await instance.ainvoke(graph, value, config, tenant_id=TENANT)


async def lease_of(instance: Instance, thread: str) -> Any:
    return await instance.repository.get(LeaseKey(TENANT, thread))

"""Instances serving in a test: ``serving()`` (``instance.serve()`` polling fast, for a
block), ``opened()`` (an instance on a test's database), waits on a lease's status."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

from langgraph_fence import (
    Instance,
    LeaseKey,
    LeaseStatus,
)
from langgraph_fence.testing import Leases
from tests.support.databases import Database, pg_engine_options, unique
from tests.support.polling import eventually


async def until_status(
    leases: Leases,
    key: LeaseKey,
    *statuses: LeaseStatus,
    timeout: float = 10.0,  # noqa: ASYNC109 (eventually's deadline, checked between reads)
) -> None:
    """Wait (with a deadline) until the lease of ``key`` is in one of ``statuses``."""

    async def reached() -> bool:
        lease = await leases.store.get(key)
        return lease is not None and lease.status in statuses

    await eventually(reached, timeout=timeout, what=f"{key.scope_key} to reach {statuses}")


@asynccontextmanager
async def serving(
    instance: Instance, graphs: dict[str, Any], **options: Any
) -> AsyncIterator[asyncio.Event]:
    """``instance.serve(graphs)``, polling fast unless ``options`` say another
    ``poll_interval``, for the block; yields its stop event.

    Leaving the block stops the loop (if the block did not) and waits for it to end.
    """
    stop = asyncio.Event()
    options = {"poll_interval": 0.02, **options}
    task = asyncio.create_task(instance.serve(graphs, stop=stop, handle_signals=False, **options))
    try:
        yield stop
    finally:
        stop.set()
        await asyncio.wait_for(task, 20)


@asynccontextmanager
async def opened(database: Database, name: str, **options: Any) -> AsyncIterator[Instance]:
    extra = pg_engine_options(database.schema) if database.schema else {}
    async with Instance.open(
        database.url, engine_options=extra, instance_id=unique(name), **options
    ) as instance:
        yield instance


def stepped(
    instance: Instance, graphs: dict[str, Any], *, concurrency: int = 1, **options: Any
) -> Any:
    """``instance``'s serve loop over ``graphs`` (with the serve ``options``, e.g.
    ``run_retries``), for a test to drive one look at a time (:func:`look`): no wall clock."""
    from langgraph_fence.execution.serve import Server

    return Server(
        instance.host,
        graphs,
        concurrency=concurrency,
        poll_interval=0.02,
        max_takeovers=3,
        kwargs={},
        **options,
    )


async def look(server: Any) -> None:
    """One look of a :func:`stepped` loop, and the runs it started, to their end (their
    ends told to their waiters)."""
    await server.poll_once()
    await asyncio.wait_for(asyncio.gather(*server.running), 20)
    await asyncio.wait_for(asyncio.gather(*server.telling), 20)


def cfg(thread: str) -> dict[str, Any]:
    return {"configurable": {"thread_id": thread}}

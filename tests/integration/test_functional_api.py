"""The functional API under the lease (issue 12): ``@entrypoint(checkpointer=
instance.checkpointer)`` over ``@fenced`` functions, ``@task`` over ``@fenced`` ones; each
task is a step with its frame and fence; a non-idempotent task stalled past its lease is not
repeated. On SQLite and PostgreSQL, with the ``leases`` tools (controlled clock, stalls).
"""

from __future__ import annotations

import asyncio
import contextlib
import uuid
from collections.abc import AsyncIterator
from typing import Any

import pytest
from langchain_core.runnables import RunnableConfig
from langgraph.func import entrypoint, task

from langgraph_fence import (
    Effect,
    ExecutionDeadLetteredError,
    ExecutionLeaseLostError,
    Instance,
    LeaseKey,
    LeaseStatus,
    fenced,
    get_execution_context,
)
from langgraph_fence.testing import Leases, open_leases
from tests.support.databases import Database, pg_engine_options


@pytest.fixture
async def leases(database: Database) -> AsyncIterator[Leases]:
    options = pg_engine_options(database.schema) if database.schema else {}
    async with open_leases(database.url, **options) as opened:
        yield opened


class Shop:
    """Three tasks, the middle one a non-idempotent write that can be held inside."""

    def __init__(self) -> None:
        self.calls: list[tuple[str, int]] = []
        self.charging = asyncio.Event()
        self.release = asyncio.Event()
        self.hold = True

        @task
        @fenced
        async def reserve(order: str) -> str:
            self.calls.append(("reserve", get_execution_context().fence.token))
            return f"reserved {order}"

        @task
        @fenced(effect=Effect.NON_IDEMPOTENT_WRITE)
        async def charge(order: str) -> str:
            token = get_execution_context().fence.token
            self.calls.append(("charge", token))
            if self.hold and token == 1:  # A only: a repeat by B must not wait
                self.charging.set()
                # Cancelled when the instance learns it lost the lease: the body goes on.
                with contextlib.suppress(asyncio.CancelledError):
                    await self.release.wait()
            return f"charged {order}"

        @task
        @fenced
        async def notify(order: str) -> str:
            self.calls.append(("notify", get_execution_context().fence.token))
            return f"notified {order}"

        self.tasks = (reserve, charge, notify)

    def workflow(self, instance: Instance) -> Any:
        reserve, charge, notify = self.tasks

        @entrypoint(checkpointer=instance.checkpointer)
        @fenced
        async def orders(order: str) -> list[str]:
            return [await reserve(order), await charge(order), await notify(order)]

        orders.name = "orders"  # the name serve() finds it under (@entrypoint sets none)
        return orders


def thread() -> RunnableConfig:
    return {"configurable": {"thread_id": f"fn-{uuid.uuid4().hex}"}}


async def test_each_task_runs_as_a_step_under_the_lease(leases: Leases) -> None:
    shop = Shop()
    shop.hold = False
    workflow = shop.workflow(leases.instance("A"))
    config = thread()
    assert await workflow.ainvoke("42", config) == ["reserved 42", "charged 42", "notified 42"]
    assert shop.calls == [("reserve", 1), ("charge", 1), ("notify", 1)]
    lease = await leases.store.get(LeaseKey("default", config["configurable"]["thread_id"]))
    assert lease is not None
    assert lease.status is LeaseStatus.DONE
    assert not lease.pending_effects


async def test_a_non_idempotent_task_stalled_past_its_lease_is_not_repeated(
    leases: Leases,
) -> None:
    shop = Shop()
    a, b = leases.instance("A", lease_ttl=30.0), leases.instance("B", lease_ttl=30.0)
    config = thread()
    key = LeaseKey("default", config["configurable"]["thread_id"])
    running = asyncio.create_task(shop.workflow(a).ainvoke("42", config))
    await asyncio.wait_for(shop.charging.wait(), 10)
    leases.stall(a)
    leases.advance(31.0)  # A's lease expires by the store's clock while A is inside charge

    # B resumes the thread the LangGraph way: the charge's stamp stands, so B dead-letters
    # the execution instead of charging again.
    with pytest.raises(ExecutionDeadLetteredError, match="charge"):
        await shop.workflow(b).ainvoke(None, config)
    lease = await leases.store.get(key)
    assert lease is not None
    assert lease.status is LeaseStatus.DEAD_LETTERED
    assert lease.epoch == 2

    leases.resume(a)
    shop.release.set()
    with pytest.raises(ExecutionLeaseLostError):
        await asyncio.wait_for(running, 10)
    assert [c for c in shop.calls if c[0] == "charge"] == [("charge", 1)]
    assert ("notify", 1) not in shop.calls
    assert ("notify", 2) not in shop.calls


async def test_an_unfenced_task_is_refused_before_it_runs(leases: Leases) -> None:
    ran: list[str] = []

    @task
    async def send_email(to: str) -> str:  # no @fenced: it would run unstamped
        ran.append(to)
        return f"sent {to}"

    instance = leases.instance("A")

    @entrypoint(checkpointer=instance.checkpointer)
    @fenced
    async def mailer(to: str) -> str:
        return await send_email(to)

    mailer.name = "mailer"
    config = thread()
    with pytest.raises(ValueError, match=r"task 'send_email' was refused.*@fenced"):
        await mailer.ainvoke("ada@example.com", config)
    assert ran == []

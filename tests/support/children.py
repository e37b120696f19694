"""Parent and child graphs for the children tests: the work a child does, gated by the
test (:class:`Work`), and the child graph and leases."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field
from typing import Any, TypedDict

from sqlalchemy import text
from sqlalchemy.ext.asyncio import AsyncEngine

from langgraph_fence import (
    Instance,
    get_execution_context,
)
from langgraph_fence.database import transaction
from langgraph_fence.sinks import fenced_write
from tests.support.graphs import one_step


class Job(TypedDict, total=False):
    text: str
    out: str


class Fan(TypedDict, total=False):
    items: list[str]
    results: list[Any]
    errors: list[str]


@dataclass
class Work:
    """What the child node saw, and gates that hold a child in its node."""

    ran: list[str] = field(default_factory=list)
    gates: dict[str, asyncio.Event] = field(default_factory=dict)
    spawned: list[bool] = field(default_factory=list)
    tokens: list[tuple[str, int]] = field(default_factory=list)  # (scope key, token)
    sink: AsyncEngine | None = None  # steps write through the exactly-once sink there

    async def write_through_sink(self, name: str) -> None:
        if self.sink is None:
            return
        fence = get_execution_context().fence
        async with (
            transaction(self.sink) as conn,
            fenced_write(conn, fence, f"{name}-{fence.token}") as write,
        ):
            if not write.applied:
                write.record(fence.token)


def child_graph(instance: Instance, work: Work) -> Any:
    async def shout(state: Job) -> dict[str, Any]:
        ctx = get_execution_context()
        work.ran.append(state["text"])
        work.tokens.append((ctx.fence.scope_key, ctx.fence.token))
        await work.write_through_sink("child")
        gate = work.gates.get(state["text"])
        if gate is not None:
            await gate.wait()
        if state["text"] == "boom":
            raise ValueError("the child cannot shout 'boom'")
        return {"out": state["text"].upper()}

    return one_step(instance, Job, "shout", shout, name="shout")


async def lease_rows(instance: Instance, prefix: str) -> list[tuple[str, str, int]]:
    engine = instance._run_queue()._engine
    async with engine.connect() as conn:
        rows = await conn.execute(
            text(
                "SELECT execution_id, status, epoch FROM fence_leases WHERE execution_id "
                "LIKE :p ORDER BY execution_id"
            ),
            {"p": prefix + "%"},
        )
        return [(r.execution_id, r.status, int(r.epoch)) for r in rows]

"""A one-step graph ``shout`` (upper-cases ``text``) whose node records what started and can
be held by a gate; and the row counts that tell what a submit wrote."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field
from typing import Any, TypedDict

from langchain_core.runnables import RunnableConfig
from sqlalchemy import text

from langgraph_fence import Instance
from tests.support.graphs import one_step

TABLES = ("fence_leases", "fence_executions", "fence_thread_bindings", "fence_checkpoints")
#: What a start or a submit writes; beside a run in flight, whose checkpoints land meanwhile
#: (under durability="async" even after its node began), these are compared, not the
#: checkpoints.
SUBMIT_TABLES = ("fence_leases", "fence_executions", "fence_thread_bindings", "fence_runs")


class State(TypedDict, total=False):
    text: str
    out: str


@dataclass
class Work:
    """What the node saw: the inputs in the order runs started, and gates that hold them."""

    started: list[tuple[str, str]] = field(default_factory=list)  # (tenant, text)
    gates: dict[str, asyncio.Event] = field(default_factory=dict)  # text -> released
    entered: dict[str, asyncio.Event] = field(default_factory=dict)  # text -> in the node


def build(instance: Instance, work: Work) -> Any:
    async def shout(state: State, config: RunnableConfig) -> dict[str, Any]:
        tenant = config["configurable"]["tenant_id"]
        work.started.append((tenant, state["text"]))
        work.entered.setdefault(state["text"], asyncio.Event()).set()
        gate = work.gates.get(state["text"])
        if gate is not None:
            await gate.wait()
        return {"out": state["text"].upper()}

    return one_step(instance, State, "shout", shout, name="shout")


async def within(event: asyncio.Event, seconds: float = 10.0) -> None:
    await asyncio.wait_for(event.wait(), seconds)


async def rows(instance: Instance, tables: tuple[str, ...] = TABLES) -> dict[str, int]:
    engine = instance._run_queue()._engine
    async with engine.connect() as conn:
        return {
            t: int((await conn.execute(text(f"SELECT count(*) FROM {t}"))).scalar_one())
            for t in tables
        }

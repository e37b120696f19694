"""A takeover in the middle of a step, on the ``leases`` tools: instance A runs a charge
step and is held inside it, frozen past its lease; B's ``serve()`` takes the execution over;
A thaws and is fenced. Shared by the event, console and metrics tests."""

from __future__ import annotations

import asyncio
import operator
from collections.abc import Awaitable, Callable, Collection
from typing import Annotated, Any, TypedDict

from langgraph.graph import END, START, StateGraph

from langgraph_fence import (
    Effect,
    ExecutionFencedError,
    Instance,
    LeaseKey,
    LeaseStatus,
    fence_graph,
    get_execution_context,
)
from langgraph_fence.testing import Leases
from tests.support.databases import unique
from tests.support.serving import until_status

__all__ = ["Order", "Shop", "take_over_mid_charge"]


class Order(TypedDict, total=False):
    log: Annotated[list[str], operator.add]


class Shop:
    """A graph whose charge step holds the instances named in ``hold`` inside it until
    told to go on (``go[name].set()``); ``inside[name]`` is set when one is inside."""

    def __init__(
        self, effect: Effect = Effect.IDEMPOTENT_WRITE, hold: Collection[str] = ("A",)
    ) -> None:
        self.effect = effect
        self.inside = {name: asyncio.Event() for name in hold}
        self.go = {name: asyncio.Event() for name in hold}

    @property
    def a_inside(self) -> asyncio.Event:
        return self.inside["A"]

    @property
    def a_go(self) -> asyncio.Event:
        return self.go["A"]

    def graph(self, instance: Instance) -> Any:
        async def charge(state: Order) -> dict[str, Any]:
            name = instance.instance_id
            if name in self.inside:
                self.inside[name].set()
                await self.go[name].wait()
            return {"log": [f"charged at token {get_execution_context().fence.token}"]}

        builder = StateGraph(Order)
        builder.add_node("charge", charge)
        builder.add_edge(START, "charge")
        builder.add_edge("charge", END)
        return fence_graph(builder, effects={"charge": self.effect}).compile(
            checkpointer=instance.checkpointer, name="shop"
        )


async def take_over_mid_charge(
    leases: Leases,
    a: Instance,
    b: Instance,
    shop: Shop,
    *,
    thread: str | None = None,
    while_b_inside: Callable[[LeaseKey], Awaitable[None]] | None = None,
) -> tuple[LeaseKey, BaseException | None]:
    """A runs until inside charge and freezes; B's serve() takes over (and, where the shop
    holds B too, ``while_b_inside`` runs while B is inside the step); A thaws. Returns the
    key and A's fencing error (``None``: A was not fenced)."""
    thread = thread or unique("order")
    key = LeaseKey("acme", thread)
    config: Any = {"configurable": {"thread_id": thread}}
    task_a = asyncio.create_task(
        a.ainvoke(shop.graph(a), {"log": []}, config, tenant_id="acme", durability="sync")
    )
    await asyncio.wait_for(shop.a_inside.wait(), 20)
    leases.stall(a)
    leases.advance(31.0)  # past A's 30 s lease, by the store's clock
    stop = asyncio.Event()
    serve = asyncio.create_task(
        b.serve({"shop": shop.graph(b)}, poll_interval=0.02, stop=stop, handle_signals=False)
    )
    try:
        if "B" in shop.inside:
            await asyncio.wait_for(shop.inside["B"].wait(), 20)
            if while_b_inside is not None:
                await while_b_inside(key)
            shop.go["B"].set()
        await until_status(leases, key, LeaseStatus.DONE, LeaseStatus.DEAD_LETTERED, timeout=20)
    finally:
        stop.set()
        await asyncio.wait_for(serve, 20)
    leases.resume(a)
    shop.a_go.set()
    try:
        await asyncio.wait_for(task_a, 20)
    except ExecutionFencedError as exc:
        return key, exc
    return key, None

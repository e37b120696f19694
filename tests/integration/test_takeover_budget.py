"""serve() spends the takeover budget with the thread's real progress (issue 24, item 3).

On a real SQLite store and checkpointer with a controlled clock (the ``leases`` fixture):
instance A runs an order up to a step it never leaves (it "dies" there: stalled, its lease
expired), three takeovers that found no progress are spent on the store, and B's serve()
decides from the thread's latest checkpoint: dead-letter without a new one, resume with one.
"""

from __future__ import annotations

import asyncio
import operator
from typing import Annotated, Any, TypedDict

import pytest
from langgraph.graph import END, START, StateGraph

from langgraph_fence import LeaseKey, LeaseStatus, fence_graph
from langgraph_fence.instance import Instance
from langgraph_fence.lease.records import ExecutionRecord
from langgraph_fence.testing import Leases
from tests.support.databases import unique
from tests.support.graphs import one_step
from tests.support.polling import eventually
from tests.support.serving import serving, until_status

TTL = 30.0


class Order(TypedDict, total=False):
    log: Annotated[list[str], operator.add]


class Pill:
    """prepare -> pill -> END; ``pill`` holds instance A inside it forever (A "dies")."""

    def __init__(self) -> None:
        self.pill_runs: list[str] = []
        self.a_inside = asyncio.Event()

    def graph(self, instance: Instance) -> Any:
        async def prepare(state: Order) -> dict[str, Any]:
            return {"log": ["prepare"]}

        async def pill(state: Order) -> dict[str, Any]:
            self.pill_runs.append(instance.instance_id)
            if instance.instance_id == "A":
                self.a_inside.set()
                await asyncio.Event().wait()
            return {"log": [f"pill by {instance.instance_id}"]}

        builder = StateGraph(Order)
        builder.add_node("prepare", prepare)
        builder.add_node("pill", pill)
        builder.add_edge(START, "prepare")
        builder.add_edge("prepare", "pill")
        builder.add_edge("pill", END)
        return fence_graph(builder).compile(checkpointer=instance.checkpointer, name="pill")


async def three_takeovers_spent(leases: Leases, pill: Pill) -> tuple[LeaseKey, str, Any]:
    """A dies inside ``pill`` after prepare's checkpoint; three takers died with nothing new."""
    a = leases.instance("A")
    thread = unique("order")
    key = LeaseKey("acme", thread)
    config = {"configurable": {"thread_id": thread}}
    run_a = asyncio.create_task(
        a.ainvoke(pill.graph(a), {"log": []}, config, tenant_id="acme", durability="sync")
    )
    await asyncio.wait_for(pill.a_inside.wait(), 10)
    leases.stall(a)
    latest = await leases.saver.aget_tuple(
        {"configurable": {"thread_id": thread, "tenant_id": "acme"}}
    )
    assert latest is not None
    mark = latest.config["configurable"]["checkpoint_id"]
    lease = await leases.store.get(key)
    for n in range(1, 4):
        assert lease is not None
        leases.advance(TTL + 1)
        lease = await leases.store.take_over(
            lease, f"dead-{n}", TTL, progress_mark=mark, max_takeovers=3
        )
    assert lease is not None
    assert (lease.takeovers, lease.status) == (3, LeaseStatus.RUNNING)
    leases.advance(TTL + 1)

    async def end_a() -> None:
        # A wakes up fenced; it must reach the store to learn that, so resume it first.
        leases.resume(a)
        run_a.cancel()
        await asyncio.gather(run_a, return_exceptions=True)

    return key, thread, end_a


@pytest.fixture
def pill() -> Pill:
    return Pill()


async def test_a_take_with_no_new_checkpoint_past_the_budget_dead_letters_it(
    leases: Leases, pill: Pill
) -> None:
    key, _, end_a = await three_takeovers_spent(leases, pill)
    b = leases.instance("B")
    async with serving(b, {"pill": pill.graph(b)}):
        await until_status(leases, key, LeaseStatus.DEAD_LETTERED)
    await end_a()
    lease = await leases.store.get(key)
    assert lease is not None
    assert lease.reason is not None
    assert "crashed 3 workers in a row" in lease.reason
    assert "the last dead-3 at token 4" in lease.reason
    assert pill.pill_runs == ["A"]  # B never ran the step


async def test_a_new_checkpoint_since_the_last_take_lets_it_run(leases: Leases, pill: Pill) -> None:
    key, thread, end_a = await three_takeovers_spent(leases, pill)
    b = leases.instance("B")
    graph = pill.graph(b)
    # Progress the takers made before they died: a checkpoint of the thread newer than the
    # one the last take saw, written beside the fence (a plain call through
    # b.checkpointer would be a run of its own: it would take the lease).
    await graph.copy(update={"checkpointer": leases.saver}).aupdate_state(
        {"configurable": {"thread_id": thread, "tenant_id": "acme"}}, {"log": ["fixed"]}
    )
    async with serving(b, {"pill": graph}):
        await until_status(leases, key, LeaseStatus.DONE, LeaseStatus.DEAD_LETTERED)
    await end_a()
    lease = await leases.store.get(key)
    assert lease is not None, lease.reason
    assert lease.status is LeaseStatus.DONE, lease.reason
    assert pill.pill_runs == ["A", "B"]


@pytest.mark.parametrize("where", ["instance", "serve"])
async def test_the_budget_is_the_instance_s_or_serve_s(
    leases: Leases, pill: Pill, where: str
) -> None:
    key, _, end_a = await three_takeovers_spent(leases, pill)
    b = leases.instance("B", max_takeovers=4 if where == "instance" else 3)
    options = {"max_takeovers": 4} if where == "serve" else {}
    async with serving(b, {"pill": pill.graph(b)}, **options):
        await until_status(leases, key, LeaseStatus.DONE, LeaseStatus.DEAD_LETTERED)
    await end_a()
    lease = await leases.store.get(key)
    assert lease is not None, lease.reason
    assert lease.status is LeaseStatus.DONE, lease.reason
    assert lease.takeovers == 0  # done: the count starts again


@pytest.mark.parametrize("bad", [0, -1, None, True, 2.5, "3"])
async def test_a_bad_budget_is_refused_naming_it(leases: Leases, bad: Any) -> None:
    with pytest.raises(ValueError, match="max_takeovers must be an int >= 1"):
        leases.instance(f"bad-{unique()}", max_takeovers=bad)
    b = leases.instance("B")
    graph = Pill().graph(b)
    if bad is None:
        return  # serve(max_takeovers=None) means the instance's budget
    with pytest.raises(ValueError, match="max_takeovers must be an int >= 1"):
        await b.serve({"pill": graph}, handle_signals=False, max_takeovers=bad)


async def test_a_taker_that_wrote_only_the_input_checkpoint_made_no_progress(
    leases: Leases,
) -> None:
    """The first holder died before any checkpoint; D, the first taker, runs from the
    recorded input, lands the run's input checkpoint (durability "async") and dies in the
    step. That checkpoint is not progress: E's take is D's crash counted, past a budget of
    one, and dead-letters the execution instead of starting one more worker on it."""
    thread = unique("report")
    key = LeaseKey("acme", thread)
    d_inside = asyncio.Event()
    runs: list[str] = []

    def graph(instance: Instance) -> Any:
        async def summarize(state: Order) -> dict[str, Any]:
            runs.append(instance.instance_id)
            if instance.instance_id == "D":
                d_inside.set()
                await asyncio.Event().wait()  # D dies here
            return {"log": [f"summarized by {instance.instance_id}"]}

        return one_step(instance, Order, "summarize", summarize, name="report")

    # The first holder: recorded and holding the lease, it died before its first checkpoint.
    first = await leases.store.acquire(key, "C", TTL)
    assert first is not None
    await leases.records.record(ExecutionRecord(key, "report", thread, {"log": []}))
    leases.advance(TTL + 1)
    d = leases.instance("D", max_takeovers=1)
    config = {"configurable": {"thread_id": thread, "tenant_id": "acme"}}
    async with serving(d, {"report": graph(d)}, durability="async"):
        await asyncio.wait_for(d_inside.wait(), 10)

        async def input_checkpoint_landed() -> bool:
            return await leases.saver.aget_tuple(config) is not None

        await eventually(input_checkpoint_landed)
        leases.stall(d)
        leases.advance(TTL + 1)
        e = leases.instance("E", max_takeovers=1)
        async with serving(e, {"report": graph(e)}, durability="async"):
            await until_status(leases, key, LeaseStatus.DEAD_LETTERED, LeaseStatus.DONE)
        leases.resume(d)
    lease = await leases.store.get(key)
    assert lease is not None
    assert lease.status is LeaseStatus.DEAD_LETTERED, (lease.status, lease.reason, runs)
    assert lease.reason is not None
    assert "the last D at token 2" in lease.reason
    assert "max_takeovers=1" in lease.reason
    assert runs == ["D"]  # E never ran the step

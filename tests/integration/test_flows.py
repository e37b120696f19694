"""LangGraph's documented flows under the fence, across two instances, on SQLite and PostgreSQL.

Each test runs one flow the way the LangGraph docs show it, with its runs split between
instance A and instance B on one database (the ``database`` fixture: a SQLite file, or a
PostgreSQL schema of the test's own). In each, every step records the token its fence
shows, and after each run the test checks that (1) every step of the run saw the run's
token, the lease's epoch, which grows by one per run, and (2) every checkpoint and write
row the run added carries that token: none is written under an older one.

The three flows the first version refused, ``Instance.ainvoke(None, ...)`` on an execution
that ended (resume after an error, time travel, fork after ``aupdate_state``), run here as
new runs at the next token.
"""

from __future__ import annotations

import operator
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from typing import Annotated, Any, TypedDict

import pytest
from langchain_core.language_models.fake_chat_models import GenericFakeChatModel
from langchain_core.messages import AIMessage
from langgraph.config import get_stream_writer
from langgraph.graph import END, START, StateGraph
from langgraph.types import Command, Send, interrupt
from sqlalchemy import text

from langgraph_fence import (
    Effect,
    ExecutionDeadLetteredError,
    ExecutionEndedError,
    ExecutionLeaseHeldError,
    Instance,
    LeaseKey,
    LeaseStatus,
    PendingEffect,
    fence_graph,
    get_execution_context,
)
from tests.support.databases import Database, engine_options, unique

TENANT = "acme"


class State(TypedDict, total=False):
    log: Annotated[list[str], operator.add]
    note: str


@dataclass
class Steps:
    """What the nodes saw: ``(node, token)`` per step, and the world's side effects."""

    seen: list[tuple[str, int]] = field(default_factory=list)
    charges: list[int] = field(default_factory=list)
    broken: bool = False

    def step(self, node: str) -> int:
        token = get_execution_context().fence.token
        self.seen.append((node, token))
        return token

    def take(self) -> list[tuple[str, int]]:
        taken, self.seen = self.seen, []
        return taken


@asynccontextmanager
async def two_instances(database: Database) -> AsyncIterator[tuple[Instance, Instance]]:
    options = engine_options(database.url, database.schema)
    async with (
        Instance.open(database.url, engine_options=options, instance_id="A") as a,
        Instance.open(database.url, engine_options=options, instance_id="B") as b,
    ):
        yield a, b


Rows = set[tuple[str, str, str, int | None]]


async def rows_of(instance: Instance, thread: str) -> Rows:
    """Every checkpoint and write row of the tenant's ``thread``, with its token."""
    engine = instance.repository.engine  # type: ignore[attr-defined]
    async with engine.connect() as conn:
        checkpoints = await conn.execute(
            text(
                "SELECT checkpoint_ns, checkpoint_id, fence_token FROM fence_checkpoints"
                " WHERE tenant_id = :tenant AND thread_id = :thread"
            ),
            {"tenant": TENANT, "thread": thread},
        )
        found: Rows = {("checkpoint", ns, cid, token) for ns, cid, token in checkpoints}
        writes = await conn.execute(
            text(
                "SELECT checkpoint_ns, checkpoint_id || '/' || task_id || '/' || idx,"
                " fence_token FROM fence_checkpoint_writes"
                " WHERE tenant_id = :tenant AND thread_id = :thread"
            ),
            {"tenant": TENANT, "thread": thread},
        )
        found |= {("write", ns, what, token) for ns, what, token in writes}
    return found


class Flow:
    """One thread driven through runs on either instance, each checked as it ends."""

    def __init__(self, a: Instance, b: Instance, steps: Steps) -> None:
        self.instances = {"A": a, "B": b}
        self.steps = steps
        self.thread = unique("flow")
        self.config: dict[str, Any] = {
            "configurable": {"thread_id": self.thread, "tenant_id": TENANT}
        }
        self.rows: Rows = set()
        self.tokens: list[int] = []

    async def run(
        self,
        on: str,
        graph: Any,
        value: Any,
        *,
        config: dict[str, Any] | None = None,
        expect_steps: bool = True,
        **kwargs: Any,
    ) -> Any:
        instance = self.instances[on]
        try:
            return await instance.ainvoke(
                graph, value, config or self.config, tenant_id=TENANT, **kwargs
            )
        finally:
            await self.check(instance, expect_steps=expect_steps)

    async def stream(self, on: str, graph: Any, value: Any, **kwargs: Any) -> list[Any]:
        instance = self.instances[on]
        chunks = [
            chunk
            async for chunk in instance.astream(
                graph, value, self.config, tenant_id=TENANT, **kwargs
            )
        ]
        await self.check(instance)
        return chunks

    async def check(self, instance: Instance, *, expect_steps: bool = True) -> None:
        """The run that just ended: every step and every new row under its token."""
        lease = await instance.repository.get(LeaseKey(TENANT, self.thread))
        assert lease is not None, lease
        assert lease.holder is None, lease
        token = lease.epoch
        assert token == len(self.tokens) + 1, f"one take per run: {self.tokens} then {token}"
        self.tokens.append(token)
        seen = self.steps.take()
        if expect_steps:
            assert seen, "the run ran no step"
        assert {t for _, t in seen} <= {token}, f"steps of run {token} saw {seen}"
        rows = await rows_of(instance, self.thread)
        new = rows - self.rows
        assert {row[-1] for row in new} <= {token}, f"rows of run {token}: {sorted(new)}"
        self.rows = rows

    async def history(self, graph: Any) -> list[Any]:
        return [s async for s in graph.aget_state_history(self.config)]


def node(steps: Steps, name: str) -> Any:
    """A step logging ``name@token``; sync when ``name`` starts with ``sync``."""
    if name.startswith("sync"):

        def run_sync(state: State) -> dict[str, Any]:
            return {"log": [f"{name}@{steps.step(name)}"]}

        return run_sync

    async def run(state: State) -> dict[str, Any]:
        return {"log": [f"{name}@{steps.step(name)}"]}

    return run


def chain(instance: Instance, steps: Steps, names: list[str], **effects: Effect) -> Any:
    builder = StateGraph(State)
    previous = START
    for name in names:
        builder.add_node(name, node(steps, name))
        builder.add_edge(previous, name)
        previous = name
    builder.add_edge(previous, END)
    return fence_graph(builder, effects=effects).compile(
        checkpointer=instance.checkpointer, name="chain"
    )


def asking(instance: Instance, steps: Steps) -> Any:
    """plan -> ask (interrupt) -> done."""

    async def ask(state: State) -> dict[str, Any]:
        token = steps.step("ask")
        answer = interrupt("approve?")
        return {"log": [f"ask:{answer}@{token}"]}

    builder = StateGraph(State)
    builder.add_node("plan", node(steps, "plan"))
    builder.add_node("ask", ask)
    builder.add_node("done", node(steps, "done"))
    builder.add_edge(START, "plan")
    builder.add_edge("plan", "ask")
    builder.add_edge("ask", "done")
    builder.add_edge("done", END)
    return fence_graph(builder).compile(checkpointer=instance.checkpointer, name="asking")


@pytest.fixture
async def flow(database: Database) -> AsyncIterator[Flow]:
    async with two_instances(database) as (a, b):
        yield Flow(a, b, Steps())


def graphs(flow: Flow, build: Any) -> tuple[Any, Any]:
    """The same graph compiled on A and on B (each process compiles its own)."""
    return build(flow.instances["A"], flow.steps), build(flow.instances["B"], flow.steps)


# -- interrupts, answered from the other instance


async def test_interrupt_resumed_from_the_other_instance(flow: Flow) -> None:
    on_a, on_b = graphs(flow, asking)
    out = await flow.run("A", on_a, {"log": []})
    assert [i.value for i in out["__interrupt__"]] == ["approve?"]
    out = await flow.run("B", on_b, Command(resume="yes"))
    assert out["log"] == ["plan@1", "ask:yes@2", "done@2"]
    assert flow.tokens == [1, 2]


def parallel_asks(instance: Instance, steps: Steps) -> Any:
    def ask(name: str) -> Any:
        async def run(state: State) -> dict[str, Any]:
            token = steps.step(name)
            return {"log": [f"{name}:{interrupt(name)}@{token}"]}

        return run

    builder = StateGraph(State)
    for name in ("left", "right"):
        builder.add_node(name, ask(name))
        builder.add_edge(START, name)
        builder.add_edge(name, "join")
    builder.add_node("join", node(steps, "join"))
    builder.add_edge("join", END)
    return fence_graph(builder).compile(checkpointer=instance.checkpointer, name="parallel")


async def test_parallel_interrupts_answered_with_a_resume_map(flow: Flow) -> None:
    on_a, on_b = graphs(flow, parallel_asks)
    out = await flow.run("A", on_a, {"log": []})
    answers = {i.id: f"ok-{i.value}" for i in out["__interrupt__"]}
    assert sorted(answers.values()) == ["ok-left", "ok-right"]
    out = await flow.run("B", on_b, Command(resume=answers))
    assert sorted(out["log"]) == ["join@2", "left:ok-left@2", "right:ok-right@2"]


def with_subgraph(instance: Instance, steps: Steps) -> Any:
    inner = StateGraph(State)
    inner.add_node("prepare", node(steps, "prepare"))

    async def confirm(state: State) -> dict[str, Any]:
        token = steps.step("confirm")
        return {"log": [f"confirm:{interrupt('confirm?')}@{token}"]}

    inner.add_node("confirm", confirm)
    inner.add_edge(START, "prepare")
    inner.add_edge("prepare", "confirm")
    inner.add_edge("confirm", END)
    sub = fence_graph(inner).compile(checkpointer=instance.checkpointer)

    async def outer_step(state: State) -> dict[str, Any]:
        steps.step("outer")
        result = await sub.ainvoke({"log": []})
        return {"log": result["log"]}

    builder = StateGraph(State)
    builder.add_node("outer", outer_step)
    builder.add_node("after", node(steps, "after"))
    builder.add_edge(START, "outer")
    builder.add_edge("outer", "after")
    builder.add_edge("after", END)
    return fence_graph(builder).compile(checkpointer=instance.checkpointer, name="nested")


async def test_an_interrupt_inside_a_subgraph_resumed_from_the_other_instance(flow: Flow) -> None:
    on_a, on_b = graphs(flow, with_subgraph)
    out = await flow.run("A", on_a, {"log": []})
    assert [i.value for i in out["__interrupt__"]] == ["confirm?"]
    out = await flow.run("B", on_b, Command(resume="sure"))
    # The subgraph's own checkpoints (a namespace of their own) carry the run's token too.
    assert any(ns for _, ns, _, _ in flow.rows), "the subgraph wrote no checkpoint of its own"
    assert out["log"] == ["prepare@1", "confirm:sure@2", "after@2"]


# -- control flow: Command(goto=...), Send


def routing(instance: Instance, steps: Steps) -> Any:
    async def route(state: State) -> Command[Any]:
        token = steps.step("route")
        return Command(goto="right", update={"log": [f"route@{token}"]})

    builder = StateGraph(State)
    builder.add_node("route", route, destinations=("left", "right"))
    builder.add_node("left", node(steps, "left"))
    builder.add_node("right", node(steps, "right"))
    builder.add_edge(START, "route")
    builder.add_edge("left", END)
    builder.add_edge("right", END)
    return fence_graph(builder).compile(checkpointer=instance.checkpointer, name="routing")


async def test_command_goto_on_either_instance(flow: Flow) -> None:
    on_a, on_b = graphs(flow, routing)
    out = await flow.run("A", on_a, {"log": []})
    assert out["log"] == ["route@1", "right@1"]
    out = await flow.run("B", on_b, {"log": []})  # a new turn on the finished thread
    assert out["log"][2:] == ["route@2", "right@2"]


def fan_out(instance: Instance, steps: Steps) -> Any:
    async def work(item: dict[str, str]) -> dict[str, Any]:
        return {"log": [f"work:{item['item']}@{steps.step('work')}"]}

    builder = StateGraph(State)
    builder.add_node("plan", node(steps, "plan"))
    builder.add_node("work", work)
    builder.add_edge(START, "plan")
    builder.add_conditional_edges(
        "plan", lambda state: [Send("work", {"item": i}) for i in ("x", "y", "z")], ["work"]
    )
    builder.add_edge("work", END)
    return fence_graph(builder).compile(checkpointer=instance.checkpointer, name="fan_out")


async def test_send_fan_out_on_either_instance(flow: Flow) -> None:
    on_a, on_b = graphs(flow, fan_out)
    out = await flow.run("A", on_a, {"log": []})
    assert sorted(out["log"]) == ["plan@1", "work:x@1", "work:y@1", "work:z@1"]
    out = await flow.run("B", on_b, {"log": []})
    assert sorted(out["log"][4:]) == ["plan@2", "work:x@2", "work:y@2", "work:z@2"]


# -- the flows the first version refused: resume after an error, time travel, fork


def charge_then_ship(instance: Instance, steps: Steps) -> Any:
    """charge (a non-idempotent write) -> ship (fails while ``steps.broken``)."""

    async def charge(state: State) -> dict[str, Any]:
        token = steps.step("charge")
        steps.charges.append(token)
        return {"log": [f"charge@{token}"]}

    async def ship(state: State) -> dict[str, Any]:
        token = steps.step("ship")
        if steps.broken:
            raise ConnectionError("the shipping API is down")
        return {"log": [f"ship@{token}"]}

    builder = StateGraph(State)
    builder.add_node("charge", charge)
    builder.add_node("ship", ship)
    builder.add_edge(START, "charge")
    builder.add_edge("charge", "ship")
    builder.add_edge("ship", END)
    return fence_graph(builder, effects={"charge": Effect.NON_IDEMPOTENT_WRITE}).compile(
        checkpointer=instance.checkpointer, name="orders"
    )


async def test_resume_after_an_error_does_not_repeat_the_charge(flow: Flow) -> None:
    on_a, on_b = graphs(flow, charge_then_ship)
    flow.steps.broken = True
    with pytest.raises(ConnectionError):
        await flow.run("A", on_a, {"log": []})
    lease = await flow.instances["A"].repository.get(LeaseKey(TENANT, flow.thread))
    assert lease is not None
    assert lease.status is LeaseStatus.FAILED
    assert lease.pending_effects == ()  # charge's writes landed, and cleared its stamp
    # The cause is fixed; LangGraph's fault-tolerance pattern: ainvoke(None) from the last
    # checkpoint, here on the other instance.
    flow.steps.broken = False
    out = await flow.run("B", on_b, None)
    assert out["log"] == ["charge@1", "ship@2"]
    assert flow.steps.charges == [1], "the charge behind the resumed checkpoint ran again"
    lease = await flow.instances["B"].repository.get(LeaseKey(TENANT, flow.thread))
    assert lease is not None
    assert lease.status is LeaseStatus.DONE
    assert lease.epoch == 2


async def test_time_travel_replays_a_done_execution_at_the_next_token(flow: Flow) -> None:
    # "sync_two" is a sync node: LangGraph runs it in a worker thread, fenced all the same.
    on_a, on_b = graphs(flow, lambda i, s: chain(i, s, ["one", "sync_two", "three"]))
    out = await flow.run("A", on_a, {"log": []})
    assert out["log"] == ["one@1", "sync_two@1", "three@1"]
    before_two = next(s for s in await flow.history(on_b) if s.next == ("sync_two",))
    out = await flow.run("B", on_b, None, config=before_two.config)
    assert out["log"] == ["one@1", "sync_two@2", "three@2"]
    latest = await on_b.aget_state(flow.config)
    assert latest.values["log"] == ["one@1", "sync_two@2", "three@2"]
    assert latest.next == ()
    lease = await flow.instances["B"].repository.get(LeaseKey(TENANT, flow.thread))
    assert lease is not None
    assert lease.status is LeaseStatus.DONE
    # The replay forked from the past checkpoint; the first branch is still there, as it was.
    replayed = [s for s in await flow.history(on_b) if s.values.get("log") == out["log"]]
    assert replayed
    assert replayed[0].parent_config is not None


async def test_fork_after_update_state_runs_at_the_next_token(flow: Flow) -> None:
    on_a, on_b = graphs(flow, lambda i, s: chain(i, s, ["one", "two", "three"]))
    await flow.run("A", on_a, {"log": []})
    before_two = next(s for s in await flow.history(on_b) if s.next == ("two",))
    b = flow.instances["B"]
    # The edit is a run of its own: the lease at the next token, its checkpoint under it.
    forked = await b.aupdate_state(on_b, before_two.config, {"note": "edited"}, tenant_id=TENANT)
    await flow.check(b, expect_steps=False)
    lease = await b.repository.get(LeaseKey(TENANT, flow.thread))
    assert lease is not None, "steps are left to run"
    assert lease.status is LeaseStatus.WAITING, "steps are left to run"
    out = await flow.run("B", on_b, None, config=forked)
    assert out["log"] == ["one@1", "two@3", "three@3"]
    assert out["note"] == "edited"
    assert flow.tokens == [1, 2, 3]
    lease = await b.repository.get(LeaseKey(TENANT, flow.thread))
    assert lease is not None
    assert lease.status is LeaseStatus.DONE


async def test_update_state_is_refused_while_another_instance_holds_the_lease(
    flow: Flow,
) -> None:
    _, on_b = graphs(flow, lambda i, s: chain(i, s, ["one"]))
    held = await flow.instances["A"].repository.acquire(LeaseKey(TENANT, flow.thread), "A", 60.0)
    assert held is not None
    with pytest.raises(ExecutionLeaseHeldError, match="held by instance 'A'"):
        await flow.instances["B"].aupdate_state(
            on_b, flow.config, {"note": "sneaked in"}, as_node="one", tenant_id=TENANT
        )
    assert await rows_of(flow.instances["B"], flow.thread) == set(), "the refused edit wrote"


async def test_resume_of_a_failed_execution_with_a_standing_stamp_is_dead_lettered(
    flow: Flow,
) -> None:
    # A run that failed while a non-idempotent write was stamped and never cleared (its
    # worker's connection died mid-charge): the charge may have happened.
    _, on_b = graphs(flow, charge_then_ship)
    repository = flow.instances["A"].repository
    key = LeaseKey(TENANT, flow.thread)
    lease = await repository.acquire(key, "A", 60.0)
    assert lease is not None
    stamp = PendingEffect(Effect.NON_IDEMPOTENT_WRITE, "charge", "task-1", lease.epoch)
    lease = await repository.mark_pending_effect(lease, stamp, 60.0)
    await repository.release(lease, LeaseStatus.FAILED, "ConnectionError: lost mid-charge")
    with pytest.raises(ExecutionDeadLetteredError, match="node 'charge' at token 1"):
        await flow.instances["B"].ainvoke(on_b, None, flow.config, tenant_id=TENANT)
    ended = await repository.get(key)
    assert ended is not None
    assert ended.status is LeaseStatus.DEAD_LETTERED
    assert flow.steps.seen == []
    assert flow.steps.charges == []


async def test_resume_of_a_done_execution_with_nothing_left_runs_nothing(flow: Flow) -> None:
    on_a, on_b = graphs(flow, lambda i, s: chain(i, s, ["one"]))
    await flow.run("A", on_a, {"log": []})
    out = await flow.run("B", on_b, None, expect_steps=False)
    assert out["log"] == ["one@1"]  # as LangGraph without the fence: nothing to run


async def test_live_holder_and_dead_letter_are_told_apart(flow: Flow) -> None:
    a, b = flow.instances["A"], flow.instances["B"]
    graph = chain(b, flow.steps, ["one"])
    key = LeaseKey(TENANT, flow.thread)
    held = await a.repository.acquire(key, "A", 60.0)
    assert held is not None
    with pytest.raises(ExecutionLeaseHeldError, match="held by instance 'A' at token 1") as live:
        await b.ainvoke(graph, None, flow.config, tenant_id=TENANT)
    assert live.value.code == "execution.lease-held"
    await a.repository.dead_letter(key, "charge at token 1 may have happened", epoch=1)
    with pytest.raises(ExecutionEndedError, match="resolve --retry") as ended:
        await b.ainvoke(graph, None, flow.config, tenant_id=TENANT)
    assert ended.value.code == "execution.ended"
    assert ended.value.status == "dead_lettered"
    assert "new input" not in str(ended.value)
    # New input does not reopen it either: an operator's resolve does.
    with pytest.raises(ExecutionEndedError):
        await b.ainvoke(graph, {"log": []}, flow.config, tenant_id=TENANT)
    assert flow.steps.seen == []


# -- durability modes and stream modes


@pytest.mark.parametrize("durability", ["sync", "async", "exit"])
async def test_each_durability_mode_across_instances(flow: Flow, durability: str) -> None:
    on_a, on_b = graphs(flow, asking)
    await flow.run("A", on_a, {"log": []}, durability=durability)
    out = await flow.run("B", on_b, Command(resume="yes"), durability=durability)
    assert out["log"] == ["plan@1", "ask:yes@2", "done@2"]


def streaming(instance: Instance, steps: Steps) -> Any:
    model = GenericFakeChatModel(messages=iter([AIMessage("hello there")]))

    async def talk(state: State) -> dict[str, Any]:
        token = steps.step("talk")
        get_stream_writer()({"custom": token})
        reply = await model.ainvoke("hi")
        return {"log": [f"talk:{reply.content}@{token}"]}

    builder = StateGraph(State)
    builder.add_node("plan", node(steps, "plan"))
    builder.add_node("talk", talk)
    builder.add_edge(START, "plan")
    builder.add_edge("plan", "talk")
    builder.add_edge("talk", END)
    return fence_graph(builder).compile(checkpointer=instance.checkpointer, name="streaming")


@pytest.mark.parametrize("stream_mode", ["values", "updates", "messages", "custom", "debug"])
async def test_each_stream_mode_across_instances(flow: Flow, stream_mode: str) -> None:
    # A new model per run: GenericFakeChatModel answers from an iterator, once.
    await flow.stream("A", streaming(flow.instances["A"], flow.steps), {"log": []})
    chunks = await flow.stream(
        "B", streaming(flow.instances["B"], flow.steps), {"log": []}, stream_mode=stream_mode
    )
    assert chunks, f"nothing streamed in {stream_mode} mode"
    if stream_mode == "values":
        assert chunks[-1]["log"][-2:] == ["plan@2", "talk:hello there@2"]
    elif stream_mode == "updates":
        assert chunks[-1] == {"talk": {"log": ["talk:hello there@2"]}}
    elif stream_mode == "messages":
        assert "".join(str(message.content) for message, _ in chunks) == "hello there"
    elif stream_mode == "custom":
        assert chunks == [{"custom": 2}]
    else:
        tasks = [c for c in chunks if c["type"] == "task_result"]
        assert {c["payload"]["name"] for c in tasks} == {"plan", "talk"}

"""fence_tools: lease-before-op for each LangChain tool call, on real SQLite and PostgreSQL.

Every graph here is a ``ToolNode`` (or a ``create_react_agent`` loop driven by a scripted chat
model) passed through ``fence_graph`` and run by ``Instance.ainvoke``. A recording wrapper
around the lease repository and a recording subclass of the SQL saver write one event log, so
the tests assert the ORDER: stamp -> tool body -> the step's writes, which clear the stamp.
"""

from __future__ import annotations

import asyncio
import inspect
import warnings
from collections.abc import AsyncIterator, Callable, Sequence
from dataclasses import dataclass, field, replace
from typing import Annotated, Any, TypedDict

import pytest
from langchain_core.messages import AIMessage, AnyMessage, ToolMessage
from langchain_core.runnables import RunnableConfig
from langchain_core.tools import BaseTool, StructuredTool, tool
from langchain_core.utils.function_calling import convert_to_openai_tool
from langgraph.graph import END, START, StateGraph
from langgraph.graph.message import add_messages
from langgraph.prebuilt import ToolNode
from langgraph.types import RetryPolicy
from sqlalchemy.ext.asyncio import AsyncEngine

from checkpointers import SqlCheckpointer
from langgraph_fence import (
    Effect,
    ExecutionContextUnavailableError,
    ExecutionDeadLetteredError,
    ExecutionFencedError,
    Instance,
    LeaseKey,
    LeaseStatus,
    PendingEffect,
    SqlLeaseRepository,
    fence_graph,
    fence_tools,
    fenced,
    get_execution_context,
)
from langgraph_fence.effects import EFFECT_ATTRIBUTE
from langgraph_fence.errors import WriteDeadLetteredError
from langgraph_fence.keys import FENCE_CONFIG_KEY
from langgraph_fence.lease import Lease
from langgraph_fence.testing import ManualClock, run_node
from tests.support.agents import ScriptedModel
from tests.support.databases import SQL_BACKENDS, unique

RUNS_ON = SQL_BACKENDS

TENANT = "acme"
WAIT = 20.0  # seconds a test waits for an event before it fails


class State(TypedDict):
    messages: Annotated[list[AnyMessage], add_messages]


def bare(effect: PendingEffect | None) -> PendingEffect | None:
    """``effect`` without the fields a test cannot know (its superstep, its call's id)."""
    return None if effect is None else replace(effect, checkpoint_id="", call="")


class Recorder:
    """A lease repository that writes each completed call into the test's event log."""

    def __init__(self, inner: SqlLeaseRepository, events: list[tuple[Any, ...]]) -> None:
        self.inner = inner
        self.events = events

    @property
    def store_id(self) -> str:
        return self.inner.store_id

    def __getattr__(self, name: str) -> Any:
        method = getattr(self.inner, name)
        if not inspect.iscoroutinefunction(method):
            return method

        async def recorded(*args: Any, **kwargs: Any) -> Any:
            if name == "mark_pending_effect":
                stamp: PendingEffect = args[1]
                self.events.append(("stamp-sent", stamp.effect, stamp.node))
            result = await method(*args, **kwargs)
            if name == "mark_pending_effect":
                self.events.append(("stamp", stamp.effect, stamp.node, stamp.task_id))
            else:
                self.events.append((name,))
            return result

        return recorded


class RecordingSaver(SqlCheckpointer):
    """The project's SQL saver, logging each landed task write with the stamp seen after it."""

    events: list[tuple[Any, ...]]

    async def aput_writes(
        self,
        config: RunnableConfig,
        writes: Sequence[tuple[str, Any]],
        task_id: str,
        task_path: str = "",
    ) -> None:
        await super().aput_writes(config, writes, task_id, task_path)
        handle = config["configurable"].get(FENCE_CONFIG_KEY)
        if handle is not None:
            # Read before any await: the next checkpoint may clear the entries any moment.
            # Writes clear the task's entries only where their checkpoint is stored (under
            # durability="async" it may still be on its way: the next checkpoint clears).
            mine = any(e.task_id == task_id for e in handle.pending_effects.values())
            self.events.append(("writes", task_id, "standing" if mine else "cleared"))


@dataclass
class Env:
    """Instances on one real database, their store's clock, and the shared event log."""

    engine: AsyncEngine
    store: SqlLeaseRepository
    saver: RecordingSaver
    store_clock: ManualClock
    events: list[tuple[Any, ...]] = field(default_factory=list)
    instances: list[Instance] = field(default_factory=list)

    def instance(self, name: str | None = None) -> Instance:
        # The instance's own clock never moves: its timers never fire and its hold stays
        # proven, so only what a test does from outside changes the lease.
        frozen = ManualClock()
        inst = Instance(
            Recorder(self.store, self.events),  # type: ignore[arg-type]
            self.saver,
            instance_id=name or unique("inst"),
            lease_ttl=30.0,
            clock=frozen,
            sleep=frozen.sleep,
        )
        self.instances.append(inst)
        return inst

    async def row(self, thread: str) -> Lease:
        lease = await self.store.get(LeaseKey(TENANT, thread))
        assert lease is not None
        return lease

    async def take_over(self, thread: str) -> Lease:
        """Take the lease from outside, as another worker would once it expired."""
        self.store_clock.advance(60.0)
        lease = await self.store.acquire(LeaseKey(TENANT, thread), "outsider", 30.0)
        assert lease is not None, "the lease could not be taken over"
        return lease

    def of(self, kind: str) -> list[tuple[Any, ...]]:
        return [e for e in self.events if e[0] == kind]


@pytest.fixture
async def env(backend: str, make_engine: Callable[[str], AsyncEngine]) -> AsyncIterator[Env]:
    engine = make_engine(backend)
    store_clock = ManualClock()
    store = SqlLeaseRepository(engine, clock=store_clock)
    await store.setup()
    saver = RecordingSaver(engine)
    await saver.setup()
    fixture = Env(engine, store, saver, store_clock)
    saver.events = fixture.events
    yield fixture
    for inst in fixture.instances:
        await inst.aclose()
    await engine.dispose()


def calls(*named: tuple[str, dict[str, Any]]) -> dict[str, list[AnyMessage]]:
    """The state a ToolNode runs on: one AI message asking for ``named`` tool calls."""
    tool_calls = [
        {"name": name, "args": args, "id": f"call-{i}", "type": "tool_call"}
        for i, (name, args) in enumerate(named)
    ]
    return {"messages": [AIMessage("", tool_calls=tool_calls)]}  # type: ignore[arg-type]


def tool_graph(
    instance: Instance,
    tools: Sequence[BaseTool],
    *,
    retry: RetryPolicy | None = None,
    handle_tool_errors: Any = None,
    wrap: Any = None,
) -> Any:
    options: dict[str, Any] = {}
    if handle_tool_errors is not None:
        options["handle_tool_errors"] = handle_tool_errors
    if wrap is not None:
        options["awrap_tool_call"] = wrap
    builder = StateGraph(State)
    builder.add_node("tools", ToolNode(list(tools), **options), retry_policy=retry)
    builder.add_edge(START, "tools")
    builder.add_edge("tools", END)
    return fence_graph(builder).compile(checkpointer=instance.checkpointer, name="graph")


async def run(instance: Instance, graph: Any, state: Any, thread: str, **kwargs: Any) -> Any:
    config: RunnableConfig = {"configurable": {"thread_id": thread}}
    return await instance.ainvoke(graph, state, config, tenant_id=TENANT, **kwargs)


def messages(out: dict[str, Any]) -> list[tuple[str, Any, str]]:
    return [
        (m.tool_call_id, m.content, m.status) for m in out["messages"] if isinstance(m, ToolMessage)
    ]


# -- read-only tools


async def test_a_read_only_tool_runs_under_the_lease_and_writes_nothing(env: Env) -> None:
    instance = env.instance()
    thread = unique("thread")
    seen: list[tuple[str, int, PendingEffect | None]] = []

    @tool
    async def look_up(order: str) -> str:
        """Look an order up."""
        frame = get_execution_context()
        seen.append(("async", frame.fence.token, (await env.row(thread)).pending_effect))
        return f"{order}: shipped"

    loop = asyncio.get_running_loop()

    @tool
    def price(order: str) -> str:
        """Price an order (a sync tool: ToolNode runs it in a worker thread)."""
        frame = get_execution_context()  # the frame reached the thread
        row = asyncio.run_coroutine_threadsafe(env.row(thread), loop).result(WAIT)
        seen.append(("sync", frame.fence.token, row.pending_effect))
        return "42"

    tools = fence_tools(
        [look_up, price], effects={"look_up": Effect.READ_ONLY, "price": Effect.READ_ONLY}
    )
    graph = tool_graph(instance, tools)
    out = await run(
        instance, graph, calls(("look_up", {"order": "o1"}), ("price", {"order": "o1"})), thread
    )

    assert messages(out) == [("call-0", "o1: shipped", "success"), ("call-1", "42", "success")]
    assert sorted(seen) == [("async", 1, None), ("sync", 1, None)]
    # Counted at the repository: no stamp, no clear, no renewal for a read.
    assert env.of("stamp-sent") == []
    assert env.of("clear_pending_effects") == []
    assert env.of("renew") == []
    assert (await env.row(thread)).status is LeaseStatus.DONE


# -- write tools: stamped before the body, cleared with the step's writes


@pytest.mark.parametrize("declared", [Effect.IDEMPOTENT_WRITE, Effect.NON_IDEMPOTENT_WRITE, None])
@pytest.mark.parametrize("kind", ["async", "sync"])
async def test_a_write_tool_is_stamped_before_its_body_and_cleared_with_the_steps_writes(
    env: Env, declared: Effect | None, kind: str
) -> None:
    instance = env.instance()
    thread = unique("thread")
    expected = declared or Effect.NON_IDEMPOTENT_WRITE  # undeclared tools fail closed
    bodies: list[tuple[str, PendingEffect | None, PendingEffect]] = []
    loop = asyncio.get_running_loop()

    def body(order: str, row: Lease) -> str:
        frame = get_execution_context()
        wanted = PendingEffect(expected, "tools:charge", frame.task_id, frame.fence.token)
        bodies.append((frame.task_id, bare(row.pending_effect), wanted))
        env.events.append(("body", "charge", frame.task_id))
        return f"charged {order}"

    if kind == "async":

        async def charge_async(order: str) -> str:
            """Charge an order."""
            return body(order, await env.row(thread))

        original = StructuredTool.from_function(coroutine=charge_async, name="charge")
    else:

        def charge_sync(order: str) -> str:
            """Charge an order."""
            row = asyncio.run_coroutine_threadsafe(env.row(thread), loop).result(WAIT)
            return body(order, row)

        original = StructuredTool.from_function(func=charge_sync, name="charge")

    effects = {} if declared is None else {"charge": declared}
    graph = tool_graph(instance, fence_tools([original], effects=effects))
    # durability="sync": the step's checkpoint is stored before it runs, so its writes clear.
    out = await run(instance, graph, calls(("charge", {"order": "o1"})), thread, durability="sync")

    assert messages(out) == [("call-0", "charged o1", "success")]
    [(task_id, stamp_in_body, wanted)] = bodies
    assert stamp_in_body == wanted  # the row carried this call's stamp when the body ran
    order = [e for e in env.events if e[0] in ("stamp", "body") or e[:2] == ("writes", task_id)]
    assert order[:3] == [
        ("stamp", expected, "tools:charge", task_id),
        ("body", "charge", task_id),
        # The step's writes cleared the row and the handle where their checkpoint was stored.
        ("writes", task_id, "cleared"),
    ]
    # Cleared inside the saver's write (one statement / transaction), not by another call.
    assert env.of("clear_pending_effects") == []
    final = await env.row(thread)
    assert final.status is LeaseStatus.DONE
    assert final.pending_effect is None


async def test_a_sync_node_calling_a_tool_stamps_from_its_worker_thread(env: Env) -> None:
    instance = env.instance()
    thread = unique("thread")
    ran: list[str] = []

    @tool
    def send_mail(to: str) -> str:
        """Send a mail."""
        ran.append(to)
        return "sent"

    [mail] = fence_tools([send_mail])

    @fenced(effect=Effect.READ_ONLY)
    def notify(state: State) -> dict[str, Any]:  # a sync node: LangGraph runs it in a thread
        return {"messages": [AIMessage(mail.invoke({"to": "ops@example.com"}))]}

    @fenced(effect=Effect.READ_ONLY)
    async def remind(state: State) -> dict[str, Any]:
        # The async path of a sync-only tool runs its body in a thread: stamped once.
        return {"messages": [AIMessage(await mail.arun({"to": "dev@example.com"}))]}

    builder = StateGraph(State)
    builder.add_node("notify", notify)
    builder.add_node("remind", remind)
    builder.add_edge(START, "notify")
    builder.add_edge("notify", "remind")
    builder.add_edge("remind", END)
    graph = fence_graph(builder).compile(checkpointer=instance.checkpointer, name="graph")
    # durability="sync": notify's writes land before remind stamps. With "async" a late
    # write of notify's task can still forget remind's stamp on the handle (a saver race).
    out = await run(instance, graph, {"messages": []}, thread, durability="sync")

    assert [m.content for m in out["messages"]] == ["sent", "sent"]
    assert ran == ["ops@example.com", "dev@example.com"]
    assert [s[1:3] for s in env.of("stamp")] == [
        (Effect.NON_IDEMPOTENT_WRITE, "notify:send_mail"),
        (Effect.NON_IDEMPOTENT_WRITE, "remind:send_mail"),
    ]
    assert (await env.row(thread)).pending_effect is None


# -- a lost lease


@pytest.mark.parametrize("declared", [Effect.IDEMPOTENT_WRITE, Effect.NON_IDEMPOTENT_WRITE, None])
@pytest.mark.parametrize("handle_tool_errors", [None, True])
async def test_a_lost_lease_stops_the_call_before_the_body(
    env: Env, declared: Effect | None, handle_tool_errors: bool | None
) -> None:
    instance = env.instance()
    thread = unique("thread")
    ran: list[str] = []

    @tool
    async def charge(order: str) -> str:
        """Charge an order."""
        ran.append(order)
        return "charged"

    async def take_over_first(request: Any, execute: Any) -> Any:
        # Inside the tools step, right before the tool call: another worker takes over.
        await env.take_over(thread)
        return await execute(request)

    effects = {} if declared is None else {"charge": declared}
    graph = tool_graph(
        instance,
        fence_tools([charge], effects=effects),
        wrap=take_over_first,
        handle_tool_errors=handle_tool_errors,
    )
    with pytest.raises(ExecutionFencedError) as info:
        await run(instance, graph, calls(("charge", {"order": "o1"})), thread)

    assert ran == []  # the side effect never happened
    assert env.of("stamp") == []  # the guarded stamp was refused: it changed nothing
    assert len(env.of("stamp-sent")) == 1
    assert info.value.token_held == 1
    assert info.value.token_seen == 2
    row = await env.row(thread)
    assert (row.epoch, row.holder, row.pending_effect) == (2, "outsider", None)
    # Even where ToolNode turns errors into messages, no ToolMessage was checkpointed.
    state = await instance.checkpointer.aget_tuple(
        {"configurable": {"thread_id": thread, "tenant_id": TENANT}}
    )
    assert state is None or not any(
        isinstance(m, ToolMessage) for m in state.checkpoint["channel_values"].get("messages", [])
    )


# -- failures: dead letters and retries


@pytest.mark.parametrize("kind", ["async", "sync"])
@pytest.mark.parametrize("handle_tool_errors", [None, True])
async def test_a_failed_non_idempotent_call_is_dead_lettered_never_retried(
    env: Env, kind: str, handle_tool_errors: bool | None
) -> None:
    instance = env.instance()
    thread = unique("thread")
    ran: list[int] = []

    def fail() -> str:
        ran.append(get_execution_context().attempt)
        raise ConnectionError("the payment provider hung up mid-request")

    async def charge_async(order: str) -> str:
        """Charge an order."""
        return fail()

    def charge_sync(order: str) -> str:
        """Charge an order."""
        return fail()

    if kind == "async":
        original = StructuredTool.from_function(coroutine=charge_async, name="charge")
    else:
        original = StructuredTool.from_function(func=charge_sync, name="charge")
    graph = tool_graph(
        instance,
        fence_tools([original]),
        # Retries everything, and ToolNode (with True) would report any error to the model.
        retry=RetryPolicy(retry_on=Exception, max_attempts=5, initial_interval=0.001),
        handle_tool_errors=handle_tool_errors,
    )
    with pytest.raises(ExecutionDeadLetteredError) as info:
        await run(instance, graph, calls(("charge", {"order": "o1"})), thread)

    assert isinstance(info.value, WriteDeadLetteredError)
    assert isinstance(info.value.__cause__, ConnectionError)
    assert ran == [1]  # exactly once: not retried, not handed back to the model
    row = await env.row(thread)
    assert row.status is LeaseStatus.DEAD_LETTERED
    assert row.reason is not None
    assert "'charge'" in row.reason
    assert "hung up" in row.reason
    # The stamp stands: whoever looks next sees a non-idempotent write that may have run.
    assert row.pending_effect is not None
    assert row.pending_effect.effect is Effect.NON_IDEMPOTENT_WRITE


async def test_a_failed_idempotent_call_is_retried_as_declared(env: Env) -> None:
    instance = env.instance()
    thread = unique("thread")
    attempts: list[int] = []

    @tool
    async def upsert(order: str) -> str:
        """Upsert an order."""
        attempts.append(get_execution_context().attempt)
        if len(attempts) < 3:
            raise ConnectionError("transient")
        return "upserted"

    graph = tool_graph(
        instance,
        fence_tools([upsert], effects={"upsert": Effect.IDEMPOTENT_WRITE}),
        retry=RetryPolicy(retry_on=ConnectionError, initial_interval=0.001, jitter=False),
    )
    out = await run(instance, graph, calls(("upsert", {"order": "o1"})), thread)
    assert messages(out) == [("call-0", "upserted", "success")]
    assert attempts == [1, 2, 3]
    assert [s[1] for s in env.of("stamp")] == [Effect.IDEMPOTENT_WRITE] * 3
    row = await env.row(thread)
    assert row.status is LeaseStatus.DONE
    assert row.pending_effect is None


async def test_a_retry_after_a_non_idempotent_call_runs_nothing(env: Env) -> None:
    instance = env.instance()
    thread = unique("thread")
    charged: list[int] = []
    checked: list[int] = []
    charge_done = asyncio.Event()

    @tool
    async def charge(order: str) -> str:
        """Charge an order."""
        charged.append(get_execution_context().attempt)
        charge_done.set()
        return "charged"

    @tool
    async def check_stock(order: str) -> str:
        """Check the stock (read-only; fails once, after the charge went through)."""
        checked.append(get_execution_context().attempt)
        await asyncio.wait_for(charge_done.wait(), WAIT)
        raise ConnectionError("stock service timed out")

    graph = tool_graph(
        instance,
        fence_tools([charge, check_stock], effects={"check_stock": Effect.READ_ONLY}),
        retry=RetryPolicy(retry_on=ConnectionError, initial_interval=0.001, jitter=False),
    )
    # The step failed with a non-idempotent stamp of its own standing: dead-lettered at
    # once, no retried attempt (it would have been refused before running anything).
    with pytest.raises(WriteDeadLetteredError, match="not retried"):
        await run(
            instance,
            graph,
            calls(("charge", {"order": "o1"}), ("check_stock", {"order": "o1"})),
            thread,
        )
    assert charged == [1]  # no attempt charged again
    assert checked == [1]  # nor ran anything else
    assert (await env.row(thread)).status is LeaseStatus.DEAD_LETTERED


# -- parallel tool calls: a stamp never downgrades within a step


@pytest.mark.parametrize("first", ["charge", "refresh"])
async def test_parallel_tool_calls_stamp_entries_of_their_own_and_a_takeover_dead_letters(
    env: Env, first: str
) -> None:
    instance = env.instance()
    thread = unique("thread")
    ran: dict[str, int] = {"charge": 0, "refresh": 0}
    started = {"charge": asyncio.Event(), "refresh": asyncio.Event()}
    both_in = asyncio.Event()
    release = asyncio.Event()
    other = {"charge": "refresh", "refresh": "charge"}

    async def body(name: str) -> str:
        ran[name] += 1
        started[name].set()
        if ran["charge"] + ran["refresh"] == 2:
            both_in.set()
        await asyncio.wait_for(release.wait(), WAIT)
        return name

    async def in_order(name: str) -> None:
        # The second tool's stamp goes out only after the first tool's body has begun.
        if name != first:
            await asyncio.wait_for(started[other[name]].wait(), WAIT)

    @tool
    async def charge(order: str) -> str:
        """Charge an order (non-idempotent)."""
        return await body("charge")

    @tool
    async def refresh(order: str) -> str:
        """Refresh a cache (idempotent)."""
        return await body("refresh")

    async def ordered(request: Any, execute: Any) -> Any:
        await in_order(request.tool_call["name"])
        return await execute(request)

    graph = tool_graph(
        instance,
        fence_tools([charge, refresh], effects={"refresh": Effect.IDEMPOTENT_WRITE}),
        wrap=ordered,
    )
    state = calls(("charge", {"order": "o1"}), ("refresh", {"order": "o1"}))
    run_a = asyncio.create_task(run(instance, graph, state, thread))
    await asyncio.wait_for(both_in.wait(), WAIT)

    row = await env.row(thread)
    # Both calls' entries stand side by side: neither replaced nor cleared the other.
    assert sorted((e.effect, e.node) for e in row.pending_effects) == [
        (Effect.IDEMPOTENT_WRITE, "tools:refresh"),
        (Effect.NON_IDEMPOTENT_WRITE, "tools:charge"),
    ]
    stamped = [s[1:3] for s in env.of("stamp")]
    assert stamped[0][1] == f"tools:{first}"

    # The worker freezes here; its lease expires; another instance takes the thread over.
    env.store_clock.advance(60.0)
    taker = env.instance("taker")
    with pytest.raises(ExecutionDeadLetteredError, match="tools:charge"):
        await run(taker, graph, None, thread)
    release.set()
    with pytest.raises(ExecutionFencedError):
        await asyncio.wait_for(run_a, WAIT)
    assert ran == {"charge": 1, "refresh": 1}  # nothing was repeated
    assert (await env.row(thread)).status is LeaseStatus.DEAD_LETTERED


# -- a create_react_agent loop driven by a scripted chat model


async def test_a_react_agent_loop_fences_each_call_of_its_tools(env: Env) -> None:
    from langgraph.prebuilt import create_react_agent

    instance = env.instance()
    thread = unique("thread")
    refunds: list[str] = []

    @tool
    async def find_order(customer: str) -> str:
        """Find a customer's last order."""
        assert (await env.row(thread)).pending_effect is None
        return "o-17"

    @tool
    async def refund(order: str) -> str:
        """Refund an order."""
        frame = get_execution_context()
        assert bare((await env.row(thread)).pending_effect) == PendingEffect(
            Effect.NON_IDEMPOTENT_WRITE, "tools:refund", frame.task_id, frame.fence.token
        )
        env.events.append(("body", "refund", frame.task_id))
        refunds.append(order)
        return "refunded"

    model = ScriptedModel(
        turns=[
            AIMessage(
                "", tool_calls=[{"name": "find_order", "args": {"customer": "c1"}, "id": "a"}]
            ),
            AIMessage("", tool_calls=[{"name": "refund", "args": {"order": "o-17"}, "id": "b"}]),
            AIMessage("Refunded o-17."),
        ]
    )
    tools = fence_tools([find_order, refund], effects={"find_order": Effect.READ_ONLY})
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # create_react_agent is deprecated upstream, still used
        agent = create_react_agent(model, tools)
    graph = fence_graph(agent.builder).compile(checkpointer=instance.checkpointer, name="graph")
    out = await run(instance, graph, {"messages": [("user", "refund my last order")]}, thread)

    assert out["messages"][-1].content == "Refunded o-17."
    assert messages(out) == [("a", "o-17", "success"), ("b", "refunded", "success")]
    assert refunds == ["o-17"]
    [stamp] = env.of("stamp")  # one write tool call, one stamp; the read cost nothing
    [(_, _, task_id)] = env.of("body")
    assert stamp == ("stamp", Effect.NON_IDEMPOTENT_WRITE, "tools:refund", task_id)
    order = [e for e in env.events if e[0] in ("stamp", "body") or e[:2] == ("writes", task_id)]
    assert order[:2] == [stamp, ("body", "refund", task_id)]
    assert order[2][:2] == ("writes", task_id)  # cleared now, or by the next checkpoint
    row = await env.row(thread)
    assert row.status is LeaseStatus.DONE
    assert row.pending_effect is None


# -- outside a fenced step, and what a fenced tool keeps


async def test_a_fenced_tool_called_outside_a_fenced_step_refuses_saying_how_to_run_it() -> None:
    ran: list[str] = []

    @tool
    def lookup(order: str) -> str:
        """Look an order up."""
        ran.append(order)
        return "ok"

    [fenced_lookup] = fence_tools([lookup], effects={"lookup": Effect.READ_ONLY})

    async def call_it(call: Callable[[dict[str, str]], object]) -> None:
        result = call({"order": "o1"})  # invoke refuses here, ainvoke when awaited
        if asyncio.iscoroutine(result):
            await result

    for call in (fenced_lookup.invoke, fenced_lookup.ainvoke):
        with pytest.raises(ExecutionContextUnavailableError) as info:
            await call_it(call)
        for hint in ("fence_graph", "Instance.ainvoke", "run_node", "'lookup'"):
            assert hint in str(info.value)
    assert ran == []


async def test_a_fenced_tool_keeps_its_name_schema_kind_and_tool_messages() -> None:
    @tool(response_format="content_and_artifact")
    def quote(order: str, quantity: int = 1) -> tuple[str, dict[str, int]]:
        """Quote a price for an order."""
        return f"{quantity} x {order}", {"cents": 250 * quantity}

    async def ship(order: str) -> str:
        """Ship an order."""
        return f"shipped {order}"

    original_ship = StructuredTool.from_function(coroutine=ship)
    fenced_quote, fenced_ship = fence_tools(
        [quote, original_ship], effects={"quote": Effect.READ_ONLY, "ship": Effect.READ_ONLY}
    )
    for before, after in ((quote, fenced_quote), (original_ship, fenced_ship)):
        assert isinstance(after, type(before))
        assert after.name == before.name
        assert after.description == before.description
        assert after.args == before.args
        assert after.get_input_jsonschema() == before.get_input_jsonschema()
        assert after.args_schema is before.args_schema
        # What bind_tools() sends the model is the same.
        assert convert_to_openai_tool(after) == convert_to_openai_tool(before)
        assert after.response_format == before.response_format
        assert after.return_direct == before.return_direct
    assert fenced_quote.func is quote.func  # type: ignore[attr-defined]
    assert fenced_quote.coroutine is None  # type: ignore[attr-defined]
    assert fenced_ship.func is None  # type: ignore[attr-defined]
    assert fenced_ship.coroutine is ship  # type: ignore[attr-defined]

    call = {
        "name": "quote",
        "args": {"order": "o1", "quantity": 2},
        "id": "c9",
        "type": "tool_call",
    }

    @fenced
    async def node(state: dict[str, Any]) -> dict[str, Any]:
        return {"sync": fenced_quote.invoke(call), "async": await fenced_quote.ainvoke(call)}

    expected = quote.invoke(call)
    out = await run_node(node, {})
    for got in (out["sync"], out["async"]):
        assert isinstance(got, ToolMessage)
        assert (got.content, got.artifact, got.tool_call_id, got.name, got.status) == (
            expected.content,
            expected.artifact,
            expected.tool_call_id,
            expected.name,
            expected.status,
        )


# -- bad input


def test_bad_input_is_refused_naming_what_is_wrong() -> None:
    @tool
    def a(x: int) -> int:
        """A."""
        return x

    @tool
    def b(x: int) -> int:
        """B."""
        return x

    def plain(x: int) -> int:
        """A plain function, made into a tool as ToolNode does."""
        return x

    with pytest.raises(ValueError, match=r"effects\['a'\] must be an Effect: one of"):
        fence_tools([a, b], effects={"a": "read"})  # type: ignore[dict-item]
    [by_name] = fence_tools([a], effects={"a": "read_only"})  # an effect's name is taken too
    assert getattr(type(by_name), EFFECT_ATTRIBUTE) is Effect.READ_ONLY
    with pytest.raises(ValueError, match=r"effects\['b'\]"):
        fence_tools([a, b], effects={"b": None})  # type: ignore[dict-item]
    with pytest.raises(ValueError, match=r"not in the list: \['c'\]"):
        fence_tools([a, b], effects={"c": Effect.READ_ONLY})
    with pytest.raises(ValueError, match="duplicate tool name 'a'"):
        fence_tools([a, b, a])
    renamed = StructuredTool.from_function(func=plain, name="b")
    with pytest.raises(ValueError, match="duplicate tool name 'b'"):
        fence_tools([a, b, renamed])
    with pytest.raises(ValueError, match="fenced already"):
        fence_tools(fence_tools([a]))
    with pytest.raises(ValueError, match=r"tools\[1\]"):
        fence_tools([a, 42])  # type: ignore[list-item]
    with pytest.raises(ValueError, match="list of LangChain tools"):
        fence_tools(a)  # type: ignore[arg-type]
    [made] = fence_tools([plain], effects={"plain": Effect.READ_ONLY})
    assert made.name == "plain"
    assert isinstance(made, StructuredTool)

"""The node wrapper: frames, refusals, preserved signatures, and retry guards."""

from __future__ import annotations

import asyncio
import inspect
import operator
from typing import Annotated, Any, TypedDict

import pytest
from langchain_core.runnables import RunnableConfig
from langgraph.checkpoint.memory import InMemorySaver
from langgraph.graph import END, START, StateGraph
from langgraph.types import RetryPolicy

from langgraph_fence import (
    Effect,
    ExecutionContextUnavailableError,
    ExecutionDeadLetteredError,
    ExecutionFencedError,
    LeaseKey,
    MemoryLeaseRepository,
    fence_graph,
    fenced,
)
from langgraph_fence.effects import EFFECT_ATTRIBUTE
from langgraph_fence.execution.fail_closed import unfenced_parts
from langgraph_fence.fence import RunHandle
from langgraph_fence.keys import FENCE_CONFIG_KEY
from langgraph_fence.steps.context import ExecutionContext, get_execution_context
from langgraph_fence.testing import ManualClock, run_node


class State(TypedDict):
    log: Annotated[list[str], operator.add]


async def test_a_fenced_node_runs_in_a_frame_with_the_held_token() -> None:
    seen: dict[str, Any] = {}

    @fenced
    async def step(state: State, config: RunnableConfig) -> dict[str, Any]:
        frame = get_execution_context()
        frame.fence.assert_held()
        seen["frame"] = frame
        seen["from_config"] = config["configurable"]["execution_context"]
        return {"log": ["ok"]}

    out = await run_node(step, {"log": []}, fence=7, tenant_id="acme", thread_id="order-1")
    assert out == {"log": ["ok"]}
    frame = seen["frame"]
    assert isinstance(frame, ExecutionContext)
    assert seen["from_config"] is frame
    assert frame.node == "step"
    assert frame.thread_id == "order-1"
    assert frame.fence.token == 7
    assert frame.fence.scope_key == "acme:order-1"
    assert frame.fence.tenant_id == "acme"
    assert frame.fence.lease_execution_id == "order-1"


async def test_a_fence_kept_past_its_step_refuses() -> None:
    kept = []

    @fenced
    async def step(state: State) -> dict[str, Any]:
        kept.append(get_execution_context().fence)
        return {}

    await run_node(step, {"log": []})
    with pytest.raises(ExecutionContextUnavailableError, match="after its step ended"):
        kept[0].assert_held()
    with pytest.raises(ExecutionContextUnavailableError):
        await kept[0].confirm_now()


async def test_a_lost_lease_stops_the_step_before_its_body() -> None:
    ran = []

    @fenced(effect=Effect.NON_IDEMPOTENT_WRITE)
    async def charge(state: State) -> dict[str, Any]:
        ran.append(True)
        return {}

    with pytest.raises(ExecutionFencedError) as info:
        await run_node(charge, {"log": []}, fence="lost")
    assert ran == []
    assert info.value.token_held == 1
    assert info.value.token_seen == 2


async def test_a_sync_node_sees_its_frame_in_the_worker_thread() -> None:
    seen = []

    @fenced
    def step(state: State) -> dict[str, Any]:
        seen.append(get_execution_context().node)
        return {"log": ["sync"]}

    assert not inspect.iscoroutinefunction(step)
    assert await run_node(step, {"log": []}) == {"log": ["sync"]}
    assert seen == ["step"]


async def test_a_node_run_without_a_lease_refuses_and_says_how_to_run_it() -> None:
    @fenced
    async def step(state: State, config: RunnableConfig) -> dict[str, Any]:
        return {}

    with pytest.raises(ExecutionContextUnavailableError, match=r"Instance\.ainvoke"):
        await step({"log": []}, config={"configurable": {"thread_id": "t"}})
    with pytest.raises(ExecutionContextUnavailableError, match="run_node"):
        await step({"log": []})


async def test_no_frame_outside_a_step() -> None:
    with pytest.raises(ExecutionContextUnavailableError, match="no fenced step"):
        get_execution_context()


def test_fenced_keeps_the_signature_langgraph_reads() -> None:
    async def node(state: State, config: RunnableConfig, *, store: Any = None) -> dict[str, Any]:
        return {}

    wrapped = fenced(effect=Effect.IDEMPOTENT_WRITE)(node)
    assert inspect.signature(wrapped) == inspect.signature(node)
    assert inspect.iscoroutinefunction(wrapped)
    builder = StateGraph(State)
    builder.add_node("node", wrapped)
    assert builder.nodes["node"].input_schema is State


def test_bad_effects_are_refused_naming_the_argument() -> None:
    with pytest.raises(ValueError, match="effect must be an Effect"):
        fenced(effect="write")  # type: ignore[arg-type]
    builder = StateGraph(State)
    builder.add_node("a", lambda s: {})
    with pytest.raises(ValueError, match="does not have"):
        fence_graph(builder, effects={"b": Effect.READ_ONLY})
    with pytest.raises(ValueError, match=r"effects\['a'\] must be an Effect: one of .*'read_only'"):
        fence_graph(builder, effects={"a": "read"})  # type: ignore[dict-item]


def test_effects_are_taken_by_their_names_too() -> None:
    """``"non_idempotent_write"`` means Effect.NON_IDEMPOTENT_WRITE wherever an effect is taken."""

    def charge(state: State) -> dict[str, Any]:
        return {}

    decorated = fenced(effect="non_idempotent_write")(charge)
    assert getattr(decorated, EFFECT_ATTRIBUTE) is Effect.NON_IDEMPOTENT_WRITE
    builder = StateGraph(State)
    builder.add_node("charge", charge)
    fence_graph(builder, effects={"charge": "non_idempotent_write"})
    wrapped = builder.nodes["charge"].runnable.func  # type: ignore[attr-defined]
    assert getattr(wrapped, EFFECT_ATTRIBUTE) is Effect.NON_IDEMPOTENT_WRITE


async def _held_config(thread_id: str) -> tuple[RunnableConfig, RunHandle]:
    clock = ManualClock()
    store = MemoryLeaseRepository(clock=clock)
    lease = await store.acquire(LeaseKey("t", thread_id), "me", 30.0)
    assert lease is not None
    handle = RunHandle(store, lease, 30.0, clock=clock)
    return {"configurable": {"thread_id": thread_id, FENCE_CONFIG_KEY: handle}}, handle


async def test_a_fencing_error_is_never_retried_whatever_retry_on_says() -> None:
    attempts = []
    asked: list[BaseException] = []

    def retry_everything(exc: BaseException) -> bool:
        asked.append(exc)
        return True

    async def flaky(state: State) -> dict[str, Any]:
        attempts.append(1)
        frame = get_execution_context()
        raise RuntimeError("wrapped") from frame.fence.fenced(frame.fence.token + 1)

    builder = StateGraph(State)
    builder.add_node(
        "flaky",
        flaky,
        retry_policy=[
            RetryPolicy(retry_on=retry_everything, initial_interval=0.001, jitter=False),
            RetryPolicy(retry_on=Exception, initial_interval=0.001, jitter=False),
        ],
    )
    builder.add_edge(START, "flaky")
    builder.add_edge("flaky", END)
    graph = fence_graph(builder).compile(checkpointer=InMemorySaver())
    config, handle = await _held_config("retry")
    with pytest.raises(ExecutionFencedError) as info:
        await graph.ainvoke({"log": []}, config)
    assert attempts == [1]
    assert asked == []  # the guard answered before the user's retry_on was consulted
    assert info.value is handle.error


async def test_other_errors_are_still_retried_as_declared() -> None:
    attempts = []

    async def flaky(state: State) -> dict[str, Any]:
        attempts.append(1)
        if len(attempts) < 3:
            raise ConnectionError("transient")
        return {"log": ["done"]}

    builder = StateGraph(State)
    builder.add_node("flaky", flaky, retry_policy=RetryPolicy(initial_interval=0.001, jitter=False))
    builder.add_edge(START, "flaky")
    builder.add_edge("flaky", END)
    graph = fence_graph(builder, effects={"flaky": Effect.IDEMPOTENT_WRITE}).compile(
        checkpointer=InMemorySaver()
    )
    config, _ = await _held_config("retry-ok")
    assert await graph.ainvoke({"log": []}, config) == {"log": ["done"]}
    assert len(attempts) == 3


async def test_a_failed_non_idempotent_write_is_dead_lettered_not_retried() -> None:
    attempts = []
    asked: list[BaseException] = []

    def retry_everything(exc: BaseException) -> bool:
        asked.append(exc)
        return True

    async def charge(state: State) -> dict[str, Any]:
        attempts.append(1)
        raise ConnectionError("the card network hung up mid-charge")

    builder = StateGraph(State)
    builder.add_node(
        "charge",
        charge,
        retry_policy=RetryPolicy(retry_on=retry_everything, initial_interval=0.001, jitter=False),
    )
    builder.add_edge(START, "charge")
    builder.add_edge("charge", END)
    graph = fence_graph(builder, effects={"charge": Effect.NON_IDEMPOTENT_WRITE}).compile(
        checkpointer=InMemorySaver()
    )
    config, handle = await _held_config("charge")
    with pytest.raises(ExecutionDeadLetteredError, match="not retried") as info:
        await graph.ainvoke({"log": []}, config)
    assert attempts == [1]
    assert asked == []
    assert isinstance(info.value.__cause__, ConnectionError)
    lease = await handle.repository.get(handle.key)
    assert lease is not None
    assert lease.pending_effect is not None
    assert lease.pending_effect.node == "charge"


async def test_losing_the_lease_cancels_the_step_and_raises_the_fencing_error() -> None:
    entered = asyncio.Event()

    @fenced
    async def slow(state: State) -> dict[str, Any]:
        entered.set()
        await asyncio.Event().wait()  # only cancellation ends this
        return {}

    builder = StateGraph(State)
    builder.add_node("slow", slow)
    builder.add_edge(START, "slow")
    builder.add_edge("slow", END)
    graph = builder.compile(checkpointer=InMemorySaver())
    config, handle = await _held_config("cancel")
    run = asyncio.create_task(graph.ainvoke({"log": []}, config))
    await asyncio.wait_for(entered.wait(), 5)
    error = handle.fenced(2, source="a test")
    with pytest.raises(ExecutionFencedError) as info:
        await asyncio.wait_for(run, 5)
    assert info.value is error


class _Order(TypedDict, total=False):
    order: str


async def _charge(state: _Order) -> dict[str, Any]:
    return {"order": "charged"}


def test_a_compiled_graph_with_a_bad_effect_is_refused_up_front_and_left_as_it_was() -> None:
    builder = StateGraph(_Order)
    policy = RetryPolicy(max_attempts=3)
    builder.add_node("charge", _charge, retry_policy=policy)
    builder.add_edge(START, "charge")
    builder.add_edge("charge", END)
    compiled = builder.compile()
    before = {name: node.retry_policy for name, node in compiled.nodes.items()}
    with pytest.raises(ValueError, match=r"\['refund'\].*its nodes are \['charge'\]"):
        fence_graph(compiled, effects={"refund": Effect.NON_IDEMPOTENT_WRITE})
    with pytest.raises(ValueError, match="must be an Effect"):
        fence_graph(compiled, effects={"charge": "charging"})
    assert {name: node.retry_policy for name, node in compiled.nodes.items()} == before
    assert unfenced_parts(compiled) == (["charge"], []), "nothing was changed"


def test_a_compiled_graph_is_fenced_in_place_with_its_retry_policies_guarded() -> None:
    builder = StateGraph(_Order)
    builder.add_node("charge", _charge, retry_policy=RetryPolicy(max_attempts=3))
    builder.add_edge(START, "charge")
    builder.add_edge("charge", END)
    compiled = builder.compile()
    assert fence_graph(compiled, effects={"charge": "non_idempotent_write"}) is compiled
    assert unfenced_parts(compiled) == ([], [])
    bound = compiled.nodes["charge"].bound
    assert getattr(bound.afunc, EFFECT_ATTRIBUTE) is Effect.NON_IDEMPOTENT_WRITE
    (guarded,) = compiled.nodes["charge"].retry_policy
    fenced_error = ExecutionFencedError("fenced", scope_key="t:e", token_held=1, token_seen=2)
    assert not guarded.retry_on(fenced_error)


def test_a_contradicted_decorator_is_refused_before_any_node_changes() -> None:
    @fenced(effect=Effect.IDEMPOTENT_WRITE)
    async def refund(state: _Order) -> dict[str, Any]:
        return {}

    builder = StateGraph(_Order)
    policy = RetryPolicy(max_attempts=3)
    builder.add_node("charge", _charge, retry_policy=policy)
    builder.add_node("refund", refund)
    builder.add_edge(START, "charge")
    builder.add_edge("charge", "refund")
    builder.add_edge("refund", END)
    with pytest.raises(ValueError, match="declare it in one place"):
        fence_graph(builder, effects={"refund": Effect.NON_IDEMPOTENT_WRITE})
    assert builder.nodes["charge"].retry_policy is policy
    assert builder.nodes["charge"].runnable.afunc is _charge  # type: ignore[attr-defined]


def _one_node_graph(name: str, fn: Any) -> StateGraph[_Order]:
    builder = StateGraph(_Order)
    builder.add_node(name, fn)
    builder.add_edge(START, name)
    builder.add_edge(name, END)
    return builder


def test_a_compiled_graph_refuses_a_declaration_that_contradicts_its_fenced_node() -> None:
    # The node was fenced read-only (an earlier fence_graph, or @fenced): effects= calling
    # it a non-idempotent write must not be dropped in silence, or the write is never
    # stamped and a takeover could repeat it.
    compiled = fence_graph(_one_node_graph("charge", _charge)).compile()
    bound = compiled.nodes["charge"].bound
    fenced_fn = bound.afunc
    with pytest.raises(ValueError, match=r"node 'charge' .* declare it in one place"):
        fence_graph(compiled, effects={"charge": Effect.NON_IDEMPOTENT_WRITE})
    assert bound.afunc is fenced_fn, "nothing was changed"
    assert getattr(bound.afunc, EFFECT_ATTRIBUTE) is Effect.READ_ONLY
    # The same declaration as the node's own is no conflict.
    assert fence_graph(compiled, effects={"charge": Effect.READ_ONLY}) is compiled


def test_both_forms_refuse_a_contradicted_decorator_with_one_message() -> None:
    @fenced(effect=Effect.IDEMPOTENT_WRITE)
    async def refund(state: _Order) -> dict[str, Any]:
        return {}

    effects = {"refund": Effect.NON_IDEMPOTENT_WRITE}
    refused = r"node 'refund' .* declare it in one place"
    with pytest.raises(ValueError, match=refused) as from_builder:
        fence_graph(_one_node_graph("refund", refund), effects=effects)
    with pytest.raises(ValueError, match=refused) as from_compiled:
        fence_graph(_one_node_graph("refund", refund).compile(), effects=effects)
    assert str(from_builder.value) == str(from_compiled.value)


def test_a_compiled_graph_refuses_a_declaration_that_contradicts_its_fenced_tool() -> None:
    from langchain_core.tools import tool
    from langgraph.graph.message import MessagesState
    from langgraph.prebuilt import ToolNode

    from langgraph_fence import fence_tools

    @tool
    def refund(order: str) -> str:
        """Refund an order."""
        return order

    (read_only,) = fence_tools([refund], effects={"refund": Effect.READ_ONLY})
    builder = StateGraph(MessagesState)
    builder.add_node("tools", ToolNode([read_only]))
    builder.add_edge(START, "tools")
    builder.add_edge("tools", END)
    compiled = builder.compile()
    with pytest.raises(ValueError, match=r"tool 'refund' .* declare it in one place"):
        fence_graph(compiled, effects={"refund": Effect.NON_IDEMPOTENT_WRITE})
    assert unfenced_parts(compiled) == (["tools"], []), "nothing was changed"

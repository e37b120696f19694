"""Each private name of LangGraph, SQLAlchemy and aiosqlite that ``langgraph_fence._compat``
relies on still exists, with the shape used there.

A release of one of those libraries that renames or removes one fails here (CI runs this on
the newest versions and on the lowest the bounds allow), not in a user's fenced run.
"""

from __future__ import annotations

import dataclasses
import inspect
import sqlite3
from collections.abc import Callable
from pathlib import Path
from typing import Any, TypedDict

import aiosqlite
import pytest
from langchain_core.runnables import RunnableConfig
from langgraph.graph import END, START, StateGraph
from langgraph.runtime import RunControl, Runtime
from sqlalchemy import text

from langgraph_fence import _compat
from langgraph_fence.database import create_engine


class State(TypedDict, total=False):
    seen: dict[str, Any]


async def test_langgraph_puts_the_task_id_and_runtime_under_the_keys_we_read() -> None:
    seen: dict[str, Any] = {}

    async def node(state: State, config: RunnableConfig) -> State:
        configurable = config.get("configurable") or {}
        seen["task_id"] = _compat.pregel_task_id(configurable)
        seen["runtime"] = _compat.pregel_runtime(configurable)
        return {}

    builder = StateGraph(State)
    builder.add_node("node", node)
    builder.add_edge(START, "node")
    builder.add_edge("node", END)
    await builder.compile().ainvoke({})

    assert isinstance(seen["task_id"], str)
    assert seen["task_id"]
    runtime = seen["runtime"]
    assert isinstance(runtime, Runtime)
    assert runtime.execution_info is not None
    assert runtime.execution_info.node_attempt == 1
    # A fenced run asks for a drain through it (checkpoint.record_fence_error).
    fields = {f.name for f in dataclasses.fields(Runtime)}
    assert {"execution_info", "control"} <= fields
    assert callable(RunControl.request_drain)


def test_the_config_keys_are_the_ones_langgraph_documents_internally() -> None:
    assert _compat.CONFIG_KEY_TASK_ID == "__pregel_task_id"
    assert _compat.CONFIG_KEY_RUNTIME == "__pregel_runtime"


def test_add_node_wraps_a_function_in_runnable_callable_with_func_and_afunc() -> None:
    async def anode(state: State) -> State:
        return {}

    def snode(state: State) -> State:
        return {}

    builder = StateGraph(State)
    builder.add_node("a", anode)
    builder.add_node("s", snode)
    kind = _compat.runnable_callable_type()
    for name, fn in (("a", anode), ("s", snode)):
        runnable = builder.nodes[name].runnable
        assert isinstance(runnable, kind), type(runnable)
        assert fn in (runnable.func, runnable.afunc)


@pytest.mark.parametrize("where", ["engine", "option", "none"])
def test_sqlalchemy_reports_an_autocommit_it_was_told(where: str) -> None:
    import sqlalchemy as sa

    level = {"isolation_level": "AUTOCOMMIT"} if where == "engine" else {}
    engine = sa.create_engine("sqlite://", **level)
    try:
        assert callable(sa.Connection._is_autocommit_isolation)
        with engine.connect() as conn:
            if where == "option":
                conn = conn.execution_options(isolation_level="AUTOCOMMIT")
            assert _compat.sqlalchemy_told_autocommit(conn) is (where != "none")
    finally:
        engine.dispose()


@pytest.mark.parametrize("autocommit", [True, False])
async def test_sqlalchemy_keeps_an_engine_wide_autocommit_where_we_read_it(
    autocommit: bool,
) -> None:
    from sqlalchemy.ext.asyncio import create_async_engine

    # The asyncpg dialect is what the lease store asks; no connection is opened.
    level = {"isolation_level": "AUTOCOMMIT"} if autocommit else {}
    engine = create_async_engine("postgresql+asyncpg://nobody@127.0.0.1:1/none", **level)
    try:
        assert _compat.sqlalchemy_engine_autocommit(engine) is autocommit
        assert hasattr(engine.sync_engine.dialect, "_on_connect_isolation_level")
    finally:
        await engine.dispose()


async def test_aiosqlite_runs_a_function_on_its_thread_with_the_sqlite3_connection(
    tmp_path: Path,
) -> None:
    assert list(inspect.signature(aiosqlite.Connection._execute).parameters)[:2] == ["self", "fn"]
    engine = create_engine(f"sqlite+aiosqlite:///{tmp_path / 'compat.db'}")
    try:
        async with engine.connect() as conn:
            await conn.execute(text("SELECT 1"))
            fairy = await conn.get_raw_connection()
            aio = fairy.driver_connection
            assert isinstance(aio, aiosqlite.Connection)

            def body(raw: sqlite3.Connection) -> int:
                assert isinstance(raw, sqlite3.Connection)
                return int(raw.execute("SELECT 41 + 1").fetchone()[0])

            fn: Callable[[sqlite3.Connection], int] = body
            assert await _compat.aiosqlite_call(aio, fn) == 42
    finally:
        await engine.dispose()


def test_every_graph_call_goes_through_the_four_hooked_methods() -> None:
    """``ainvoke``/``abatch``/``astream_events`` reach ``astream``, ``invoke``/``batch``
    reach ``stream``: the hook of ``langgraph_fence.steps.graph_calls`` sees every call."""
    from langgraph.pregel import Pregel

    import langgraph_fence.steps.graph_calls as graph_calls

    graph_calls.install()
    for name in ("astream", "stream", "aupdate_state", "update_state"):
        assert getattr(getattr(Pregel, name), "__langgraph_fence_hook__", False), name
    calls: list[str] = []
    original_astream, original_stream = Pregel.astream, Pregel.stream

    def astream(self: Any, *args: Any, **kwargs: Any) -> Any:
        calls.append("astream")
        return original_astream(self, *args, **kwargs)

    def stream(self: Any, *args: Any, **kwargs: Any) -> Any:
        calls.append("stream")
        return original_stream(self, *args, **kwargs)

    builder = StateGraph(State)
    builder.add_node("n", lambda state: {"seen": {"ran": True}})
    builder.add_edge(START, "n")
    builder.add_edge("n", END)
    graph = builder.compile()
    import asyncio

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(Pregel, "astream", astream)
        patch.setattr(Pregel, "stream", stream)
        graph.invoke({})
        graph.batch([{}, {}])
        asyncio.run(graph.ainvoke({}))
        asyncio.run(graph.abatch([{}]))

        async def events() -> None:
            async for _ in graph.astream_events({}, version="v2"):
                pass

        asyncio.run(events())
    assert calls == ["stream"] * 3 + ["astream"] * 3


def test_a_tool_node_calls_its_tools_from_the_dict_tools_by_name_returns() -> None:
    from langchain_core.tools import tool
    from langgraph.prebuilt import ToolNode

    @tool
    def first(x: str) -> str:
        """First."""
        return "first"

    @tool("first")
    def second(x: str) -> str:
        """Second."""
        return "second"

    node = ToolNode([first])
    tools = _compat.tool_node_tools(node)
    # The dict itself, not a copy: what is put in it is what the node calls
    # (tests/integration/test_fail_closed.py sees the fenced tool's stamp).
    assert tools is not None
    assert tools is node.tools_by_name
    tools["first"] = second
    assert node.tools_by_name["first"] is second
    assert _compat.tool_node_tools(object()) is None


def test_a_task_is_called_through_task_function_call_and_keeps_its_function() -> None:
    from langgraph.func import _TaskFunction, task

    def body(x: int) -> int:
        return x

    made = task(body)
    assert isinstance(made, _TaskFunction)
    assert made.func is body
    assert "__call__" in vars(_TaskFunction)


def test_a_jsonplus_serializer_keeps_what_it_was_made_with_where_we_read_it() -> None:
    from langgraph.checkpoint.serde.jsonplus import JsonPlusSerializer

    from langgraph_fence._compat import jsonplus_settings

    lax = JsonPlusSerializer()
    strict = JsonPlusSerializer(
        allowed_msgpack_modules=[("app", "Order")], allowed_json_modules=[("app", "Order")]
    )
    hooked = JsonPlusSerializer(__unpack_ext_hook__=lambda code, data: data)
    assert jsonplus_settings(lax)[0] is False
    assert jsonplus_settings(hooked)[0] is True
    _, msgpack, json_modules = jsonplus_settings(strict)
    assert ("app", "Order") in tuple(msgpack)
    assert ("app", "Order") in tuple(json_modules)


async def test_the_stream_hooks_hand_over_each_event_as_astream_yields_it() -> None:
    from langchain_core.language_models.fake_chat_models import GenericFakeChatModel
    from langchain_core.messages import AIMessage
    from langgraph.checkpoint.memory import InMemorySaver
    from langgraph.config import get_stream_writer

    async def talk(state: State) -> dict[str, Any]:
        get_stream_writer()({"at": "talk"})
        model = GenericFakeChatModel(messages=iter([AIMessage(content="hello there")]))
        reply = await model.ainvoke("hi")
        return {"seen": {"reply": reply.content}}

    builder: StateGraph[Any] = StateGraph(State)
    builder.add_node("talk", talk)
    builder.add_edge(START, "talk")
    builder.add_edge("talk", END)
    graph = builder.compile(checkpointer=InMemorySaver())
    modes = ["values", "updates", "custom", "messages"]
    expected = [
        e async for e in graph.astream({}, {"configurable": {"thread_id": "a"}}, stream_mode=modes)
    ]
    got: list[Any] = []

    tasks: list[str] = []

    def emit(chunk: Any) -> None:
        if chunk[1] != "checkpoints":
            got.append(chunk[1:3])
        if chunk[1] == "custom":
            tasks.append(chunk[3])  # the task that wrote it

    configurable = _compat.record_stream_config(
        {"thread_id": "b"}, emit, {"values", "updates", "custom", "checkpoints"}
    )
    config: Any = {"configurable": configurable}
    config["callbacks"] = [_compat.messages_stream_handler(emit)]
    await graph.ainvoke({}, config)

    def same(event: Any) -> Any:  # the message ids and run metadata differ between runs
        mode, payload = event
        if mode == "messages":
            return (mode, payload[0].content, payload[1]["langgraph_node"])
        return event

    assert [same(e) for e in got] == [same(e) for e in expected]
    assert any(mode == "messages" for mode, _ in got)
    history = [c async for c in graph.aget_state_history({"configurable": {"thread_id": "b"}})]
    talked = [t.id for c in history for t in c.tasks if t.name == "talk"]
    assert tasks == talked[:1]


def test_finished_tasks_are_those_with_output_besides_interrupts_and_errors() -> None:
    from langgraph.types import Interrupt

    pending = [
        ("done", "seen", {"a": 1}),
        ("paused", "__interrupt__", [Interrupt(value="ok?")]),
        ("failed", "__error__", ValueError("boom")),
        ("00000000-0000-0000-0000-000000000000", "seen", {"input": 1}),
    ]
    assert _compat.finished_tasks(pending) == frozenset({"done"})

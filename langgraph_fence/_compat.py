"""Every private name of LangGraph, SQLAlchemy and aiosqlite the package relies on, in one place.

None of these is part of those libraries' public API, so a release may rename or remove one
without notice. Each is used only through this module, with a comment saying what it is, why
the package needs it and what breaks if it changes; ``tests/unit/test_compat.py`` checks that
each still exists with the shape used here, so a release that breaks one fails that test (run
on the newest and on the lowest versions the bounds allow, see ``.ci/run``) instead of a
fencing guarantee, silently, in production.
"""

from __future__ import annotations

import sqlite3
from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING, Any, TypeVar

from sqlalchemy import Connection
from sqlalchemy.ext.asyncio import AsyncEngine

if TYPE_CHECKING:
    from langgraph._internal._constants import CONFIG_KEY_RUNTIME, CONFIG_KEY_TASK_ID
    from langgraph._internal._runnable import RunnableCallable

__all__ = [
    "CONFIG_KEY_RUNTIME",
    "CONFIG_KEY_TASK_ID",
    "aiosqlite_call",
    "compiled_serde_allowlist",
    "finished_tasks",
    "hook_pregel",
    "jsonplus_settings",
    "messages_stream_handler",
    "pregel_runtime",
    "pregel_task_id",
    "record_stream_config",
    "runnable_callable_type",
    "server_saver_inner",
    "sqlalchemy_engine_autocommit",
    "sqlalchemy_recycle_pool",
    "sqlalchemy_told_autocommit",
    "tool_node_tools",
]

T = TypeVar("T")

# CONFIG_KEY_TASK_ID ("__pregel_task_id"): the key under which LangGraph puts the id of the
# running task into a node's config["configurable"]. The pending-effect stamp of a step is
# keyed by it (parallel steps and Send fan-outs each get their own entry, cleared by that
# task's own writes), and the unit runner of langgraph_fence.testing sets it. If it changes,
# every step falls back to its node name: parallel tasks of one node share one stamp entry.
#
# CONFIG_KEY_RUNTIME ("__pregel_runtime"): the key of the step's langgraph.runtime.Runtime in
# config["configurable"]. Its execution_info.node_attempt is the frame's attempt number, and
# its control (RunControl) is how a fenced run asks LangGraph to drain at the next superstep.
# If it changes, every attempt reads as 1 and a fenced durability="async" run goes on to the
# end of its current superstep before it stops (still refused at each write).


#
# CONFIG_KEY_SCRATCHPAD ("__pregel_scratchpad"): the task's scratchpad, whose ``resume`` lists
# the answers to the task's interrupts that this attempt consumed. With Interrupt.from_ns (the
# id of a task's first unanswered interrupt) it tells a pause at the task's own first
# interrupt() from any other (see paused_at_first_interrupt). If either changes, a paused
# write step keeps its stamp and its resume is dead-lettered: loud, never repeated.


def __getattr__(name: str) -> Any:
    # LangGraph's keys are read on first use: the SQLAlchemy helpers below serve the CLI's
    # listings, which must not load LangGraph (its imports cost seconds).
    if name in ("CONFIG_KEY_RUNTIME", "CONFIG_KEY_TASK_ID", "CONFIG_KEY_SCRATCHPAD"):
        from langgraph._internal import _constants

        value = getattr(_constants, name)
        globals()[name] = value
        return value
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def _key(name: str) -> str:
    found = globals().get(name)  # after the first use: read on every step
    return found if isinstance(found, str) else str(__getattr__(name))


def pregel_task_id(configurable: Mapping[str, Any]) -> str | None:
    """The id LangGraph gave the running task, or ``None`` outside a task."""
    found = configurable.get(_key("CONFIG_KEY_TASK_ID"))
    return None if found is None else str(found)


def pregel_runtime(configurable: Mapping[str, Any]) -> Any:
    """The step's ``langgraph.runtime.Runtime``, or ``None`` outside a task."""
    return configurable.get(_key("CONFIG_KEY_RUNTIME"))


def paused_at_first_interrupt(configurable: Mapping[str, Any], interrupt: BaseException) -> bool:
    """Whether the task of ``configurable`` paused at its own first ``interrupt()`` call with
    no answer consumed yet in this attempt: every interrupt ``interrupt`` (a
    ``GraphInterrupt``) carries is that one (not a subgraph's, not a later one of the task).

    Anything unknown answers ``False``: the caller then keeps the step's stamp.
    """
    try:
        from langgraph.types import Interrupt

        scratchpad = configurable.get(_key("CONFIG_KEY_SCRATCHPAD"))
        if scratchpad is None or scratchpad.resume:
            return False
        own = Interrupt.from_ns(None, str(configurable.get("checkpoint_ns") or "")).id
        raised = interrupt.args[0] if interrupt.args else ()
        return bool(raised) and all(getattr(i, "id", None) == own for i in raised)
    except Exception:
        return False


def record_stream_config(
    configurable: Mapping[str, Any],
    emit: Callable[[tuple[Any, ...]], None],
    modes: set[str],
    store: Any = None,
) -> dict[str, Any]:
    """``configurable`` with hooks that hand ``emit`` every ``(namespace, mode, payload)``
    event a run of a graph called with it produces in ``modes`` (``values``, ``updates``,
    ``checkpoints``, ``tasks``; ``custom``, with a fourth item: the id of the root task that
    wrote it; ``messages``), at the moment LangGraph produces it, before the task's writes
    and the checkpoint that ends its step are written.

    How a parent graph receives its subgraphs' events, used on the root run: a
    ``StreamProtocol`` under ``CONFIG_KEY_STREAM`` ("__pregel_stream") is called by every
    loop of the run for the modes it names (``DuplexStream`` beside the loop's own); a
    ``Runtime`` under ``CONFIG_KEY_RUNTIME`` carries the graph's ``store`` and the writer
    ``get_stream_writer()`` returns in a step (LangGraph reads both from it once the stream
    key is set); a ``StreamMessagesHandler`` (``langgraph.pregel._messages``) among the
    run's callbacks emits the ``messages`` events. If any of them changes, a recorded stream
    misses those events (``tests/unit/test_compat.py`` and the stream tests fail), and the
    run itself is unchanged.
    """
    from langgraph._internal._constants import CONFIG_KEY_RUNTIME as runtime_key
    from langgraph._internal._constants import CONFIG_KEY_STREAM
    from langgraph.config import get_config
    from langgraph.pregel.protocol import StreamProtocol
    from langgraph.runtime import Runtime

    def write_custom(chunk: Any) -> None:
        # The step's namespace ("node:task_id", a subgraph's under its root task's): the
        # event's is its parent's, as LangGraph's own writer says; the root task is first.
        ns = str(get_config()["configurable"].get("checkpoint_ns") or "")
        emit((tuple(ns.split("|")[:-1]), "custom", chunk, ns.split("|")[0].split(":")[-1]))

    hooked = {**configurable, CONFIG_KEY_STREAM: StreamProtocol(emit, modes)}  # type: ignore[arg-type]
    # With the stream key set, LangGraph takes the run's store and stream writer from this
    # runtime: the graph's ``store``, and the writer when ``custom`` is recorded.
    injected = (
        Runtime(store=store, stream_writer=write_custom)
        if "custom" in modes
        else Runtime(store=store)
    )
    existing = configurable.get(runtime_key)
    hooked[runtime_key] = existing.merge(injected) if isinstance(existing, Runtime) else injected
    return hooked


def finished_tasks(pending_writes: Any) -> frozenset[str]:
    """The ids of the tasks whose writes among ``pending_writes`` (a checkpoint's) a run
    resumed from that checkpoint applies instead of running them again: LangGraph's own
    reading (``langgraph.pregel._task_status.read_task_statuses``, a task with output). If
    it moves, this raises, and a recorded stream's takeover keeps none of those tasks'
    events (the stream then misses them, the run is unchanged)."""
    from langgraph.pregel._task_status import read_task_statuses

    statuses = read_task_statuses(pending_writes or ())
    return frozenset(task_id for task_id, status in statuses.items() if status.output)


def messages_stream_handler(emit: Callable[[tuple[Any, ...]], None]) -> Any:
    """A LangChain callback handler that hands ``emit`` the run's ``messages`` events, as
    ``astream(stream_mode="messages", subgraphs=True)`` would yield them (see
    :func:`record_stream_config`). One without ``subgraphs`` is not kept by a root run's
    ``astream``, which drops such handlers from a caller's callbacks."""
    from langgraph.pregel._messages import StreamMessagesHandler

    return StreamMessagesHandler(emit, True)


def runnable_callable_type() -> type[RunnableCallable]:
    """``langgraph._internal._runnable.RunnableCallable``: what ``StateGraph.add_node`` wraps
    a node function in (its ``func`` and ``afunc`` are the user's functions).

    ``fence_graph`` reads the ``@fenced`` effect declared on those functions through it. If it
    moves, importing it fails and ``fence_graph`` raises; if its ``func``/``afunc`` change, a
    decorated node's declared effect is not seen and ``fence_graph`` treats the node as
    undeclared. Imported on call: ``fence_graph`` is the only user.
    """
    from langgraph._internal._runnable import RunnableCallable

    return RunnableCallable


def hook_pregel(hooks: Mapping[str, Callable[[Callable[..., Any]], Callable[..., Any]]]) -> None:
    """Replace methods of ``langgraph.pregel.Pregel`` with ``make(original)``, once per name.

    Not a private name but a patch of LangGraph's own class, recorded here for the same
    reason: a release may change what it relies on. The package hooks ``astream``,
    ``stream``, ``aupdate_state`` and ``update_state``: every way a user calls a compiled
    graph goes through one of them (``ainvoke``, ``abatch`` and ``astream_events`` through
    ``astream``; ``invoke`` and ``batch`` through ``stream``), so a graph compiled with an
    instance's checkpointer and called the LangGraph way runs under its execution's lease
    (:mod:`langgraph_fence.steps.graph_calls`); every other graph gets LangGraph's original,
    unchanged. ``tests/unit/test_compat.py`` checks that those four exist and that
    ``ainvoke``/``invoke`` still reach them. If LangGraph adds a path that bypasses them, a
    graph called that way runs with no handle and the fenced checkpointer refuses its first
    write (``ExecutionContextUnavailableError``, naming the fix): loud, never unfenced.
    """
    from langgraph.pregel import Pregel

    for name, make in hooks.items():
        current = getattr(Pregel, name)
        if getattr(current, "__langgraph_fence_hook__", False):
            continue
        replacement = make(current)
        replacement.__langgraph_fence_hook__ = True  # type: ignore[attr-defined]
        setattr(Pregel, name, replacement)


def hook_task_call(make: Callable[[Callable[..., Any]], Callable[..., Any]]) -> None:
    """Replace ``langgraph.func._TaskFunction.__call__`` (what calling a ``@task`` runs) with
    ``make(original)``, once.

    ``_TaskFunction`` is private: a ``@task`` is an instance of it and its ``func`` is the
    decorated function. The package checks, when a task is called inside a fenced step, that
    ``func`` went through ``@fenced``
    (:func:`langgraph_fence.execution.fail_closed.refuse_unfenced_task`).
    ``tests/unit/test_compat.py`` checks the class, its ``func`` and that calling a task goes
    through ``__call__``. If a release renames it, that test fails in CI, not a user's run.
    """
    from langgraph.func import _TaskFunction

    current = _TaskFunction.__call__
    if getattr(current, "__langgraph_fence_hook__", False):
        return
    replacement = make(current)
    replacement.__langgraph_fence_hook__ = True  # type: ignore[attr-defined]
    _TaskFunction.__call__ = replacement  # type: ignore[method-assign]


def server_saver_inner(saver: Any) -> Any:
    """The saver a ``langgraph.json`` ``checkpointer.path`` factory yielded, when ``saver`` is
    the adapter LangGraph's Agent Server wraps it in; else ``saver`` itself.

    langgraph-api (0.16) mounts a custom checkpointer as
    ``langgraph_api._checkpointer._adapter._CustomCheckpointerAdapter(inner=...)``, a new
    adapter per run, holding the factory's saver as ``_inner``; both names are private. If
    either changes, a server run's graph is not seen as fenced: the fenced checkpointer then
    refuses its first write (no run holds a lease), and the run fails loudly; nothing is
    written unfenced.
    """
    kind = type(saver)
    if kind.__name__ == "_CustomCheckpointerAdapter" and kind.__module__.startswith(
        "langgraph_api."
    ):
        return getattr(saver, "_inner", saver)
    return saver


def tool_node_tools(node: Any) -> dict[str, Any] | None:
    """The ``name -> tool`` dict a ``langgraph.prebuilt.ToolNode`` calls its tools from, or
    ``None`` for anything else.

    ``ToolNode.tools_by_name`` is public, but that it returns the dict the node calls from
    (so that replacing a tool in it changes what the node runs) is not documented:
    ``fence_graph`` on a compiled agent fences the tools in place through it. If it ever
    returns a copy, the check before a run (:mod:`langgraph_fence.execution.fail_closed`) still sees
    the unfenced tools and refuses the run: loud, never unfenced.
    """
    try:
        from langgraph.prebuilt import ToolNode
    except ImportError:  # pragma: no cover - langgraph-prebuilt is a dependency of langgraph
        return None
    if not isinstance(node, ToolNode):
        return None
    tools: dict[str, Any] = node.tools_by_name
    return tools


def sqlalchemy_told_autocommit(conn: Connection) -> bool:
    """Whether SQLAlchemy was told to run ``conn`` in AUTOCOMMIT: by an execution option
    (public), or by the engine's ``isolation_level`` (private).

    ``Connection._is_autocommit_isolation()`` is the only accessor of an engine-wide
    ``isolation_level="AUTOCOMMIT"`` (the execution option covers only a per-connection one).
    The exactly-once sink refuses a connection in AUTOCOMMIT (its statements would not roll
    back together). If the method goes away this answers ``False`` and the sink falls back to
    asking the driver (``detect_autocommit_setting``, the sqlite3 transaction state), which
    covers the same engines on the drivers the package supports.
    """
    if conn.get_execution_options().get("isolation_level") == "AUTOCOMMIT":
        return True
    told = getattr(conn, "_is_autocommit_isolation", None)
    return bool(callable(told) and told())


def sqlalchemy_engine_autocommit(engine: AsyncEngine) -> bool:
    """Whether every connection of ``engine`` is in AUTOCOMMIT (as ``create_engine`` makes
    them on PostgreSQL): an execution option (public), or ``create_async_engine(...,
    isolation_level="AUTOCOMMIT")``, kept only in the dialect's private
    ``_on_connect_isolation_level``.

    The lease store sends each write as one statement without BEGIN/COMMIT; on an engine not
    in autocommit it asks for AUTOCOMMIT itself. If the attribute goes away this answers
    ``False`` for such engines and the store asks for AUTOCOMMIT on one that already has it:
    harmless, nothing changes for the user.
    """
    level = engine.get_execution_options().get("isolation_level") or getattr(
        engine.sync_engine.dialect, "_on_connect_isolation_level", None
    )
    return bool(level == "AUTOCOMMIT")


def compiled_serde_allowlist(graph: Any) -> Any:
    """The types ``compile()`` allowed for a compiled graph's state under strict msgpack
    (``CompiledStateGraph._serde_allowlist``, private; ``None`` when absent). A rename makes
    the caller stricter, never looser: it then allows nothing beyond the serializer's own."""
    return getattr(graph, "_serde_allowlist", None)


def jsonplus_settings(serde: Any) -> tuple[bool, Any, Any]:
    """What a LangGraph ``JsonPlusSerializer`` was made with: whether it has a custom unpack
    ext hook, its msgpack allow-list and its JSON allow-list (``True``: any module).

    ``_custom_unpack_ext_hook``, ``_allowed_msgpack_modules`` and ``_allowed_json_modules``
    are private; ``tests/unit/test_compat.py`` checks that they still say what the
    constructor was given. If a release renames them, wrapping a foreign saver raises
    ``AttributeError`` (loudly, before anything is read with a lax serializer).
    """
    return (
        bool(serde._custom_unpack_ext_hook),
        serde._allowed_msgpack_modules,
        serde._allowed_json_modules,
    )


def sqlalchemy_recycle_pool(engine: Any, fairy: Any) -> None:
    """Recycle every connection ``engine``'s pool made before ``fairy`` (a checked-out
    connection) at its next checkout, as SQLAlchemy does itself for a disconnect it detects.

    ``Pool._invalidate(connection, exception, _checkin=False)`` is private: it bumps the
    pool's invalidation time without checking ``fairy`` in. If it changes, the recycle
    fails, the caller logs it at debug level, and the connections are found dead one by one
    on their next use instead (each retried as a connection error).
    """
    engine.pool._invalidate(fairy, None, _checkin=False)


async def aiosqlite_call(aio: Any, fn: Callable[[sqlite3.Connection], T]) -> T:
    """Run ``fn(sqlite3_connection)`` on the aiosqlite connection's own thread, in one hop.

    ``aiosqlite.Connection._execute(fn)`` queues ``fn`` on the connection's thread and awaits
    its result (every public call of aiosqlite goes through it); ``_conn`` is the
    ``sqlite3.Connection`` it wraps. The SQLite checkpointer runs each write transaction as one
    such function, so it pays one thread hop instead of one per statement. If either changes,
    every SQLite checkpoint write raises ``AttributeError`` (loudly: nothing is written).
    """
    result: T = await aio._execute(lambda: fn(aio._conn))
    return result

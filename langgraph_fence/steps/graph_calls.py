"""The LangGraph way: a graph compiled with an instance's checkpointer runs fenced when it is
called as LangGraph graphs are called.

``graph.ainvoke`` / ``astream`` (every ``stream_mode``, ``subgraphs=True``) /
``astream_events`` / ``abatch`` / ``aupdate_state``, and the sync ``invoke`` / ``stream`` /
``batch`` / ``update_state``, of a graph whose checkpointer is an instance's
``instance.checkpointer`` are the instance's explicit form (``instance.astream(graph, ...)``,
``instance.aupdate_state(graph, ...)``): the execution's lease is taken first, every step and
checkpoint of the run carries its token, and the lease is released with the outcome. The
tenant is ``configurable["tenant_id"]``, else the instance's default tenant; the execution id
is ``configurable["execution_id"]``, else the thread id.

How: one hook on ``Pregel.astream``, ``stream``, ``aupdate_state`` and ``update_state``,
installed once when the first :class:`~langgraph_fence.Instance` is made
(:func:`langgraph_fence._compat.hook_pregel`). A call whose config carries a run handle
already (the instance's own call, a subgraph inside a fenced run) and every graph with
another checkpointer get LangGraph's original, unchanged. What the hook cannot see (a write
by another path) the fenced checkpointer refuses, naming the fix.

Sync calls run the graph on the instance's event loop (``Instance.open_sync`` gives a sync
program one on a thread of its own) and hand each chunk back to the calling thread.
"""

from __future__ import annotations

import asyncio
import functools
from collections.abc import AsyncIterator, Callable, Mapping
from contextlib import aclosing
from typing import TYPE_CHECKING, Any

from langchain_core.runnables.config import ensure_config

from langgraph_fence._compat import hook_pregel, hook_task_call, server_saver_inner
from langgraph_fence.errors import (
    ExecutionContextUnavailableError,
    ExecutionSupersededError,
    ServerAttemptSuperseded,
)
from langgraph_fence.execution.fail_closed import refuse_unfenced, refuse_unfenced_task
from langgraph_fence.from_thread import iterate_on_loop, run_on_loop, running_loop
from langgraph_fence.keys import FENCE_CONFIG_KEY
from langgraph_fence.lease.attempts import server_attempt
from langgraph_fence.steps.context import current_frame

if TYPE_CHECKING:
    from langchain_core.runnables import RunnableConfig

    from langgraph_fence.saver.checkpoint import GraphRunner

__all__ = ["install", "instance_of"]


def instance_of(graph: Any, config: Mapping[str, Any] | None) -> GraphRunner | None:
    """The instance a call of ``graph`` with ``config`` must run through, or ``None`` (a
    graph with another checkpointer, or a call already inside a run: LangGraph's own)."""
    from langgraph_fence.saver.checkpoint import FencedCheckpointer

    saver = server_saver_inner(getattr(graph, "checkpointer", None))
    if not isinstance(saver, FencedCheckpointer) or saver.instance is None:
        return None
    # ensure_config: a graph called inside a node with no config (``sub.ainvoke(x)``) runs
    # with the node's config, which LangChain keeps in a context variable.
    for source in (ensure_config(config), getattr(graph, "config", None)):  # type: ignore[arg-type]
        configurable = source.get("configurable") if isinstance(source, Mapping) else None
        if isinstance(configurable, Mapping) and FENCE_CONFIG_KEY in configurable:
            return None
    return saver.instance


def _streaming_instance(graph: Any, config: Mapping[str, Any] | None) -> GraphRunner | None:
    """The instance a stream of ``graph`` (``astream`` / ``stream``) goes to, or ``None``
    for LangGraph's original.

    A graph called inside a fenced step (a subgraph a node calls, a ``PARENT_INSTANCE``
    child) goes to the original under the run's token: refused first if any of its nodes
    or tools is not fenced, before its first step, as the run's own graph was (checked once
    per compiled graph). Only inside a step: the run's own graph, called by the instance
    with the run's config, was checked when the run was prepared."""
    instance = instance_of(graph, config)
    if instance is None and current_frame() is not None:
        configurable = ensure_config(config).get("configurable")  # type: ignore[arg-type]
        if isinstance(configurable, Mapping) and FENCE_CONFIG_KEY in configurable:
            refuse_unfenced(graph)
    return instance


def _call(
    instance: GraphRunner, graph: Any, config: Mapping[str, Any] | None
) -> tuple[RunnableConfig, dict[str, Any]]:
    """The config the instance runs the call with, and its tenant and execution id.

    The graph's own config (``graph.with_config(...)``) is LangGraph's to merge; only its
    ``configurable`` keys are read here, so the thread it names is the run's.
    """
    own = getattr(graph, "config", None) or {}
    base: dict[str, Any] = dict(config or {})
    configurable = {**dict(own.get("configurable") or {}), **dict(base.get("configurable") or {})}
    base["configurable"] = configurable
    if isinstance(base.get("metadata"), Mapping):
        # Copied at the call: the Agent Server's in-memory runtime shares one metadata dict
        # between the attempts of a run, and sets the next attempt's number in it.
        base["metadata"] = dict(base["metadata"])
    tenant_id = configurable.get("tenant_id") or instance.tenant_id
    ids: dict[str, Any] = {"tenant_id": tenant_id}
    if configurable.get("execution_id") is not None:
        ids["execution_id"] = configurable["execution_id"]
    return base, ids  # type: ignore[return-value]


def _options(kwargs: Mapping[str, Any]) -> dict[str, Any]:
    """LangGraph's options as the instance takes them: the ones left at ``None`` dropped
    (``ainvoke`` passes ``control=None``; the instance sets the run's control itself)."""
    return {k: v for k, v in kwargs.items() if v is not None}


def _stream_hook(
    go: Callable[[GraphRunner, Any, Any, RunnableConfig, dict[str, Any]], Any],
) -> Callable[[Callable[..., Any]], Callable[..., Any]]:
    """The hook of ``astream`` or ``stream``: a call of a graph compiled with an instance's
    checkpointer goes to ``go(instance, graph, input, run_config, options)`` (its tenant
    and execution id among the options), any other to LangGraph's original."""

    def hook(original: Callable[..., Any]) -> Callable[..., Any]:
        @functools.wraps(original)
        def call(self: Any, input: Any, config: Any = None, **kwargs: Any) -> Any:
            instance = _streaming_instance(self, config)
            if instance is None:
                return original(self, input, config, **kwargs)
            run_config, ids = _call(instance, self, config)
            return go(instance, self, input, run_config, {**ids, **_options(kwargs)})

        return call

    return hook


def _astream_on(
    instance: GraphRunner, graph: Any, input: Any, config: RunnableConfig, options: dict[str, Any]
) -> Any:
    stream = instance.astream(graph, input, config, **options)
    if server_attempt(config) is None:
        return stream
    return _server_attempt(stream)


async def _server_attempt(stream: Any) -> AsyncIterator[Any]:
    """A run the Agent Server started, ended as the server must see it when a newer attempt
    of its run started before it (its start refused): a ``BaseException``, so that the
    server writes no status over the newer attempt's (:class:`ServerAttemptSuperseded`). A
    run fenced by a newer attempt ends so too, when it settles (:mod:`langgraph_fence.
    execution.run`); one fenced otherwise keeps its error, and the server marks it failed."""
    try:
        async with aclosing(stream):
            async for chunk in stream:
                yield chunk
    except ExecutionSupersededError as exc:
        raise ServerAttemptSuperseded(str(exc)) from exc


def _stream_on(
    instance: GraphRunner, graph: Any, input: Any, config: RunnableConfig, options: dict[str, Any]
) -> Any:
    loop = _loop_of(instance, "graph.invoke()/stream()")
    return iterate_on_loop(loop, lambda: instance.astream(graph, input, config, **options))


_astream = _stream_hook(_astream_on)
_stream = _stream_hook(_stream_on)


def _aupdate_state(original: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(original)
    async def aupdate_state(
        self: Any, config: Any, values: Any, as_node: str | None = None, task_id: Any = None
    ) -> Any:
        instance = instance_of(self, config)
        if instance is None:
            return await original(self, config, values, as_node, task_id)
        run_config, ids = _call(instance, self, config)
        return await instance.aupdate_state(
            self, run_config, values, as_node, task_id=task_id, **ids
        )

    return aupdate_state


def _loop_of(instance: GraphRunner, what: str) -> asyncio.AbstractEventLoop:
    loop = instance.loop
    if loop is not None and running_loop() is loop:
        raise ExecutionContextUnavailableError(
            f"{what} was called on the event loop of instance {instance.instance_id!r}, where "
            "waiting for the run would deadlock: await graph.ainvoke()/astream()/"
            "aupdate_state() there, or call graph.invoke() from a worker thread"
        )
    if loop is None or not loop.is_running():
        raise ExecutionContextUnavailableError(
            f"{what} of a graph compiled with an instance's checkpointer needs that "
            "instance's event loop, and it is not running: open the instance for a sync "
            "program with `with Instance.open_sync(url) as instance:` and call the graph "
            "inside that block"
        )
    return loop


def _update_state(original: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(original)
    def update_state(
        self: Any, config: Any, values: Any, as_node: str | None = None, task_id: Any = None
    ) -> Any:
        instance = instance_of(self, config)
        if instance is None:
            return original(self, config, values, as_node, task_id)
        loop = _loop_of(instance, "graph.update_state()")
        run_config, ids = _call(instance, self, config)
        return run_on_loop(
            loop,
            lambda: instance.aupdate_state(
                self, run_config, values, as_node, task_id=task_id, **ids
            ),
            what="graph.update_state()",
            on_loop="await graph.aupdate_state() there",
        )

    return update_state


_installed = False


def _task_call(original: Callable[..., Any]) -> Callable[..., Any]:
    """A ``@task`` called inside a fenced step is refused unless it is fenced."""

    @functools.wraps(original)
    def call(self: Any, *args: Any, **kwargs: Any) -> Any:
        if current_frame() is not None:
            refuse_unfenced_task(self)
        return original(self, *args, **kwargs)

    return call


def install() -> None:
    """Hook LangGraph's graph calls (once per process; idempotent)."""
    global _installed
    if _installed:
        return
    hook_pregel(
        {
            "astream": _astream,
            "stream": _stream,
            "aupdate_state": _aupdate_state,
            "update_state": _update_state,
        }
    )
    hook_task_call(_task_call)
    _installed = True

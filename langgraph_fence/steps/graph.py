"""``fence_graph``: every node and every ``ToolNode`` tool of a graph fenced in one call,
the same whether it is given a ``StateGraph`` builder or a compiled graph (a prebuilt agent).
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from typing import Any, cast

from langchain_core.runnables import RunnableConfig

from langgraph_fence._compat import runnable_callable_type, tool_node_tools
from langgraph_fence.effects import EFFECT_ATTRIBUTE, Effect, EffectLike, as_effect
from langgraph_fence.steps.context import StampAt
from langgraph_fence.steps.nodes import check_stamp_at, guard_retry_policy, wrap_step
from langgraph_fence.steps.tools import fence_tools

__all__ = ["fence_graph"]


@dataclass(slots=True)
class _Node:
    """One node of the graph being fenced: how to read and replace what it runs."""

    name: str
    runnable: Any
    replace: Callable[[Any], None] | None  # None: a compiled node, changed in place only
    set_retry: Callable[[Any], None]
    retry: Any
    tools: dict[str, Any] | None  # a ToolNode's name -> tool dict (fenced in place)


def _builder_nodes(builder: Any) -> list[_Node]:
    nodes = []
    for name, spec in builder.nodes.items():

        def replace(runnable: Any, _spec: Any = spec) -> None:
            _spec.runnable = runnable

        def set_retry(policy: Any, _spec: Any = spec) -> None:
            _spec.retry_policy = policy

        nodes.append(
            _Node(
                name,
                spec.runnable,
                replace,
                set_retry,
                spec.retry_policy,
                tool_node_tools(spec.runnable),
            )
        )
    return nodes


def _compiled_nodes(graph: Any) -> list[_Node]:
    from langgraph.constants import START

    nodes = []
    for name, node in graph.nodes.items():
        if name == START:
            continue

        def set_retry(policy: Any, _node: Any = node) -> None:
            _node.retry_policy = policy

        nodes.append(
            _Node(name, node.bound, None, set_retry, node.retry_policy, tool_node_tools(node.bound))
        )
    return nodes


def _fenced_effect(runnable: Any) -> Effect | None:
    """The effect a node's function was fenced with, or ``None`` (not fenced)."""
    if not isinstance(runnable, runnable_callable_type()):
        return None
    for fn in (runnable.func, runnable.afunc):
        if fn is not None and (effect := getattr(fn, EFFECT_ATTRIBUTE, None)) is not None:
            return cast(Effect, effect)
    return None


def _contradiction(name: str, fenced_as: Effect, given: Effect | None, kind: str) -> str | None:
    """An ``effects`` entry that contradicts the effect a node (or a tool) was fenced with:
    it would keep its own, and a write declared here would never be stamped."""
    if given is None or given is fenced_as:
        return None
    where = (
        f"@fenced(effect={fenced_as}), or an earlier fence_graph"
        if kind == "node"
        else f"fence_tools(..., effects={{{name!r}: {fenced_as}}}), or its default"
    )
    return (
        f"{kind} {name!r} is fenced already as {fenced_as} ({where}) but effects says "
        f"{given}: declare it in one place"
    )


def _problems(
    nodes: list[_Node], declared: Mapping[str, Effect], deferred: set[str], compiled: bool
) -> list[str]:
    """Every reason to refuse the call, all at once (nothing is changed before)."""
    from langgraph.pregel import Pregel

    problems: list[str] = []
    node_names = {node.name for node in nodes}
    tool_names = {tool for node in nodes for tool in (node.tools or {})}
    unknown = sorted((set(declared) | deferred) - node_names - tool_names)
    if unknown:
        problems.append(
            f"effects or stamp_at_effect name nodes or tools the graph does not have: {unknown} "
            f"(its nodes are {sorted(node_names)}, its ToolNode tools {sorted(tool_names)})"
        )
    both = sorted((set(declared) | deferred) & node_names & tool_names)
    if both:
        problems.append(
            f"{both} name both a node and a tool of the graph: fence the tools with "
            "fence_tools(...) where the ToolNode is built, and the nodes here"
        )
    RunnableCallable = runnable_callable_type()
    for node in nodes:
        runnable = node.runnable
        if isinstance(runnable, Pregel):
            continue
        if compiled and not isinstance(runnable, RunnableCallable):
            problems.append(
                f"node {node.name!r} is a {type(runnable).__name__}, which can be fenced only "
                "before compile(): call fence_graph(builder, ...) on the StateGraph, then "
                "compile()"
            )
            continue
        fenced_as = _fenced_effect(runnable)
        if fenced_as is not None:
            problem = _contradiction(node.name, fenced_as, declared.get(node.name), "node")
            if problem:
                problems.append(problem)
        elif node.name in deferred:
            effect = declared.get(node.name, Effect.READ_ONLY)
            if not effect.is_write:
                problems.append(
                    f"stamp_at_effect names node {node.name!r}, which is {effect.value}: "
                    "declare its write effect in effects, or leave it out"
                )
            elif _sync_only(runnable):
                problems.append(
                    f"stamp_at_effect names node {node.name!r}, which is sync: side_effect() "
                    "is an async context manager; make the node an async def"
                )
        for tool in (node.tools or {}).values():
            tool_fenced_as = getattr(type(tool), EFFECT_ATTRIBUTE, None)
            if tool_fenced_as is not None:
                problem = _contradiction(tool.name, tool_fenced_as, declared.get(tool.name), "tool")
                if problem:
                    problems.append(problem)
    return problems


def _sync_only(runnable: Any) -> bool:
    """Whether a node runs a sync function only: LangGraph gives it an ``afunc`` that runs
    the ``func`` in an executor (a ``functools.partial`` holding it)."""
    afunc = getattr(runnable, "afunc", None)
    func = getattr(runnable, "func", None)
    return afunc is None or (isinstance(afunc, functools.partial) and func in afunc.args)


def _fence_node(node: _Node, effect: Effect, stamp: StampAt) -> None:
    RunnableCallable = runnable_callable_type()
    runnable = node.runnable
    if isinstance(runnable, RunnableCallable):
        if runnable.func is not None:
            runnable.func = wrap_step(runnable.func, node.name, effect, sync=True)
        if runnable.afunc is not None:
            runnable.afunc = wrap_step(runnable.afunc, node.name, effect, stamp, sync=False)
        return
    assert node.replace is not None  # a compiled graph's node is a RunnableCallable (checked)

    async def call_runnable(state: Any, config: RunnableConfig, _inner: Any = runnable) -> Any:
        return await _inner.ainvoke(state, config)

    node.replace(
        RunnableCallable(
            None, wrap_step(call_runnable, node.name, effect, stamp, sync=False), name=node.name
        )
    )


def fence_graph(
    builder: Any,
    effects: Mapping[str, EffectLike] | None = None,
    *,
    stamp_at_effect: Iterable[str] = (),
) -> Any:
    """Fence every node of a graph, and the tools of each ``ToolNode`` in it; returns it.

    Takes a ``StateGraph`` before ``compile()`` (and returns the builder) or a compiled
    graph, and so a prebuilt agent in one line (``agent = fence_graph(create_agent(model,
    tools, checkpointer=instance.checkpointer, name="support"), effects={"send_email":
    "non_idempotent_write"})``): both forms fence the same things, with the same options.

    Each node runs as if decorated with :func:`~langgraph_fence.fenced` (nodes already
    decorated keep their own effect), with its effect from ``effects`` (undeclared nodes are
    ``READ_ONLY``), and its ``retry_policy`` guarded so a fencing error is never retried,
    whatever ``retry_on`` says. The tools of each ``ToolNode`` go through
    :func:`~langgraph_fence.fence_tools` (undeclared tools are ``NON_IDEMPOTENT_WRITE``;
    tools fenced already keep their effect). A compiled subgraph used as a node is left as it
    is (its steps run under the root's lease when it is fenced too).

    Args:
        builder: a ``StateGraph``, or a compiled graph.
        effects: the effect of nodes and tools, by name.
        stamp_at_effect: async write nodes and tools stamped where their body enters
            ``async with get_execution_context().side_effect():`` instead of before it (a
            failure before it is then retried, not dead-lettered).

    Raises:
        ValueError: listing every problem at once, before anything is changed: a ``builder``
            that is no graph, names the graph does not have, a value that is not an
            :class:`~langgraph_fence.Effect`, an entry that contradicts the effect a node or
            tool was fenced with already, a node of a compiled graph that can be fenced only
            before ``compile()``, a ``stamp_at_effect`` node that is read-only or sync.
    """
    from langgraph.graph import StateGraph
    from langgraph.pregel import Pregel

    compiled = isinstance(builder, Pregel)
    if not compiled and not isinstance(builder, StateGraph):
        raise ValueError(
            "builder must be a StateGraph (before compile()) or a compiled graph, got "
            f"{type(builder).__name__}"
        )
    if isinstance(stamp_at_effect, str):
        raise ValueError(
            f"stamp_at_effect must be a list of node and tool names, got {stamp_at_effect!r}: "
            f"write [{stamp_at_effect!r}]"
        )
    declared = {
        name: as_effect(value, name=f"effects[{name!r}]")
        for name, value in dict(effects or {}).items()
    }
    deferred = set(stamp_at_effect)
    nodes = _compiled_nodes(builder) if compiled else _builder_nodes(builder)
    problems = _problems(nodes, declared, deferred, compiled)
    if problems:
        raise ValueError(
            f"fence_graph refused the graph; nothing was changed: {'; '.join(problems)}"
        )

    for node in nodes:
        if isinstance(node.runnable, Pregel):
            continue
        node.set_retry(guard_retry_policy(node.retry))
        if _fenced_effect(node.runnable) is None:
            effect = declared.get(node.name, Effect.READ_ONLY)
            stamp = check_stamp_at(
                "effect" if node.name in deferred else "body", effect, name="stamp_at_effect"
            )
            _fence_node(node, effect, stamp)
        if node.tools:
            plain = [t for t in node.tools.values() if not hasattr(type(t), EFFECT_ATTRIBUTE)]
            wanted = {t.name: declared[t.name] for t in plain if t.name in declared}
            later = [t.name for t in plain if t.name in deferred]
            for tool in fence_tools(plain, effects=wanted, stamp_at_effect=later):
                node.tools[tool.name] = tool
    return builder

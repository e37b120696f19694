"""Fail closed: a graph run through an instance in which something is not fenced is refused
before its first step.

A node that did not go through :func:`~langgraph_fence.fenced` / ``fence_graph`` would run
with no frame, no check of the lease and no stamp; a tool of a ``ToolNode`` that did not go
through :func:`~langgraph_fence.fence_tools` would perform its write unstamped (a repeat after
a takeover is not refused). Either is a silent hole in the guarantees, found where a user
forgot one call; so a run of such a graph, in either form (``graph.ainvoke`` or
``instance.ainvoke(graph, ...)``), is refused naming every such node and tool and the one
call that fixes it. Subgraphs used as nodes are looked into; the check is made once per
compiled graph.
"""

from __future__ import annotations

import contextlib
import weakref
from collections.abc import Sequence
from typing import Any

from langgraph_fence._compat import runnable_callable_type, tool_node_tools
from langgraph_fence.effects import EFFECT_ATTRIBUTE

__all__ = ["refuse_unfenced", "refuse_unfenced_task", "unfenced_parts"]

_checked: weakref.WeakKeyDictionary[Any, bool] = weakref.WeakKeyDictionary()


def _node_fenced(runnable: Any) -> bool:
    """Whether a compiled node's runnable runs its body through the node wrapper."""
    if not isinstance(runnable, runnable_callable_type()):
        return False
    return any(
        getattr(fn, EFFECT_ATTRIBUTE, None) is not None
        for fn in (runnable.func, runnable.afunc)
        if fn is not None
    )


def unfenced_parts(graph: Any, prefix: str = "") -> tuple[list[str], list[str]]:
    """The nodes and the ``ToolNode`` tools of ``graph`` (and of its subgraphs) that are not
    fenced: ``(["node", "sub/node"], ["tools:send_email"])``."""
    from langgraph.constants import START
    from langgraph.pregel import Pregel

    nodes: list[str] = []
    tools: list[str] = []
    for name, node in getattr(graph, "nodes", {}).items():
        if name == START:
            continue
        bound = getattr(node, "bound", None)
        if isinstance(bound, Pregel):
            sub_nodes, sub_tools = unfenced_parts(bound, f"{prefix}{name}/")
            nodes += sub_nodes
            tools += sub_tools
            continue
        if not _node_fenced(bound):
            nodes.append(f"{prefix}{name}")
        for tool_name, tool in (tool_node_tools(bound) or {}).items():
            if not hasattr(type(tool), EFFECT_ATTRIBUTE):
                tools.append(f"{prefix}{name}:{tool_name}")
    return nodes, tools


def refuse_unfenced(graph: Any, also: Sequence[str] = ()) -> None:
    """Refuse a run of ``graph`` if any of its nodes or tools is not fenced, saying every
    problem at once: those, and ``also`` (the caller's other reasons to refuse the run).

    Raises:
        ValueError: naming the unfenced nodes and tools and the call that fences them.
    """
    try:
        if _checked.get(graph) and not also:
            return
    except TypeError:  # not weakly referenceable: checked every time
        pass
    nodes, tools = unfenced_parts(graph)
    if not nodes and not tools:
        with contextlib.suppress(TypeError):  # not weakly referenceable: checked every time
            _checked[graph] = True
        if also:
            raise ValueError("; ".join(also))
        return
    name = getattr(graph, "name", "graph")
    parts = []
    if nodes:
        parts.append(f"nodes {nodes} are not fenced (they would run with no lease check)")
    if tools:
        parts.append(
            f"tools {tools} did not go through fence_tools (their writes would run unstamped)"
        )
    if nodes:
        fix = (
            "Fence it in one call: fence_graph(builder, effects={...}) before compile(), or "
            'fence_graph(graph, effects={"send_email": "non_idempotent_write"}) on a compiled '
            "graph or a prebuilt agent (create_agent); both fence the tools of its ToolNodes "
            "too (undeclared tools are non_idempotent_write); an @entrypoint: stack @fenced "
            "under it"
        )
    else:
        # The nodes are fenced, so fence_graph was called: these tools came after it, or
        # sit in a node that is no langgraph.prebuilt.ToolNode.
        fix = (
            "fence_graph fences the tools a ToolNode holds when it is called, so these were "
            "added after it, or their node is not a langgraph.prebuilt.ToolNode: pass them "
            "through fence_tools(tools, effects={...}) where that node is built"
        )
    raise ValueError(
        f"graph {name!r} was refused before its first step: {' and '.join(parts)}. {fix}"
        + "".join(f"; {problem}" for problem in also)
        + ". Nothing ran and nothing was written"
    )


def refuse_unfenced_task(task: Any) -> None:
    """Refuse a call of the ``@task`` ``task`` made inside a fenced step if the task's
    function did not go through ``@fenced``: it would run as a step of the run with no frame,
    no lease check and no stamp (a non-idempotent task repeated after a takeover).

    A task is not a node of the compiled graph, so it cannot be seen before the run's first
    step; it is refused when it is called, before it runs.

    Raises:
        ValueError: naming the task and the decorator that fences it.
    """
    func = getattr(task, "func", task)
    if getattr(func, EFFECT_ATTRIBUTE, None) is not None:
        return
    name = getattr(func, "__name__", repr(func))
    raise ValueError(
        f"task {name!r} was refused before it ran: it is called inside a fenced run but is "
        "not fenced (it would run with no lease check and no stamp). Stack @fenced under "
        "@task: @task then @fenced, or @fenced(effect=Effect.NON_IDEMPOTENT_WRITE) for a "
        "write that must not run twice"
    )

"""The frame of one running step: its fence, its node, its task, and how to find it."""

from __future__ import annotations

from contextvars import ContextVar
from dataclasses import dataclass
from typing import Any

from .effects import Effect
from .errors import ExecutionContextUnavailableError
from .fence import ExecutionFence, RunHandle

__all__ = [
    "CONTEXT_CONFIG_KEY",
    "ExecutionContext",
    "get_execution_context",
]

#: Where the frame is also placed in the step's ``config["configurable"]``.
CONTEXT_CONFIG_KEY = "execution_context"

_current: ContextVar[ExecutionContext | None] = ContextVar(
    "langgraph_fence_execution_context", default=None
)


@dataclass(frozen=True, slots=True, eq=False)
class ExecutionContext:
    """One running step (a node attempt) and the lease it runs under.

    ``fence`` reads the run's lease live and refuses once the step has ended. The frame is
    found with :func:`get_execution_context` (a context variable, so it reaches sync nodes
    in worker threads and subgraphs run inside the node) and at
    ``config["configurable"]["execution_context"]``.

    Attributes:
        fence: the lease this step runs under (the root's, for ParentInstance children).
        node: the node's name.
        task_id: LangGraph's task id of this step.
        attempt: 1 for the first attempt, + 1 per ``RetryPolicy`` retry.
        checkpoint_ns: the step's checkpoint namespace (non-empty inside subgraphs).
        thread_id: the run's thread id.
        effect: what the step declared it does to the world.
    """

    fence: ExecutionFence
    node: str
    task_id: str
    attempt: int
    checkpoint_ns: str
    thread_id: str
    effect: Effect
    _handle: RunHandle
    # The root checkpoint whose superstep this step belongs to (checkpoint_map[""]): the
    # stamps the step makes are cleared by a later root checkpoint.
    _superstep: str = ""

    @property
    def tenant_id(self) -> str:
        """The tenant of the lease."""
        return self.fence.tenant_id

    @property
    def scope_key(self) -> str:
        """The scope key of the lease."""
        return self.fence.scope_key


def get_execution_context() -> ExecutionContext:
    """The frame of the step running now.

    Raises:
        ExecutionContextUnavailableError: no fenced step is running in this context (the
            node was not wrapped with ``@fenced`` / ``fence_graph``, or the call is outside
            a step).
    """
    frame = _current.get()
    if frame is None:
        raise ExecutionContextUnavailableError(
            "no fenced step is running here: get_execution_context() works inside a node "
            "wrapped with @fenced or fence_graph(), run through Instance.ainvoke() or "
            "langgraph_fence.testing.run_node()"
        )
    return frame


def current_frame() -> ExecutionContext | None:
    """The running frame, or ``None`` (no error)."""
    return _current.get()


def _set_frame(frame: ExecutionContext | None) -> Any:
    return _current.set(frame)


def _reset_frame(token: Any) -> None:
    _current.reset(token)

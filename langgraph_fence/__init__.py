"""langgraph-fence: fencing tokens for LangGraph runs.

Every step runs under a live fencing token taken from a lease table; every write made under
a superseded token is refused, and a non-idempotent write that may already have happened is
never repeated.
"""

from importlib import import_module
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    __version__: str
    from langgraph_fence.checkpointers import SqlCheckpointer, SqlStore
    from langgraph_fence.effects import Effect
    from langgraph_fence.errors import (
        ChildFailedError,
        ExecutionBusyError,
        ExecutionContextUnavailableError,
        ExecutionDeadLetteredError,
        ExecutionEndedError,
        ExecutionFencedError,
        ExecutionLeaseHeldError,
        ExecutionLeaseLostError,
        ExecutionSupersededError,
        InstanceFullError,
        LangGraphFenceError,
        RunFailedError,
        find_fence_error,
    )
    from langgraph_fence.events import EventKind, FenceEvent
    from langgraph_fence.execution.callbacks import RunEnd
    from langgraph_fence.execution.children import Child, ChildPlacement
    from langgraph_fence.execution.retries import RunRetry
    from langgraph_fence.execution.sleeps import ExecutionSleeping
    from langgraph_fence.fence import ExecutionFence
    from langgraph_fence.instance import Instance
    from langgraph_fence.lease import (
        ExecutionLeaseRepository,
        Lease,
        LeaseKey,
        LeaseStatus,
        PendingEffect,
    )
    from langgraph_fence.lease.scope import parse_scope_key, scope_key
    from langgraph_fence.lease.stores import MemoryLeaseRepository, SqlLeaseRepository
    from langgraph_fence.queue import RunState, SubmittedRun
    from langgraph_fence.saver.checkpoint import FencedCheckpointer
    from langgraph_fence.saver.store import FencedStore
    from langgraph_fence.steps.context import ExecutionContext, get_execution_context
    from langgraph_fence.steps.graph import fence_graph
    from langgraph_fence.steps.nodes import fenced
    from langgraph_fence.steps.tools import fence_tools

# Each public name is imported from its module on first use (PEP 562): `import
# langgraph_fence` (and the CLI's `--help` and listings) must not load LangGraph.
_WHERE = {
    "Child": "langgraph_fence.execution.children",
    "ChildFailedError": "langgraph_fence.errors",
    "ChildPlacement": "langgraph_fence.execution.children",
    "Effect": "langgraph_fence.effects",
    "ExecutionBusyError": "langgraph_fence.errors",
    "ExecutionContext": "langgraph_fence.steps.context",
    "ExecutionContextUnavailableError": "langgraph_fence.errors",
    "ExecutionSleeping": "langgraph_fence.execution.sleeps",
    "RunRetry": "langgraph_fence.execution.retries",
    "RunEnd": "langgraph_fence.execution.callbacks",
    "EventKind": "langgraph_fence.events",
    "ExecutionDeadLetteredError": "langgraph_fence.errors",
    "ExecutionEndedError": "langgraph_fence.errors",
    "ExecutionFence": "langgraph_fence.fence",
    "ExecutionFencedError": "langgraph_fence.errors",
    "ExecutionLeaseHeldError": "langgraph_fence.errors",
    "ExecutionLeaseLostError": "langgraph_fence.errors",
    "ExecutionLeaseRepository": "langgraph_fence.lease",
    "ExecutionSupersededError": "langgraph_fence.errors",
    "FenceEvent": "langgraph_fence.events",
    "FencedCheckpointer": "langgraph_fence.saver.checkpoint",
    "FencedStore": "langgraph_fence.saver.store",
    "Instance": "langgraph_fence.instance",
    "InstanceFullError": "langgraph_fence.errors",
    "LangGraphFenceError": "langgraph_fence.errors",
    "Lease": "langgraph_fence.lease",
    "LeaseKey": "langgraph_fence.lease",
    "LeaseStatus": "langgraph_fence.lease",
    "MemoryLeaseRepository": "langgraph_fence.lease.stores",
    "PendingEffect": "langgraph_fence.lease",
    "RunFailedError": "langgraph_fence.errors",
    "RunState": "langgraph_fence.queue",
    "SqlCheckpointer": "langgraph_fence.checkpointers",
    "SqlLeaseRepository": "langgraph_fence.lease.stores",
    "SqlStore": "langgraph_fence.checkpointers",
    "SubmittedRun": "langgraph_fence.queue",
    "fence_graph": "langgraph_fence.steps.graph",
    "fence_tools": "langgraph_fence.steps.tools",
    "fenced": "langgraph_fence.steps.nodes",
    "find_fence_error": "langgraph_fence.errors",
    "get_execution_context": "langgraph_fence.steps.context",
    "parse_scope_key": "langgraph_fence.lease.scope",
    "scope_key": "langgraph_fence.lease.scope",
}


def _version() -> str:
    """The installed distribution's version (importlib.metadata costs 60 ms: read once)."""
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("langgraph-fence")
    except PackageNotFoundError:  # a source tree that was never installed
        return "0+unknown"


def __getattr__(name: str) -> Any:
    module = _WHERE.get(name)
    if name == "__version__":
        value: Any = _version()
    elif module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    else:
        value = getattr(import_module(module), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted({*globals(), *_WHERE, "__version__"})


__all__ = [
    "Child",
    "ChildFailedError",
    "ChildPlacement",
    "Effect",
    "EventKind",
    "ExecutionBusyError",
    "ExecutionContext",
    "ExecutionContextUnavailableError",
    "ExecutionDeadLetteredError",
    "ExecutionEndedError",
    "ExecutionFence",
    "ExecutionFencedError",
    "ExecutionLeaseHeldError",
    "ExecutionLeaseLostError",
    "ExecutionLeaseRepository",
    "ExecutionSleeping",
    "ExecutionSupersededError",
    "FenceEvent",
    "FencedCheckpointer",
    "FencedStore",
    "Instance",
    "InstanceFullError",
    "LangGraphFenceError",
    "Lease",
    "LeaseKey",
    "LeaseStatus",
    "MemoryLeaseRepository",
    "PendingEffect",
    "RunEnd",
    "RunFailedError",
    "RunRetry",
    "RunState",
    "SqlCheckpointer",
    "SqlLeaseRepository",
    "SqlStore",
    "SubmittedRun",
    "__version__",
    "fence_graph",
    "fence_tools",
    "fenced",
    "find_fence_error",
    "get_execution_context",
    "parse_scope_key",
    "scope_key",
]

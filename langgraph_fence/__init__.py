"""langgraph-fence: fencing tokens for LangGraph runs.

Every step runs under a live fencing token taken from a lease table; every write made under
a superseded token is refused, and a non-idempotent write that may already have happened is
never repeated.
"""

from importlib import import_module
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    __version__: str
    from .checkpoint import FencedCheckpointer
    from .checkpointers import SqlCheckpointer, SqlStore
    from .children import Child, ChildPlacement
    from .context import ExecutionContext, get_execution_context
    from .effects import Effect
    from .errors import (
        ChildFailedError,
        ExecutionBusyError,
        ExecutionContextUnavailableError,
        ExecutionDeadLetteredError,
        ExecutionEndedError,
        ExecutionFencedError,
        ExecutionLeaseHeldError,
        ExecutionLeaseLostError,
        InstanceFullError,
        LangGraphFenceError,
        RunFailedError,
        find_fence_error,
    )
    from .events import EventKind, FenceEvent
    from .fence import ExecutionFence
    from .graph import fence_graph
    from .instance import Instance
    from .lease import ExecutionLeaseRepository, Lease, LeaseKey, LeaseStatus, PendingEffect
    from .nodes import fenced
    from .queue import RunState, SubmittedRun
    from .scope import parse_scope_key, scope_key
    from .store import FencedStore
    from .stores import MemoryLeaseRepository, SqlLeaseRepository
    from .tools import fence_tools

# Each public name is imported from its module on first use (PEP 562): `import
# langgraph_fence` (and the CLI's `--help` and listings) must not load LangGraph.
_WHERE = {
    "Child": ".children",
    "ChildFailedError": ".errors",
    "ChildPlacement": ".children",
    "Effect": ".effects",
    "ExecutionBusyError": ".errors",
    "ExecutionContext": ".context",
    "ExecutionContextUnavailableError": ".errors",
    "EventKind": ".events",
    "ExecutionDeadLetteredError": ".errors",
    "ExecutionEndedError": ".errors",
    "ExecutionFence": ".fence",
    "ExecutionFencedError": ".errors",
    "ExecutionLeaseHeldError": ".errors",
    "ExecutionLeaseLostError": ".errors",
    "ExecutionLeaseRepository": ".lease",
    "FenceEvent": ".events",
    "FencedCheckpointer": ".checkpoint",
    "FencedStore": ".store",
    "Instance": ".instance",
    "InstanceFullError": ".errors",
    "LangGraphFenceError": ".errors",
    "Lease": ".lease",
    "LeaseKey": ".lease",
    "LeaseStatus": ".lease",
    "MemoryLeaseRepository": ".stores",
    "PendingEffect": ".lease",
    "RunFailedError": ".errors",
    "RunState": ".queue",
    "SqlCheckpointer": ".checkpointers",
    "SqlLeaseRepository": ".stores",
    "SqlStore": ".checkpointers",
    "SubmittedRun": ".queue",
    "fence_graph": ".graph",
    "fence_tools": ".tools",
    "fenced": ".nodes",
    "find_fence_error": ".errors",
    "get_execution_context": ".context",
    "parse_scope_key": ".scope",
    "scope_key": ".scope",
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
        value = getattr(import_module(module, __name__), name)
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
    "RunFailedError",
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

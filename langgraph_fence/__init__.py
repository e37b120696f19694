"""langgraph-fence: fencing tokens for LangGraph runs.

Every step runs under a live fencing token taken from a lease table; every write made under
a superseded token is refused, and a non-idempotent write that may already have happened is
never repeated.
"""

from .checkpoint import FencedCheckpointer
from .context import ExecutionContext, get_execution_context
from .effects import Effect
from .errors import (
    ExecutionContextUnavailableError,
    ExecutionDeadLetteredError,
    ExecutionFencedError,
    ExecutionLeaseHeldError,
    ExecutionLeaseLostError,
    LangGraphFenceError,
    find_fence_error,
)
from .fence import ExecutionFence
from .instance import Instance
from .lease import ExecutionLeaseRepository, Lease, LeaseKey, LeaseStatus, PendingEffect
from .nodes import fence_graph, fenced
from .scope import parse_scope_key, scope_key
from .store import FencedStore
from .stores import MemoryLeaseRepository, SqlLeaseRepository
from .tools import fence_tools

__all__ = [
    "Effect",
    "ExecutionContext",
    "ExecutionContextUnavailableError",
    "ExecutionDeadLetteredError",
    "ExecutionFence",
    "ExecutionFencedError",
    "ExecutionLeaseHeldError",
    "ExecutionLeaseLostError",
    "ExecutionLeaseRepository",
    "FencedCheckpointer",
    "FencedStore",
    "Instance",
    "LangGraphFenceError",
    "Lease",
    "LeaseKey",
    "LeaseStatus",
    "MemoryLeaseRepository",
    "PendingEffect",
    "SqlLeaseRepository",
    "fence_graph",
    "fence_tools",
    "fenced",
    "find_fence_error",
    "get_execution_context",
    "parse_scope_key",
    "scope_key",
]

"""langgraph-fence: fencing tokens for LangGraph runs.

Every step runs under a live fencing token taken from a lease table; every write made under
a superseded token is refused, and a non-idempotent write that may already have happened is
never repeated.
"""

from .checkpoint import FencedCheckpointer
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
from .lease import ExecutionLeaseRepository, Lease, LeaseKey, LeaseStatus, PendingEffect
from .scope import parse_scope_key, scope_key
from .stores import MemoryLeaseRepository, SqlLeaseRepository

__all__ = [
    "Effect",
    "ExecutionContextUnavailableError",
    "ExecutionDeadLetteredError",
    "ExecutionFence",
    "ExecutionFencedError",
    "ExecutionLeaseHeldError",
    "ExecutionLeaseLostError",
    "ExecutionLeaseRepository",
    "FencedCheckpointer",
    "LangGraphFenceError",
    "Lease",
    "LeaseKey",
    "LeaseStatus",
    "MemoryLeaseRepository",
    "PendingEffect",
    "SqlLeaseRepository",
    "find_fence_error",
    "parse_scope_key",
    "scope_key",
]

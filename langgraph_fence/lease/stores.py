"""Lease stores: in memory, and SQL (SQLite through aiosqlite, PostgreSQL through asyncpg)."""

from __future__ import annotations

from typing import Any

from langgraph_fence.lease import ExecutionLeaseRepository
from langgraph_fence.lease.memory import MemoryLeaseRepository
from langgraph_fence.lease.sql import SqlLeaseRepository

__all__ = ["MemoryLeaseRepository", "SqlLeaseRepository", "base_store"]


def base_store(repository: ExecutionLeaseRepository) -> Any:
    """The store under wrappers (``StallableRepository`` and the like keep it at ``inner``).

    Raises:
        ValueError: no ``SqlLeaseRepository`` or ``MemoryLeaseRepository`` is under it.
    """
    store: Any = repository
    for _ in range(8):
        if isinstance(store, SqlLeaseRepository | MemoryLeaseRepository):
            return store
        store = getattr(store, "inner", None)
    raise ValueError(
        f"admin operations need a SqlLeaseRepository or MemoryLeaseRepository under the "
        f"instance's repository, got {type(repository).__name__}"
    )

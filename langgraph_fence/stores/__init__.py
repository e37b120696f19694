"""Lease stores: in memory, and SQL (SQLite through aiosqlite, PostgreSQL through asyncpg)."""

from .memory import MemoryLeaseRepository
from .sql import SqlLeaseRepository

__all__ = ["MemoryLeaseRepository", "SqlLeaseRepository"]

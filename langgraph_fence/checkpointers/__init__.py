"""Checkpoint savers and stores for LangGraph that check the fencing token inside their own
writes."""

from .sql import SqlCheckpointer
from .store import SqlStore

__all__ = ["SqlCheckpointer", "SqlStore"]

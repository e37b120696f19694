"""Checkpoint savers and stores for LangGraph that check the fencing token inside their own
writes."""

from langgraph_fence.checkpointers.sql import SqlCheckpointer
from langgraph_fence.checkpointers.store import SqlStore

__all__ = ["SqlCheckpointer", "SqlStore"]

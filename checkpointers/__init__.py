"""Checkpoint savers for LangGraph that check the fencing token inside their own writes."""

from .sql import SqlCheckpointer

__all__ = ["SqlCheckpointer"]

"""The keys langgraph-fence sets in a run's ``config["configurable"]``."""

from __future__ import annotations

__all__ = ["FENCE_CONFIG_KEY"]

#: Where a run's handle lives in ``config["configurable"]``. The ``__`` prefix keeps it out
#: of persisted checkpoint metadata and tracing.
FENCE_CONFIG_KEY = "__fence"

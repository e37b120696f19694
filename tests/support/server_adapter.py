"""A saver as LangGraph's Agent Server (langgraph-api) holds a custom checkpointer: inside its
own ``_CustomCheckpointerAdapter``, in this process (the conformance suite, the savers'
benchmark), without a server running."""

from __future__ import annotations

import os
from typing import Any

__all__ = ["server_adapter"]

#: What `langgraph dev` sets before langgraph_api reads its configuration (at import).
_DEV_ENVIRONMENT = {
    "LANGGRAPH_RUNTIME_EDITION": "inmem",
    "DATABASE_URI": ":memory:",
    "REDIS_URI": "fake",
    "MIGRATIONS_PATH": "__inmem",
}


def server_adapter(inner: Any) -> Any:
    """``inner`` behind the server's adapter, as ``get_checkpointer()`` hands it to a run."""
    for key, value in _DEV_ENVIRONMENT.items():
        os.environ.setdefault(key, value)
    from langgraph_api._checkpointer._adapter import (
        CheckpointerCapabilities,
        _CustomCheckpointerAdapter,
    )

    return _CustomCheckpointerAdapter(inner, CheckpointerCapabilities.from_type(type(inner)))

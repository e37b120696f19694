"""The earlier import name of :mod:`langgraph_fence.checkpointers`, kept for code written
against it: the very same modules and classes under a second name.

langgraph-fence itself never imports this name, so a module of a user's own called
``checkpointers`` (which Python finds first on the script's path) cannot break it. New code
imports ``langgraph_fence.checkpointers`` (or ``from langgraph_fence import SqlCheckpointer``).
"""

import sys

from langgraph_fence.checkpointers import (
    SqlCheckpointer,
    SqlStore,
    _postgres,
    _rows,
    _sqlite,
    schema,
    sql,
    store,
)

# ``import checkpointers.sql`` finds the module already loaded under its own name: one copy
# of each module, so a class is the same object under both names.
for _module in (_postgres, _rows, _sqlite, schema, sql, store):
    sys.modules[f"{__name__}.{_module.__name__.rsplit('.', 1)[1]}"] = _module

__all__ = ["SqlCheckpointer", "SqlStore"]

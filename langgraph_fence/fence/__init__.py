"""The fence a step runs under: a live view of its run's lease.

:class:`RunHandle` is the one mutable holder of a run's lease state. The runtime renews
through it, the node wrapper stamps through it, the checkpointer reads its token and records
refusals on it; all of them share it by identity through
``config["configurable"]["__fence"]``. :class:`ExecutionFence` is the read-only face a step
sees: it reads the handle live, so a step sees a renewal or a takeover as soon as the handle
knows of it, and a fence used outside its own step (kept past it, or an ancestor's inside a
child step) refuses.
"""

from __future__ import annotations

from langgraph_fence.fence._handle import RunHandle, safety_margin
from langgraph_fence.fence._step import (
    ExecutionFence,
    close_fence,
    enter_step,
    held,
    held_as_is,
    leave_step,
    running_handle,
)
from langgraph_fence.keys import FENCE_CONFIG_KEY

# The public names are ExecutionFence, RunHandle, safety_margin and FENCE_CONFIG_KEY (where
# the handle lives in a config; defined in keys, importable here as it always was); the
# others are what the package's other modules use of a step's fence.
__all__ = [
    "FENCE_CONFIG_KEY",
    "ExecutionFence",
    "RunHandle",
    "close_fence",
    "enter_step",
    "held",
    "held_as_is",
    "leave_step",
    "running_handle",
    "safety_margin",
]

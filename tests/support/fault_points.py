"""Which fault points a graph variant reaches."""

from __future__ import annotations

from langgraph_fence.lease.faults import FAULT_POINTS


def reachable(durability: str) -> list[str]:
    # durability="exit" saves no task writes: the writes.* points are not on its path.
    return [p for p in FAULT_POINTS if not (durability == "exit" and p.startswith("writes."))]

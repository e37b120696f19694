"""pytest plugin for users' own tests of fenced graphs (registered as a pytest11 entry point).

It grows with the runtime: a controlled clock now; the ``leases`` fixture (stall / resume
around the lease contract and an instance's renew timers) and a unit runner that runs one
node with a held lease come with :class:`~langgraph_fence.Instance`.
"""

from __future__ import annotations

__all__ = ["ManualClock"]


class ManualClock:
    """A clock that moves only when told: pass it as a store's and an instance's clock.

    Calling it returns the current time in seconds; :meth:`advance` moves it forward.
    """

    def __init__(self, start: float = 1_000_000.0) -> None:
        self._now = float(start)

    def __call__(self) -> float:
        return self._now

    def advance(self, seconds: float) -> float:
        """Move the clock forward by ``seconds`` (>= 0) and return the new time."""
        if seconds < 0:
            raise ValueError(f"seconds must be >= 0 (clocks do not go back), got {seconds!r}")
        self._now += float(seconds)
        return self._now

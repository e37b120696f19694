"""Run-level retries: a submitted run that fails with its graph's own error runs again, from
its last checkpoint, after a backoff, up to a number of attempts; never over a standing
non-idempotent stamp (a write that may have happened is dead-lettered or failed, not
repeated), and never for a fencing error, a dead letter, a cancel or a lost connection
(those are settled as they always are).

``instance.serve(graphs, run_retries={"orders": RunRetry(attempts=3, backoff=2.0)})``: the
policy is the serving side's, per graph name. A retry gives the lease back ``pending``, not
to be taken before the backoff has passed on the store's clock, in the transaction that
counts the attempt on the run's row (``RunState.attempts``); any worker takes it then, at
the next token.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field

from langgraph_fence.effects import Effect
from langgraph_fence.lease import PendingEffect
from langgraph_fence.validate import MAX_SECONDS, positive_int

__all__ = ["RunRetry", "stamp_stands"]

RetryOn = type[BaseException] | tuple[type[BaseException], ...] | Callable[[BaseException], bool]


@dataclass(frozen=True)
class RunRetry:
    """How a graph's failed runs are retried.

    Attributes:
        attempts: the most attempts of one run, the first included (``3``: two retries).
        backoff: seconds before the first retry.
        factor: each further retry waits this many times longer.
        max_backoff: the longest wait, in seconds.
        retry_on: which errors are retried: an exception class, a tuple of them, or a
            predicate (default: every ``Exception`` the graph raises).

    Raises:
        ValueError: a bad value, named.
    """

    attempts: int = 3
    backoff: float = 1.0
    factor: float = 2.0
    max_backoff: float = 300.0
    retry_on: RetryOn = field(default=Exception)

    def __post_init__(self) -> None:
        positive_int("attempts", self.attempts, what="the first attempt included")
        for name in ("backoff", "max_backoff"):
            value = getattr(self, name)
            if (
                isinstance(value, bool)
                or not isinstance(value, int | float)
                or not (math.isfinite(value) and 0 <= value <= MAX_SECONDS)
            ):
                raise ValueError(f"{name} must be 0 to {MAX_SECONDS:.0e} seconds, got {value!r}")
        factor = self.factor
        if (
            isinstance(factor, bool)
            or not isinstance(factor, int | float)
            or not (math.isfinite(factor) and 1 <= factor <= 1000)
        ):
            raise ValueError(f"factor must be a number from 1 to 1000, got {factor!r}")
        on = self.retry_on
        classes = on if isinstance(on, tuple) else (on,)
        if not callable(on) or (
            isinstance(on, tuple | type)
            and not all(isinstance(c, type) and issubclass(c, BaseException) for c in classes)
        ):
            raise ValueError(
                "retry_on must be an exception class, a tuple of them, or a predicate "
                f"(exception -> bool), got {on!r}"
            )

    def retries(self, exc: BaseException) -> bool:
        """Whether ``exc`` is an error this policy retries."""
        on = self.retry_on
        if isinstance(on, tuple | type):
            return isinstance(exc, on)
        return bool(on(exc))

    def delay(self, failed: int) -> float:
        """Seconds before the next attempt, after ``failed`` attempts failed (1, 2, ...)."""
        return float(min(self.max_backoff, self.backoff * self.factor ** (failed - 1)))


def stamp_stands(stamped: Iterable[PendingEffect]) -> bool:
    """Whether a non-idempotent write the run stamped still stands (``stamped``: the run's
    entries not seen cleared): it may have happened, so the run is not retried (its
    takeover would dead-letter it)."""
    return any(entry.effect is Effect.NON_IDEMPOTENT_WRITE for entry in stamped)

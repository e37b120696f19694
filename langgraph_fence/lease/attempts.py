"""Agent Server run attempts: the newest attempt of a run holds its thread.

LangGraph's Agent Server runs a run again (attempt 2, 3, ...) when it stops hearing from the
worker of the attempt before, which may still be running (langgraph issues #7213, #7417).
The store keeps, per execution and server run, the newest attempt that started and the
epoch it took (:class:`AttemptRow`). Attempts of one run are compared by number only: the
server runs one run of a thread at a time, so attempts of different runs never race for
the thread's lease (a new run waits for the lease of the one before, as any run does).

An attempt older than the newest of its run never starts (:class:`ExecutionSupersededError`),
now or later, whether or not the newer one has ended. A newer attempt finding the lease held
at the epoch an earlier attempt of its run took takes it over at once, in the same
transaction (:func:`decide_supersede`): the earlier attempt is fenced (every later write,
renewal or release of it is refused), and the take decides the stamps it left as any take
does (a non-idempotent one standing dead-letters the execution instead of repeating the
write). Any other holder (an admin's hold, a ``serve()`` takeover, a run of an
``Instance``, a run of another server run) is left to the take, which waits for it.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass, replace
from typing import Any, Protocol, cast

from langgraph_fence.errors import ExecutionSupersededError
from langgraph_fence.lease import Lease, LeaseKey, LeaseStatus
from langgraph_fence.lease.transitions import decide_acquire

__all__ = [
    "Attempt",
    "AttemptRow",
    "AttemptStore",
    "Supersede",
    "attempt_store",
    "decide_supersede",
    "server_attempt",
    "superseded_error",
]

_RUN_ID = re.compile(r"[0-9A-Za-z-]{1,64}")


@dataclass(frozen=True, slots=True)
class Attempt:
    """Attempt ``number`` of Agent Server run ``run_id``."""

    run_id: str
    number: int

    def __post_init__(self) -> None:
        if not isinstance(self.run_id, str) or not _RUN_ID.fullmatch(self.run_id):
            raise ValueError(f"run_id must be the server's run id (a UUID), got {self.run_id!r}")
        number = self.number
        if isinstance(number, bool) or not isinstance(number, int) or not 0 < number < 2**31:
            raise ValueError(f"run_attempt must be a positive int, got {number!r}")
        object.__setattr__(self, "run_id", self.run_id.lower())

    def __str__(self) -> str:
        return f"attempt {self.number} of run {self.run_id}"


@dataclass(frozen=True, slots=True)
class AttemptRow:
    """What the store keeps of a server run of an execution: its newest attempt that
    started, and the epoch that attempt took (``None``: not taken yet)."""

    number: int
    epoch: int | None = None


@dataclass(frozen=True, slots=True)
class Supersede:
    """A start's decision: the row to keep, and the lease to write (``None``: leave it; the
    attempt then takes the lease as any run does)."""

    row: AttemptRow
    lease: Lease | None = None


class AttemptStore(Protocol):
    """A lease store that tells Agent Server attempts apart (the memory and SQL stores)."""

    async def supersede(
        self, key: LeaseKey, attempt: Attempt, holder: str, ttl: float
    ) -> Lease | None: ...

    async def record_epoch(self, key: LeaseKey, attempt: Attempt, epoch: int) -> bool: ...

    async def newest_attempt(self, key: LeaseKey, run_id: str) -> int | None: ...


def attempt_store(repository: object) -> AttemptStore | None:
    """``repository`` if it tells Agent Server attempts apart (:class:`AttemptStore`), else
    ``None`` (a lease store of the user's own)."""
    names = ("supersede", "record_epoch", "newest_attempt")
    if all(callable(getattr(repository, name, None)) for name in names):
        return cast(AttemptStore, repository)
    return None


def server_attempt(config: Mapping[str, Any]) -> Attempt | None:
    """The Agent Server run attempt ``config`` is of, or ``None`` for a run the server did
    not start (no ``langgraph_api_version`` in its metadata).

    Raises:
        ValueError: the server started it but ``config`` lacks the run's id
            (``configurable["run_id"]``) or attempt (``metadata["run_attempt"]``): its
            attempts could not be told apart, so it is refused rather than run unfenced.
    """
    metadata = config.get("metadata")
    if not isinstance(metadata, Mapping) or "langgraph_api_version" not in metadata:
        return None
    configurable = config.get("configurable") or {}
    run_id, number = configurable.get("run_id"), metadata.get("run_attempt")
    if run_id is None or number is None:
        raise ValueError(
            f"an Agent Server run (langgraph-api {metadata['langgraph_api_version']}) without "
            f"configurable['run_id'] ({run_id!r}) or metadata['run_attempt'] ({number!r}): "
            "its attempts cannot be fenced apart, so it is refused; run a langgraph-api "
            "release langgraph_fence.server supports"
        )
    return Attempt(str(run_id), number)


def superseded_error(key: LeaseKey, attempt: Attempt, newest: int) -> ExecutionSupersededError:
    """The refusal of ``attempt`` of ``key`` where attempt ``newest`` of its run started."""
    return ExecutionSupersededError(
        f"execution {key.scope_key!r}: Agent Server {attempt} was superseded by attempt "
        f"{newest} of the same run, which holds the thread; this attempt never runs or writes"
    )


def decide_supersede(
    key: LeaseKey,
    current: Lease | None,
    row: AttemptRow | None,
    attempt: Attempt,
    holder: str,
    ttl: float,
    now: float,
) -> Supersede:
    """Start ``attempt`` of ``key`` for ``holder`` where ``row`` is what the store keeps of
    its run (``None``: nothing) and ``current`` the lease.

    - A newer attempt of the run started before: refused, :class:`ExecutionSupersededError`.
    - The same attempt again (a repeat; a server restarted within its own bookkeeping):
      the row as it is, no lease change.
    - A newer attempt, the lease running at the epoch an earlier attempt of the run took:
      taken over for ``holder`` (epoch + 1; a standing non-idempotent stamp dead-letters it
      instead), the row recording the new attempt and the epoch it took.
    - Otherwise: the row records the new attempt (epoch unknown until its take).
    """
    if row is not None and row.number > attempt.number:
        raise superseded_error(key, attempt, row.number)
    if row is not None and row.number == attempt.number:
        return Supersede(row)
    earlier_holds = (
        row is not None
        and row.epoch is not None
        and current is not None
        and current.status is LeaseStatus.RUNNING
        and current.holder is not None
        and current.epoch == row.epoch
    )
    if not earlier_holds:
        return Supersede(AttemptRow(attempt.number))
    assert current is not None
    # Taken as a take of an expired hold is: the same decision over the stamp set.
    taken = decide_acquire(
        replace(current, expires_at=now), key, holder, ttl, now, store_id=current.store_id
    )
    assert taken is not None
    if taken.status is LeaseStatus.RUNNING:
        taken = replace(taken, reason=None)
    return Supersede(AttemptRow(attempt.number, taken.epoch), taken)

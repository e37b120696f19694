"""The keeper's settings: how many runs an instance holds, how long its loop may stall, and
where its renewals run (in a thread of their own, or on the instance's loop).

Decided with no I/O from the lease TTL, the renew interval and the store an instance runs on
(:mod:`langgraph_fence.execution.keeper` keeps the leases).
"""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable
from typing import TYPE_CHECKING, Any, Literal

from langgraph_fence.lease import ExecutionLeaseRepository

if TYPE_CHECKING:
    from langgraph_fence.lease.sql import SqlLeaseRepository

# Its warnings are the keeper's: one logger for an operator to set.
logger = logging.getLogger("langgraph_fence.keeper")

Sleep = Callable[[float], Awaitable[Any]]

#: The most leases one renewal statement carries; more go out as several statements.
RENEW_BATCH = 1000

#: How many new runs of one instance take their lease at once; more wait their turn. A
#: burst of thousands of starts then queues here, not on the connection pool, where its
#: waits would run out the pool's timeout (measured: 5 000 at once on a pool of 16).
MAX_STARTING = 8

#: Where an instance's renewals run: ``"auto"`` (in the renewer thread where the store and
#: the clock allow it, else on the loop), ``"thread"`` (required: refused where impossible)
#: or ``"loop"``.
Renewer = Literal["auto", "thread", "loop"]

#: The renewer thread keeps renewing while the instance's event loop has not run for up to
#: this many seconds (or the lease TTL, if longer): :func:`loop_stall_bound`.
LOOP_STALL_FLOOR = 10.0


#: How many lease renewals a second one instance plans for when it derives its ``max_held``
#: (:func:`default_max_held`). Measured on a 2-core box with PostgreSQL on it
#: (``benchmarks/bench_scale.py``): 3 000 leases at TTL 3 s (3 000 renewals a second)
#: held with none lost, the renewals' p99 lateness at 18 to 55 ms; 5 000 held on a quiet
#: box, some lost on a loaded one (to garbage-collection pauses that grow with the heap);
#: 10 000 lost. A renewal costs about 20 µs of this process's CPU per lease.
RENEWALS_PER_SECOND = 3000

#: The most executions an instance holds by default, whatever its TTL: the most measured
#: held, with every step ending at once, on one instance (10 000 at TTL 30 s, renewals in
#: the renewer thread).
MAX_HELD_CEILING = 10_000

#: The same where the renewals run on the instance's loop, whose measured limit is lower (a
#: loop kept busy by runs ending at once delays them).
MAX_HELD_CEILING_ON_LOOP = 1_000


def default_max_held(renew_interval: float, *, in_thread: bool) -> int:
    """How many executions an instance holds at most unless told (``max_held``): as many
    as :data:`RENEWALS_PER_SECOND` renews every ``renew_interval``, at most
    :data:`MAX_HELD_CEILING` (:data:`MAX_HELD_CEILING_ON_LOOP` unless ``in_thread``: the
    renewals run in the renewer thread), at least one. TTL 30 s (renewed every 10 s):
    10 000 in the thread; TTL 3 s: 3 000; TTL 1 s: 1 000.

    Only the bound on the count: past it, or sooner wherever renewals are seen running late
    (:attr:`~langgraph_fence.execution.keeper.Keeper.behind`), an instance defers new runs
    rather than lose a lease.
    """
    ceiling = MAX_HELD_CEILING if in_thread else MAX_HELD_CEILING_ON_LOOP
    return max(1, min(ceiling, int(RENEWALS_PER_SECOND * renew_interval)))


def loop_stall_bound(ttl: float) -> float:
    """How long the instance's loop may go without running before the renewer thread stops
    renewing its leases: the lease TTL, at least :data:`LOOP_STALL_FLOOR` seconds.

    Long enough to ride out the busy stretches measured at scale at a short TTL (a 0.1 s
    sleep woke up to 3.6 s late while 10 000 runs ended at once on the on-loop keeper, and
    5.2 s late while 5 000 ended at once with this thread keeping all their leases, so all
    of them wrote their ends); short enough that a deadlocked process is taken over within
    the bound, a renew interval or two to notice (the loop is asked for a sign of life at
    each renewal), and one TTL: about twice the TTL, or the TTL and 10 s where the TTL is
    below 10 s.
    """
    return max(ttl, LOOP_STALL_FLOOR)


def thread_store(
    repository: ExecutionLeaseRepository,
    *,
    renewer: Renewer,
    clock: Callable[[], float] | None,
    sleep: Sleep | None,
) -> SqlLeaseRepository | None:
    """The store the renewer thread renews through, or ``None``: renew on the loop.

    Raises:
        ValueError: ``renewer`` is ``"thread"`` where a thread cannot renew (the message
            says why).
    """
    from langgraph_fence.database import in_memory
    from langgraph_fence.lease.memory import MemoryLeaseRepository
    from langgraph_fence.lease.sql import SqlLeaseRepository

    if renewer == "loop":
        return None
    injected = [name for name, given in (("clock", clock), ("sleep", sleep)) if given]
    why = None
    if injected:
        why = f"the instance has an injected {' and '.join(injected)}, which drive its own loop"
    elif not isinstance(repository, SqlLeaseRepository):
        why = (
            f"its repository is a {type(repository).__name__}: a thread renews through a "
            "SqlLeaseRepository only (a store of another kind, or a wrapper, lives on the loop)"
        )
    elif in_memory(repository.engine):
        why = "its SQLite database is in memory, where no other connection reaches it"
    if why is None:
        assert isinstance(repository, SqlLeaseRepository)
        return repository
    if renewer == "thread":
        raise ValueError(f"renewer='thread' is impossible here: {why}")
    if not injected and not isinstance(repository, SqlLeaseRepository | MemoryLeaseRepository):
        logger.warning(
            "this instance renews its leases on its own event loop (%s): a loop kept busy "
            "for longer than a lease's slack loses the lease; pass renewer='loop' to say "
            "that is meant",
            why,
        )
    return None

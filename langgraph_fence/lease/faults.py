"""Fault points for tests and the demo.

Two kinds:

* A :class:`StallGate` stands between an instance and the world: while it is closed, the
  instance's timers (renewal, lease watchdog) do not fire and its lease-store calls block,
  exactly as if the process were frozen. Its running steps are not frozen (a test drives
  them with events), which is the interesting case: a step that goes on after its lease ran
  out.
* Named fault points (as DBOS's ``debug_trigger_point``): :func:`fault_point` marks a
  boundary a crash or a lost connection can fall on; a test arms one with
  :func:`arm_fault` (kill the process there, raise a connection error, wait for an event).
  Unarmed, a point costs one dict lookup. The points, in the order a write step meets them:

  ``stamp.after``        the step's stamp (and renewal) landed; its body has not started
  ``effect.after``       the step's body returned; its writes are not saved yet
  ``writes.before``      a task's writes are about to be saved (``aput_writes``)
  ``writes.after``       a task's writes were saved (and, with the SQL saver, its entries
                         cleared where their checkpoint is stored); with another saver the
                         clear comes after this point
  ``checkpoint.before``  a checkpoint is about to be saved (``aput``)
  ``checkpoint.after``   a checkpoint was saved (and the entries it clears cleared)
  ``release.before``     the run ended; its lease is about to be released

  Under ``durability="async"`` a superstep's checkpoint and the next superstep's writes are
  saved concurrently, so ``writes.*`` and ``checkpoint.*`` meet in both orders.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable, Iterable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from typing import Any

from langgraph_fence.errors import ExecutionFencedError
from langgraph_fence.lease import (
    ExecutionLeaseRepository,
    Lease,
    LeaseKey,
    LeaseStatus,
    PendingEffect,
)

__all__ = ["FAULT_POINTS", "StallGate", "StallableRepository", "arm_fault", "fault_point"]

#: Every named fault point (see the module docstring).
FAULT_POINTS = (
    "stamp.after",
    "effect.after",
    "writes.before",
    "writes.after",
    "checkpoint.before",
    "checkpoint.after",
    "release.before",
)

FaultAction = Callable[[Mapping[str, Any]], Awaitable[None] | None]
_armed: dict[str, FaultAction] = {}


async def fault_point(name: str, **context: Any) -> None:
    """Run the action armed at ``name``, if any, with ``context`` (the config, the task...).

    The action may raise (a lost connection), block (a stall) or end the process (a kill).
    """
    action = _armed.get(name)
    if action is not None:
        outcome = action(context)
        if outcome is not None:
            await outcome


@contextmanager
def arm_fault(name: str, action: FaultAction) -> Iterator[None]:
    """Arm ``action`` at the fault point ``name`` for the ``with`` block (one per name)."""
    if name not in FAULT_POINTS:
        raise ValueError(f"name must be one of {', '.join(FAULT_POINTS)}, got {name!r}")
    if name in _armed:
        raise ValueError(f"fault point {name!r} is armed already: disarm it first")
    _armed[name] = action
    try:
        yield
    finally:
        del _armed[name]


class StallGate:
    """Open by default; :meth:`stall` closes it, :meth:`resume` opens it again."""

    def __init__(self) -> None:
        self._open = asyncio.Event()
        self._open.set()

    @property
    def stalled(self) -> bool:
        """Whether the gate is closed."""
        return not self._open.is_set()

    def stall(self) -> None:
        """Freeze whatever waits on this gate."""
        self._open.clear()

    def resume(self) -> None:
        """Let everything that waited go on."""
        self._open.set()

    async def wait(self) -> None:
        """Return at once when open; otherwise when the gate is resumed."""
        await self._open.wait()

    def gated_sleep(
        self, sleep: Callable[[float], Awaitable[Any]]
    ) -> Callable[[float], Awaitable[None]]:
        """A ``sleep`` that, when its time has come, also waits for the gate."""

        async def gated(seconds: float) -> None:
            await sleep(seconds)
            await self.wait()

        return gated


class StallableRepository:
    """A lease store whose every call first waits for a :class:`StallGate`."""

    def __init__(self, inner: ExecutionLeaseRepository, gate: StallGate) -> None:
        self.inner = inner
        self.gate = gate

    @property
    def store_id(self) -> str:
        """The inner store's id: leases pass between the two."""
        return self.inner.store_id

    async def acquire(
        self, key: LeaseKey, holder: str, ttl: float, *, reopen: bool = False
    ) -> Lease | None:
        await self.gate.wait()
        return await self.inner.acquire(key, holder, ttl, reopen=reopen)

    async def supersede(self, key: LeaseKey, *args: Any) -> Lease | None:
        await self.gate.wait()
        return await self.inner.supersede(key, *args)  # type: ignore[attr-defined,no-any-return]

    async def record_epoch(self, key: LeaseKey, *args: Any) -> bool:
        await self.gate.wait()
        return await self.inner.record_epoch(key, *args)  # type: ignore[attr-defined,no-any-return]

    async def newest_attempt(self, key: LeaseKey, run_id: str) -> int | None:
        await self.gate.wait()
        return await self.inner.newest_attempt(key, run_id)  # type: ignore[attr-defined,no-any-return]

    async def renew(self, lease: Lease, ttl: float) -> Lease:
        await self.gate.wait()
        return await self.inner.renew(lease, ttl)

    async def renew_many(
        self, leases: Sequence[Lease], ttl: float
    ) -> list[Lease | ExecutionFencedError]:
        await self.gate.wait()
        return await self.inner.renew_many(leases, ttl)

    async def release(self, lease: Lease, status: LeaseStatus, reason: str | None = None) -> Lease:
        await self.gate.wait()
        return await self.inner.release(lease, status, reason)

    async def get(self, key: LeaseKey) -> Lease | None:
        await self.gate.wait()
        return await self.inner.get(key)

    async def mark_pending_effect(self, lease: Lease, effect: PendingEffect, ttl: float) -> Lease:
        await self.gate.wait()
        return await self.inner.mark_pending_effect(lease, effect, ttl)

    async def clear_pending_effects(self, lease: Lease, keys: Iterable[str] | None = None) -> Lease:
        await self.gate.wait()
        return await self.inner.clear_pending_effects(lease, keys)

    async def dead_letter(self, key: LeaseKey, reason: str, *, epoch: int | None = None) -> Lease:
        await self.gate.wait()
        return await self.inner.dead_letter(key, reason, epoch=epoch)

    async def takeover_candidates(
        self, limit: int = 100, *, after_tenant: str | None = None
    ) -> Sequence[Lease]:
        await self.gate.wait()
        return await self.inner.takeover_candidates(limit, after_tenant=after_tenant)

    async def take_over(
        self, candidate: Lease, holder: str, ttl: float, **budget: Any
    ) -> Lease | None:
        await self.gate.wait()
        return await self.inner.take_over(candidate, holder, ttl, **budget)

    async def yield_lease(self, lease: Lease) -> Lease:
        await self.gate.wait()
        return await self.inner.yield_lease(lease)

    async def retake(self, lease: Lease, ttl: float) -> Lease:
        await self.gate.wait()
        return await self.inner.retake(lease, ttl)

    async def now(self) -> float:
        await self.gate.wait()
        return await self.inner.now()

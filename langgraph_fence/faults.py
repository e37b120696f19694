"""Fault points for tests and the demo: stall an instance as a GC pause or SIGSTOP would.

A :class:`StallGate` stands between an instance and the world: while it is closed, the
instance's timers (renewal, lease watchdog) do not fire and its lease-store calls block,
exactly as if the process were frozen. Its running steps are not frozen (a test drives them
with events), which is the interesting case: a step that goes on after its lease ran out.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable, Sequence
from typing import Any

from .lease import ExecutionLeaseRepository, Lease, LeaseKey, LeaseStatus, PendingEffect

__all__ = ["StallGate", "StallableRepository"]


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

    async def renew(self, lease: Lease, ttl: float) -> Lease:
        await self.gate.wait()
        return await self.inner.renew(lease, ttl)

    async def release(self, lease: Lease, status: LeaseStatus, reason: str | None = None) -> Lease:
        await self.gate.wait()
        return await self.inner.release(lease, status, reason)

    async def get(self, key: LeaseKey) -> Lease | None:
        await self.gate.wait()
        return await self.inner.get(key)

    async def mark_pending_effect(self, lease: Lease, effect: PendingEffect, ttl: float) -> Lease:
        await self.gate.wait()
        return await self.inner.mark_pending_effect(lease, effect, ttl)

    async def clear_pending_effect(self, lease: Lease, task_id: str | None = None) -> Lease:
        await self.gate.wait()
        return await self.inner.clear_pending_effect(lease, task_id)

    async def dead_letter(self, key: LeaseKey, reason: str, *, epoch: int | None = None) -> Lease:
        await self.gate.wait()
        return await self.inner.dead_letter(key, reason, epoch=epoch)

    async def takeover_candidates(self, limit: int = 100) -> Sequence[Lease]:
        await self.gate.wait()
        return await self.inner.takeover_candidates(limit)

    async def take_over(self, candidate: Lease, holder: str, ttl: float) -> Lease | None:
        await self.gate.wait()
        return await self.inner.take_over(candidate, holder, ttl)

    async def now(self) -> float:
        await self.gate.wait()
        return await self.inner.now()

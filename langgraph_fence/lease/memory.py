"""The in-memory lease store: the pure transitions over a dict, for tests and one process."""

from __future__ import annotations

import asyncio
import itertools
import time
from collections.abc import AsyncIterator, Callable, Iterable, Sequence
from contextlib import asynccontextmanager
from dataclasses import dataclass
from typing import TypeVar

from langgraph_fence.errors import ExecutionFencedError
from langgraph_fence.lease import Lease, LeaseKey, LeaseStatus, PendingEffect, validate_ttl
from langgraph_fence.lease.attempts import Attempt, AttemptRow, decide_supersede
from langgraph_fence.lease.checks import check_key, check_lease, check_leases, check_limit
from langgraph_fence.lease.transitions import (
    Takeover,
    decide_abandon,
    decide_acquire,
    decide_clear_pending_effects,
    decide_dead_letter,
    decide_mark_pending_effect,
    decide_release,
    decide_renew,
    decide_retake,
    decide_retry,
    decide_take_over,
    decide_yield,
    fair_order,
    is_takeover_candidate,
)

__all__ = ["LockedRow", "MemoryLeaseRepository"]

_ids = itertools.count(1)
#: What a decision makes of a row: a lease, or ``None`` for a take that did not happen.
_Row = TypeVar("_Row", Lease, Lease | None)


@dataclass
class LockedRow:
    """One execution's row under the store's lock (:meth:`MemoryLeaseRepository.locked`):
    ``lease`` is the row as found; set it to write the row, to ``None`` to delete it."""

    key: LeaseKey
    lease: Lease | None


class MemoryLeaseRepository:
    """An :class:`~langgraph_fence.ExecutionLeaseRepository` held in this process's memory.

    Same contract as the SQL stores, with the same decisions (it calls the pure transitions
    of :mod:`langgraph_fence.lease` directly). Leases die with the process: use it for tests
    and single-process tools, never to fence several processes.

    Args:
        clock: the store's clock in seconds; ``time.time`` by default.
    """

    def __init__(self, *, clock: Callable[[], float] | None = None) -> None:
        self._clock = clock or time.time
        self._rows: dict[LeaseKey, Lease] = {}
        # When each row last changed, in the store's clock (the SQL row's updated_at): the
        # takeover window breaks ties of age by it, as the SQL store's does.
        self._updated: dict[LeaseKey, float] = {}
        self._attempts: dict[LeaseKey, dict[str, AttemptRow]] = {}
        self._lock = asyncio.Lock()
        self._store_id = f"memory:{next(_ids)}"

    @property
    def store_id(self) -> str:
        """Identifies this store; leases carry it and other stores refuse them."""
        return self._store_id

    async def now(self) -> float:
        """The store's clock, in seconds."""
        return self._clock()

    @asynccontextmanager
    async def locked(self, key: LeaseKey) -> AsyncIterator[LockedRow]:
        """The row of ``key`` under the store's lock, for one read-decide-write step that
        is not a lease operation (an admin's hold): atomic, as a SQL transaction holding
        the row's lock is. What the block leaves in ``lease`` is written when it ends; an
        error raised in the block writes nothing."""
        async with self._lock:
            row = LockedRow(key, self._rows.get(key))
            found = row.lease
            yield row
            if row.lease is not found:
                if row.lease is None:
                    self._rows.pop(key, None)
                    self._updated.pop(key, None)
                else:
                    self._rows[key] = row.lease
                    self._updated[key] = self._clock()

    async def _write(self, key: LeaseKey, decide: Callable[[Lease | None], _Row]) -> _Row:
        """Keep what ``decide`` makes of the row of ``key`` (``None``: keep the row as it
        is), under the store's lock: one atomic step, as each SQL statement is. A refusal
        ``decide`` raises changes nothing."""
        async with self.locked(key) as row:
            written = decide(row.lease)
            if written is not None:
                row.lease = written
            return written

    async def acquire(
        self, key: LeaseKey, holder: str, ttl: float, *, reopen: bool = False
    ) -> Lease | None:
        """Take the lease (absent: epoch 1; free or expired: epoch + 1), or ``None``."""
        check_key(key)
        return await self._write(
            key,
            lambda row: decide_acquire(
                row, key, holder, ttl, self._clock(), reopen=reopen, store_id=self._store_id
            ),
        )

    async def supersede(
        self, key: LeaseKey, attempt: Attempt, holder: str, ttl: float
    ) -> Lease | None:
        """Start Agent Server ``attempt`` of ``key`` for ``holder``
        (:mod:`langgraph_fence.lease.attempts`): the lease taken over from an earlier attempt
        of its run, or ``None``.

        Raises:
            ExecutionSupersededError: a newer attempt of the run started; nothing written.
        """
        check_key(key)
        async with self.locked(key) as row:
            runs = self._attempts.setdefault(key, {})
            decided = decide_supersede(
                key, row.lease, runs.get(attempt.run_id), attempt, holder, ttl, self._clock()
            )
            runs[attempt.run_id] = decided.row
            if decided.lease is not None:
                row.lease = decided.lease
            return decided.lease

    async def record_epoch(self, key: LeaseKey, attempt: Attempt, epoch: int) -> bool:
        """Record that ``attempt`` of ``key`` took ``epoch``; ``False`` when a newer attempt
        of its run started meanwhile."""
        async with self.locked(key):
            runs = self._attempts.get(key, {})
            found = runs.get(attempt.run_id)
            if found is None or found.number != attempt.number:
                return False
            runs[attempt.run_id] = AttemptRow(attempt.number, epoch)
            return True

    async def newest_attempt(self, key: LeaseKey, run_id: str) -> int | None:
        """The newest attempt of server run ``run_id`` of ``key`` that started, or ``None``."""
        found = self._attempts.get(key, {}).get(run_id.lower())
        return None if found is None else found.number

    async def renew(self, lease: Lease, ttl: float) -> Lease:
        """Extend the hold to now + ``ttl``; guarded."""
        check_lease(self, lease)
        return await self._write(
            lease.key, lambda row: decide_renew(row, lease, ttl, self._clock())
        )

    async def renew_many(
        self, leases: Sequence[Lease], ttl: float
    ) -> list[Lease | ExecutionFencedError]:
        """Renew each of ``leases`` (guarded, each on its own) at one store time."""
        leases = check_leases(self, leases)
        ttl = validate_ttl(ttl)
        answers: list[Lease | ExecutionFencedError] = []
        async with self._lock:
            now = self._clock()
            for lease in leases:
                try:
                    renewed = decide_renew(self._rows.get(lease.key), lease, ttl, now)
                except ExecutionFencedError as refused:
                    answers.append(refused)
                    continue
                self._rows[lease.key] = renewed
                self._updated[lease.key] = now
                answers.append(renewed)
        return answers

    async def release(self, lease: Lease, status: LeaseStatus, reason: str | None = None) -> Lease:
        """Give the lease up with ``status``; guarded."""
        check_lease(self, lease)
        return await self._write(lease.key, lambda row: decide_release(row, lease, status, reason))

    async def get(self, key: LeaseKey) -> Lease | None:
        """The lease of ``key`` as stored now, or ``None``."""
        check_key(key)
        return self._rows.get(key)

    async def mark_pending_effect(self, lease: Lease, effect: PendingEffect, ttl: float) -> Lease:
        """Add ``effect`` to the stamp set and renew, in one guarded write."""
        check_lease(self, lease)
        return await self._write(
            lease.key,
            lambda row: decide_mark_pending_effect(row, lease, effect, ttl, self._clock()),
        )

    async def clear_pending_effects(self, lease: Lease, keys: Iterable[str] | None = None) -> Lease:
        """Remove the entries ``keys`` (all with ``None``) from the stamp set; guarded."""
        check_lease(self, lease)
        return await self._write(
            lease.key, lambda row: decide_clear_pending_effects(row, lease, keys)
        )

    async def dead_letter(self, key: LeaseKey, reason: str, *, epoch: int | None = None) -> Lease:
        """End the execution as ``dead_lettered``; guarded by ``epoch`` when given."""
        check_key(key)
        return await self._write(key, lambda row: decide_dead_letter(row, key, reason, epoch=epoch))

    async def takeover_candidates(
        self, limit: int = 100, *, after_tenant: str | None = None
    ) -> Sequence[Lease]:
        """Leases any instance may take now, in claim order from ``after_tenant``: the
        window the SQL store's query picks (each tenant's oldest first), in
        :func:`~langgraph_fence.lease.transitions.fair_order`."""
        check_limit(limit)
        now = self._clock()
        found = [lease for lease in self._rows.values() if is_takeover_candidate(lease, now)]

        found.sort(
            key=lambda lease: (lease.expires_at or 0.0, self._updated[lease.key], lease.scope_key)
        )
        # The window, as the SQL store's query picks it: by rank within the tenant, then age
        # (a stable sort by rank keeps each rank in the order of age).
        rank: dict[str, int] = {}
        ranked = []
        for lease in found:
            tenant = lease.key.tenant_id
            rank[tenant] = rank.get(tenant, 0) + 1
            ranked.append((rank[tenant], lease))
        ranked.sort(key=lambda pair: pair[0])
        return fair_order([lease for _, lease in ranked[:limit]], after_tenant)

    async def take_over(
        self,
        candidate: Lease,
        holder: str,
        ttl: float,
        *,
        progress_mark: str | None = None,
        max_takeovers: int | None = None,
    ) -> Lease | None:
        """Take a candidate over and decide its fate (resume or dead-letter), guarded."""
        check_lease(self, candidate)
        taker = Takeover(holder, ttl, progress_mark, max_takeovers)
        return await self._write(
            candidate.key,
            lambda row: decide_take_over(row, candidate, taker, self._clock()),
        )

    async def yield_lease(self, lease: Lease) -> Lease:
        """Give the hold up while the tree waits for remote children; guarded."""
        check_lease(self, lease)
        return await self._write(lease.key, lambda row: decide_yield(row, lease))

    async def retake(self, lease: Lease, ttl: float) -> Lease:
        """Take ``lease`` again at epoch + 1 for its holder, unless anyone else took it."""
        check_lease(self, lease)
        return await self._write(
            lease.key, lambda row: decide_retake(row, lease, ttl, self._clock())
        )

    async def retry(self, key: LeaseKey) -> Lease:
        """Make a dead-lettered execution ``pending`` again, its takeover budget reset
        (:func:`~langgraph_fence.lease.transitions.decide_retry`)."""
        check_key(key)
        return await self._write(key, lambda row: decide_retry(row, key))

    async def abandon(self, key: LeaseKey, reason: str) -> Lease:
        """End a dead-lettered execution ``failed``, its reason the operator's
        (:func:`~langgraph_fence.lease.transitions.decide_abandon`)."""
        check_key(key)
        return await self._write(key, lambda row: decide_abandon(row, key, reason))

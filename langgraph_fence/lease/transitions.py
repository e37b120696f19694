"""The lease's transitions: what every lease operation means, decided by a pure function
over frozen values (:mod:`langgraph_fence.lease` holds the values and the contract).

Acquire, take over, renew, release, yield and re-take, stamp and clear, dead-letter, and
an operator's retry or abandon: the stores translate each function into one statement;
:class:`~langgraph_fence.lease.memory.MemoryLeaseRepository` calls them directly and the
property tests use them as the reference model for the SQL stores.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass, replace
from typing import Any

from langgraph_fence.errors import ExecutionFencedError
from langgraph_fence.lease import (
    RELEASE_STATUSES,
    REOPENABLE_STATUSES,
    RESOLVABLE_STATUSES,
    TERMINAL_STATUSES,
    Lease,
    LeaseKey,
    LeaseStatus,
    PendingEffect,
    check_text,
    clean_reason,
    non_idempotent_standing,
    validate_holder,
    validate_pending_effect,
    validate_ttl,
    with_effects,
)
from langgraph_fence.lease.guard import holds
from langgraph_fence.validate import positive_int

__all__ = [
    "DEFAULT_MAX_TAKEOVERS",
    "Takeover",
    "abandon_reason",
    "budget_reason",
    "dead_letter_reason",
    "decide_abandon",
    "decide_acquire",
    "decide_clear_pending_effects",
    "decide_dead_letter",
    "decide_mark_pending_effect",
    "decide_release",
    "decide_renew",
    "decide_retake",
    "decide_retry",
    "decide_take_over",
    "decide_yield",
    "fair_order",
    "is_takeover_candidate",
    "is_yielded",
    "release_status",
    "standing_writes",
    "unheld",
    "validate_effect_keys",
    "validate_max_takeovers",
    "validate_progress_mark",
]


def is_takeover_candidate(lease: Lease, now: float) -> bool:
    """A lease any instance may take: running but expired, or pending and free (a pending
    lease with ``expires_at`` set is free from then on: a woken yielded tree, left to its
    waiter until then)."""
    if lease.status is LeaseStatus.RUNNING:
        return lease.expires_at is None or lease.expires_at <= now
    return (
        lease.status is LeaseStatus.PENDING
        and lease.holder is None
        and (lease.expires_at is None or lease.expires_at <= now)
    )


def is_yielded(status: LeaseStatus | str, holder: str | None) -> bool:
    """Whether a lease of ``status`` and ``holder`` is yielded: its run still goes on (it
    waits for remote children), so it has not ended, though nobody holds it now."""
    return status == LeaseStatus.WAITING and holder is not None


def decide_yield(current: Lease | None, lease: Lease) -> Lease:
    """Give the hold up while the tree waits for remote children: guarded like every holder
    operation; the lease becomes ``waiting`` with its holder kept (yielded), no expiry, the
    epoch and stamp set unchanged. Nothing writes under it (the guard wants ``running``)
    and no instance takes it over until :func:`decide_retake` or a wake makes it pending.
    """
    held = _guard(current, lease, action="yield")
    return replace(held, status=LeaseStatus.WAITING, expires_at=None)


def _retakeable(current: Lease, lease: Lease) -> bool:
    """Whether ``current`` is still ``lease``'s to take again: the same epoch, and either
    still its holder's (running, or yielded) or woken for its waiter (pending with a
    not-before time, nobody holding it). Any take by another moved the epoch on."""
    if current.epoch != lease.epoch:
        return False
    if current.holder is not None:
        return current.holder == lease.holder and current.status in (
            LeaseStatus.RUNNING,
            LeaseStatus.WAITING,
        )
    return current.status is LeaseStatus.PENDING and current.expires_at is not None


def decide_retake(current: Lease | None, lease: Lease, ttl: float, now: float) -> Lease:
    """Take a yielded lease again for its holder: epoch + 1, ``running`` until ``now +
    ttl``, the stamp set kept (the same run goes on). Refused (``ExecutionFencedError``,
    the epoch seen) once anyone else took it: the waiter must stop, the new holder re-runs
    the waiting step.
    """
    ttl = validate_ttl(ttl)
    if current is None or not _retakeable(current, lease):
        raise fenced_error(lease, current, action="retake")
    return replace(
        current,
        holder=lease.holder,
        epoch=current.epoch + 1,
        expires_at=now + ttl,
        status=LeaseStatus.RUNNING,
        reason=None,
    )


def _is_held(lease: Lease, now: float) -> bool:
    """Held: running for a holder whose hold has not expired; yielded (its holder waits
    for remote children and takes it again; no one else may take it meanwhile); or woken
    and before its not-before time (pending, no holder, ``expires_at`` in the future: left
    to its waiter, as :func:`is_takeover_candidate` leaves it)."""
    if is_yielded(lease.status, lease.holder):
        return True
    if lease.expires_at is None or lease.expires_at <= now:
        return False
    if lease.status is LeaseStatus.PENDING:
        return lease.holder is None
    return lease.status is LeaseStatus.RUNNING and lease.holder is not None


def decide_acquire(
    current: Lease | None,
    key: LeaseKey,
    holder: str,
    ttl: float,
    now: float,
    *,
    reopen: bool = False,
    store_id: str = "",
) -> Lease | None:
    """Take the lease of ``key`` for ``holder``, or ``None`` if it may not be taken; a take
    decides a standing stamp at once, as :func:`decide_take_over` does (guarantee 3).

    Taken when absent (epoch 1), free, or expired (epoch + 1). Never taken while another
    holder's hold has not expired, and never in a terminal status, except that ``reopen``
    lets a new run start again on a ``done`` or ``failed`` execution: a new turn on a
    finished thread, or a resume of it from one of its checkpoints (after an error, a
    replay, a fork), at the next token like any take. A dead-lettered execution is never
    reopened.

    The stamp set, when the take happens: with any ``NON_IDEMPOTENT_WRITE`` entry standing
    the execution is dead-lettered instead (epoch + 1, no holder, the set kept for
    inspection, the reason naming every such entry, "resumed at token N by holder"): the
    returned lease is then ``dead_lettered`` and the caller must not run. With only
    idempotent entries (or none) it is taken and the set cleared: the run stamps again
    before it repeats a write. The SQL stores decide this in their one acquire statement.
    """
    validate_holder(holder)
    ttl = validate_ttl(ttl)
    if current is None:
        return Lease(key, holder, 1, now + ttl, (), LeaseStatus.RUNNING, None, store_id)
    if current.status in TERMINAL_STATUSES and not (
        reopen and current.status in REOPENABLE_STATUSES
    ):
        return None
    if _is_held(current, now):
        return None
    epoch = current.epoch + 1
    standing = non_idempotent_standing(current)
    if standing:
        return _taken(
            current, epoch, None, None, dead_letter_reason(standing, epoch, holder, how="resumed")
        )
    return _taken(current, epoch, holder, now + ttl, None)


def _taken(
    current: Lease,
    epoch: int,
    holder: str | None,
    expires_at: float | None,
    reason: str | None,
) -> Lease:
    """``current`` taken at ``epoch``: dead-lettered with ``reason`` (the stamp set kept for
    inspection), or else running for ``holder`` until ``expires_at``, the set cleared."""
    if reason is not None:
        return unheld(current, LeaseStatus.DEAD_LETTERED, reason, epoch=epoch)
    return replace(
        current,
        holder=holder,
        epoch=epoch,
        expires_at=expires_at,
        status=LeaseStatus.RUNNING,
        pending_effects=(),
        reason=None,
    )


def unheld(lease: Lease, status: LeaseStatus, reason: str | None, **changes: Any) -> Lease:
    """``lease`` as nobody holds it (no holder, no expiry) with ``status`` and ``reason``,
    and ``changes`` to its other fields: how a release, a dead letter and an operator's
    retry or abandon leave the row."""
    return replace(lease, holder=None, expires_at=None, status=status, reason=reason, **changes)


def _guard(current: Lease | None, lease: Lease, *, action: str) -> Lease:
    """The guard of every holder operation (:func:`~langgraph_fence.lease.guard.holds`)."""
    if not holds(lease, current):
        raise fenced_error(lease, current, action=action)
    assert current is not None
    return current


def fenced_error(lease: Lease, current: Lease | None, *, action: str) -> ExecutionFencedError:
    """The error for a holder operation refused because ``lease`` is no longer current."""
    if current is None:
        seen = "no lease row"
        token_seen = None
    else:
        token_seen = current.epoch
        seen = f"epoch {current.epoch}, holder {current.holder!r}, status {current.status.value}"
        if current.status is LeaseStatus.DEAD_LETTERED and current.reason:
            seen += f" ({current.reason})"
    return ExecutionFencedError(
        f"{action} refused for execution {lease.scope_key!r}: this worker holds token "
        f"{lease.epoch} (holder {lease.holder!r}) but the store has {seen}. The execution was "
        "taken over or ended; stop this run, it must not write again.",
        scope_key=lease.scope_key,
        token_held=lease.epoch,
        token_seen=token_seen,
    )


def decide_renew(current: Lease | None, lease: Lease, ttl: float, now: float) -> Lease:
    """Extend the hold to ``now + ttl``; refused (``ExecutionFencedError``) unless current.

    A hold that expired but was not taken over is still current: nobody else wrote under a
    newer token, so renewing it is safe.
    """
    ttl = validate_ttl(ttl)
    held = _guard(current, lease, action="renew")
    return replace(held, expires_at=now + ttl)


def release_status(status: LeaseStatus | str) -> LeaseStatus:
    """``status`` as a status ``release`` accepts, or ``ValueError`` naming the allowed ones."""
    allowed = ", ".join(sorted(s.value for s in RELEASE_STATUSES))
    try:
        value = LeaseStatus(status)
    except ValueError:
        value = None
    if value not in RELEASE_STATUSES:
        raise ValueError(
            f"status must be one of {allowed} for release, got {status!r}"
            " (end an execution as dead_lettered with dead_letter())"
        )
    assert value is not None
    return value


def decide_release(
    current: Lease | None, lease: Lease, status: LeaseStatus, reason: str | None = None
) -> Lease:
    """Give the lease up with ``status``; the epoch stays, the holder and expiry are cleared.

    ``done`` also clears the stamp set: a run that ended ``done`` recorded every step it
    ran, so nothing of it is repeated. Any other status keeps the set for the next taker.
    """
    status = release_status(status)
    reason = clean_reason(reason)
    held = _guard(current, lease, action="release")
    effects = () if status is LeaseStatus.DONE else held.pending_effects
    # A run that ended done or reached an interrupt got somewhere: its earlier crashes no
    # longer count against the takeover budget.
    takeovers = 0 if status in _PROGRESS_STATUSES else held.takeovers
    return unheld(held, status, reason, pending_effects=effects, takeovers=takeovers)


#: Release statuses that prove the run progressed (the takeover budget starts again).
_PROGRESS_STATUSES = frozenset({LeaseStatus.DONE, LeaseStatus.WAITING})


def decide_mark_pending_effect(
    current: Lease | None, lease: Lease, effect: PendingEffect, ttl: float, now: float
) -> Lease:
    """Add ``effect`` to the stamp set (replacing an entry of its key) and renew, in one
    guarded write; a lost lease stamps nothing."""
    ttl = validate_ttl(ttl)
    effect = validate_pending_effect(effect)
    held = _guard(current, lease, action="mark_pending_effect")
    return with_effects(replace(held, expires_at=now + ttl), (*held.pending_effects, effect))


def validate_effect_keys(keys: Iterable[str] | None) -> tuple[str, ...] | None:
    """``keys`` as a tuple of entry keys, ``None`` meaning every entry; else ``ValueError``."""
    if keys is None:
        return None
    if isinstance(keys, str):
        raise ValueError(f"keys must be a collection of entry keys, not one str: {keys!r}")
    found = tuple(keys)
    for key in found:
        check_text(key, "keys", "the key of a stamp-set entry (PendingEffect.key)")
    return found


def decide_clear_pending_effects(
    current: Lease | None, lease: Lease, keys: Iterable[str] | None = None
) -> Lease:
    """Remove the entries ``keys`` (every entry with ``None``) from the stamp set; guarded,
    so a lost lease's stamps stand for the taker to see. Other entries (a parallel task's)
    stand; a key not in the set is no error."""
    wanted = validate_effect_keys(keys)
    held = _guard(current, lease, action="clear_pending_effects")
    if wanted is None:
        return replace(held, pending_effects=())
    gone = set(wanted)
    return replace(
        held, pending_effects=tuple(e for e in held.pending_effects if e.key not in gone)
    )


def decide_dead_letter(
    current: Lease | None, key: LeaseKey, reason: str, *, epoch: int | None = None
) -> Lease:
    """End the execution as ``dead_lettered`` with ``reason``.

    With ``epoch``, refused (``ExecutionFencedError``) unless the lease is still at that
    epoch, so a decision taken on a stale read never ends an execution someone else took.
    Raises ``KeyError`` when there is no lease for ``key``.
    """
    reason = clean_reason(reason, required=True)
    if current is None:
        raise KeyError(f"no lease for execution {key.scope_key!r}")
    if epoch is not None and current.epoch != epoch:
        probe = replace(current, epoch=epoch)
        raise fenced_error(probe, current, action="dead_letter")
    return unheld(current, LeaseStatus.DEAD_LETTERED, reason)


def standing_writes(effects: Iterable[PendingEffect]) -> str:
    """``node 'a' at token 1, node 'b' at token 1``: the entries named in order of key.

    The SQL stores build the same text in their take-over statement.
    """
    return ", ".join(f"node '{e.node}' at token {e.token}" for e in effects)


def dead_letter_reason(
    effects: Sequence[PendingEffect], epoch: int, holder: str, *, how: str = "taken over"
) -> str:
    """Why an execution found mid non-idempotent write(s) was dead-lettered when it was
    ``how`` (``"taken over"`` by ``serve()``, ``"resumed"`` by a new run of the thread)."""
    return (
        f"{how} at token {epoch} by {holder}: non-idempotent writes stamped and never "
        f"cleared: {standing_writes(effects)}; they may have happened, so the execution is not "
        "repeated"
    )


#: How many takeovers without progress ``serve()`` allows by default before it dead-letters.
DEFAULT_MAX_TAKEOVERS = 3


def validate_max_takeovers(value: int | None) -> int | None:
    """``value`` if an int >= 1 (or ``None``: no budget), else ``ValueError`` saying so."""
    if value is None:
        return None
    return positive_int(
        "max_takeovers",
        value,
        what="how many takeovers in a row without a new checkpoint an execution gets "
        "before it is dead-lettered",
    )


def validate_progress_mark(value: str | None) -> str | None:
    """``value`` if ``None`` or a storable non-empty str, else ``ValueError``."""
    if value is None:
        return None
    return check_text(value, "progress_mark", "the id of the thread's latest checkpoint")


def budget_reason(current: Lease, epoch: int, holder: str, max_takeovers: int) -> str:
    """Why an execution over its takeover budget was dead-lettered when taken at ``epoch``.

    The SQL stores build the same text in their take-over statement.
    """
    return (
        f"taken over at token {epoch} by {holder}: crashed {current.takeovers} workers in a "
        f"row with no new checkpoint (the last {current.holder or ''} at token "
        f"{current.epoch}, where serve() ran it alone: the likely cause), over the takeover "
        f"budget (max_takeovers={max_takeovers}); fix "
        "the step, then `langgraph-fence resolve --retry` runs it again"
    )


@dataclass(frozen=True)
class Takeover:
    """What a taker brings to a take-over, checked once on creation: who takes
    (``holder``), for how long (``ttl``), the thread's progress as it sees it
    (``progress_mark``: its latest checkpoint id) and the takeover budget (``max_takeovers``,
    ``None``: no budget)."""

    holder: str
    ttl: float
    progress_mark: str | None = None
    max_takeovers: int | None = None

    def __post_init__(self) -> None:
        validate_holder(self.holder)
        object.__setattr__(self, "ttl", validate_ttl(self.ttl))
        object.__setattr__(self, "progress_mark", validate_progress_mark(self.progress_mark))
        object.__setattr__(self, "max_takeovers", validate_max_takeovers(self.max_takeovers))


def decide_take_over(
    current: Lease | None, candidate: Lease, taker: Takeover, now: float
) -> Lease | None:
    """Take over an execution found as a takeover candidate, deciding its fate at once.

    ``None`` when it is no longer the candidate that was found (its holder renewed it, or
    another instance took it: the epoch moved or it is no longer expired). Otherwise the
    epoch goes + 1 and, with any ``NON_IDEMPOTENT_WRITE`` entry standing in the stamp set,
    the execution is dead-lettered (the set is kept for inspection; the reason names every
    such entry); with only idempotent entries (or none) it is taken for the taker's holder
    and the set is cleared: the resumed run stamps again before it repeats a write.

    The takeover budget: a progress mark other than the one the last take stored is
    progress and starts the count again. A take of an expired holder counts 1 (a pending
    execution, handed back or never started, counts nothing: nobody crashed). A take that
    would count more than the taker's ``max_takeovers`` dead-letters the execution instead,
    with the reason "crashed N workers": those that took it and died without a checkpoint.
    """
    if current is None or current.epoch != candidate.epoch:
        return None
    if not is_takeover_candidate(current, now):
        return None
    epoch = current.epoch + 1
    holder, budget = taker.holder, taker.max_takeovers
    crashed = current.status is LeaseStatus.RUNNING
    progressed = current.progress_mark != taker.progress_mark
    takeovers = (0 if progressed else current.takeovers) + (1 if crashed else 0)
    standing = non_idempotent_standing(current)
    reason = None
    if standing:
        reason = dead_letter_reason(standing, epoch, holder)
    elif crashed and budget is not None and takeovers > budget:
        reason = budget_reason(current, epoch, holder, budget)
    taken = _taken(current, epoch, holder, now + taker.ttl, reason)
    return replace(taken, takeovers=takeovers, progress_mark=taker.progress_mark)


def _resolvable(current: Lease | None, key: LeaseKey, action: str) -> Lease:
    """``current`` if dead-lettered or cancelled: ``KeyError`` when absent, else
    ``ValueError`` saying that only those can be ``action``."""
    if current is None:
        raise KeyError(f"no lease for execution {key.scope_key!r}")
    if current.status not in RESOLVABLE_STATUSES:
        raise ValueError(
            f"execution {key.scope_key!r} is {current.status.value}, not dead_lettered or "
            f"cancelled: only a dead-lettered or cancelled execution can be {action}"
        )
    return current


def decide_retry(current: Lease | None, key: LeaseKey) -> Lease:
    """Make a dead-lettered or cancelled execution ``pending`` again, its takeover budget
    reset.

    The operator's decision after fixing what killed it (``langgraph-fence resolve
    --retry``): any instance's ``serve()`` then takes it and resumes it from its last
    checkpoint. The epoch stays (the next take is + 1). Refused (``ValueError``) unless it
    is dead-lettered or cancelled, and while a ``NON_IDEMPOTENT_WRITE`` entry stands in its
    stamp set: that write may have happened, and a retry would repeat it. Raises
    ``KeyError`` when there is no lease for ``key``.
    """
    current = _resolvable(current, key, "retried")
    standing = non_idempotent_standing(current)
    if standing:
        raise ValueError(
            f"execution {key.scope_key!r} cannot be retried: {standing_writes(standing)} "
            "stamped a non-idempotent write that may have happened, and a retry would repeat "
            "it; settle it by hand and leave the execution dead-lettered"
        )
    return unheld(current, LeaseStatus.PENDING, None, takeovers=0)


def abandon_reason(text: str) -> str:
    """The reason an abandoned execution keeps: ``abandoned by operator: <text>``.

    Raises:
        ValueError: ``text`` is not a str, or is empty or only whitespace.
    """
    if not isinstance(text, str) or not text.strip():
        raise ValueError(
            f"reason must be a non-empty text saying why the execution is abandoned (what was "
            f"checked, by whom), got {text!r}"
        )
    return clean_reason(f"abandoned by operator: {text.strip()}", required=True)


def decide_abandon(current: Lease | None, key: LeaseKey, reason: str) -> Lease:
    """End a dead-lettered or cancelled execution ``failed`` with ``abandon_reason(reason)``.

    The operator's decision after a person checked the side effect a dead letter may have
    left (``langgraph-fence resolve --abandon --reason TEXT``): nothing resumes it. The
    epoch stays; the stamp set is cleared, the operator's word standing for the writes it
    named (else a new turn on the thread, reopening the failed execution, would be
    dead-lettered again for a write already settled). Refused (``ValueError``) unless it is
    dead-lettered or cancelled; raises ``KeyError`` when there is no lease for ``key``.
    """
    stored = abandon_reason(reason)
    current = _resolvable(current, key, "abandoned")
    return unheld(current, LeaseStatus.FAILED, stored, pending_effects=())


def fair_order(candidates: Sequence[Lease], after_tenant: str | None) -> list[Lease]:
    """``candidates`` in the order a worker claims them: round-robin by tenant.

    Each tenant's first candidate (in the given order: its oldest), then each one's second,
    and so on; among the tenants at one rank, those after ``after_tenant`` (the tenant this
    worker claimed for last) come first, in tenant order, then the rest. So one tenant's
    burst does not starve the others, even one claim per look. Every store returns its
    candidates in this order (:meth:`ExecutionLeaseRepository.takeover_candidates`); the SQL
    store's query only picks the window (ranked by tenant, so it holds every waiting
    tenant's oldest).
    """
    seen: dict[str, int] = {}
    ranked = []
    for index, lease in enumerate(candidates):
        tenant = lease.key.tenant_id
        rank = seen[tenant] = seen.get(tenant, -1) + 1
        wrapped = after_tenant is not None and tenant <= after_tenant
        ranked.append(((rank, wrapped, tenant, index), lease))
    ranked.sort(key=lambda pair: pair[0])
    return [lease for _, lease in ranked]

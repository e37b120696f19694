"""The lease contract: its values, their checks, and the repository protocol.

Every lease transition (acquire, renew, release, stamp, clear, dead-letter, expire) is
decided by a pure function over these frozen values in :mod:`langgraph_fence.lease.transitions`.

The token of a lease is its **epoch**: 1 for the first holder of a key, + 1 with every take,
counted per key. It is never a database revision or a global sequence.
"""

from __future__ import annotations

import enum
import functools
import re
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, replace
from typing import Literal, Protocol, overload, runtime_checkable

from langgraph_fence.effects import Effect
from langgraph_fence.errors import ExecutionFencedError
from langgraph_fence.lease.scope import scope_key
from langgraph_fence.validate import positive_seconds, text_id

__all__ = [
    "TERMINAL_STATUSES",
    "ExecutionLeaseRepository",
    "Lease",
    "LeaseKey",
    "LeaseStatus",
    "PendingEffect",
    "clean_reason",
    "non_idempotent_standing",
    "validate_holder",
    "validate_pending_effect",
    "validate_ttl",
    "with_effects",
]


class LeaseStatus(enum.StrEnum):
    """Where an execution stands.

    ``pending``: recorded, not started or handed back for any instance to take.
    ``running``: held by an instance (``holder`` set) until ``expires_at``.
    ``waiting``: released while it waits for input (an interrupt); with ``holder`` still
    set, **yielded**: its holder gave the hold up while the tree's only running steps wait
    for remote children (:func:`decide_yield`), and takes it again (:func:`decide_retake`).
    ``done``, ``failed``, ``dead_lettered``, ``cancelled``: terminal; ``acquire`` never
    takes them over. ``cancelled``: ended on purpose by its submitter
    (:meth:`~langgraph_fence.SubmittedRun.cancel`), never by a fault; a new run of the
    execution resumes it, and so does ``langgraph-fence resolve --retry``.
    """

    PENDING = "pending"
    RUNNING = "running"
    WAITING = "waiting"
    DONE = "done"
    FAILED = "failed"
    DEAD_LETTERED = "dead_lettered"
    CANCELLED = "cancelled"


TERMINAL_STATUSES = frozenset(
    {LeaseStatus.DONE, LeaseStatus.FAILED, LeaseStatus.DEAD_LETTERED, LeaseStatus.CANCELLED}
)
#: Statuses a new run of the same execution may reopen (a new turn, or a resume).
REOPENABLE_STATUSES = frozenset({LeaseStatus.DONE, LeaseStatus.FAILED, LeaseStatus.CANCELLED})
#: Statuses an operator resolves (``langgraph-fence resolve``): retry or abandon.
RESOLVABLE_STATUSES = frozenset({LeaseStatus.DEAD_LETTERED, LeaseStatus.CANCELLED})
#: Statuses ``release`` accepts.
RELEASE_STATUSES = frozenset(
    {LeaseStatus.PENDING, LeaseStatus.WAITING, LeaseStatus.DONE, LeaseStatus.FAILED}
)


# A run names its key's scope key in every log line and event: encoded once per key, not
# on each use (both parts are checked text: hashable, and encodable without an error).
_scope_key_of = functools.lru_cache(maxsize=4096)(scope_key)


@dataclass(frozen=True, slots=True)
class LeaseKey:
    """The key of one execution's lease: ``(tenant_id, execution_id)``."""

    tenant_id: str
    execution_id: str

    def __post_init__(self) -> None:
        text_id("tenant_id", self.tenant_id, what="the tenant the execution belongs to")
        text_id("execution_id", self.execution_id, what="the execution's id")

    @property
    def scope_key(self) -> str:
        """The key's scope key: ``tenant:execution`` with each part URI-component encoded."""
        return _scope_key_of(self.tenant_id, self.execution_id)


@dataclass(frozen=True, slots=True)
class PendingEffect:
    """One entry of a lease's stamp set, left before a write step (or tool call) runs.

    Attributes:
        effect: the write's :class:`Effect`.
        node: the node (``"<node>:<tool>"`` for a tool call) that stamped it.
        task_id: LangGraph's id of the task the write runs in.
        token: the epoch it was stamped under.
        checkpoint_id: the root checkpoint whose superstep the task belongs to (LangGraph's
            ``checkpoint_map[""]``); a later root checkpoint proves the step's writes were
            recorded. Empty when unknown: such an entry is cleared only by its task's writes.
        call: tells apart several stamps of one task (tool calls); empty for a node's own.
    """

    effect: Effect
    node: str
    task_id: str
    token: int
    checkpoint_id: str = ""
    call: str = ""

    @property
    def key(self) -> str:
        """The entry's key in the stamp set: the task id, with the call after a ``/``."""
        return f"{self.task_id}/{self.call}" if self.call else self.task_id


@dataclass(frozen=True, slots=True)
class Lease:
    """One lease as a store last saw it.

    Attributes:
        key: the execution's key.
        holder: the instance id holding it, or ``None``.
        epoch: the fencing token. A row recorded but never taken holds the token before
            the first: 0, or after a failover of PostgreSQL the new timeline's floor.
        expires_at: when the hold ends, in the store's clock (seconds), or ``None``.
        pending_effects: the stamp set: every write stamped before it ran and not yet
            cleared, one entry per task (or tool call), ordered by key.
        status: where the execution stands.
        reason: why it ended (``failed``/``dead_lettered``), else ``None``.
        store_id: identifies the store that returned it; another store refuses it.
        takeovers: the takeover budget spent: how many times ``take_over`` took it from an
            expired holder since the last take that found progress (that take counts 1).
            Reset by a ``done`` or ``waiting`` release and by :func:`decide_retry`.
        progress_mark: the thread's progress as the last take saw it (the id of its latest
            checkpoint, ``None`` for none): a take that finds another one found progress.
    """

    key: LeaseKey
    holder: str | None
    epoch: int
    expires_at: float | None
    pending_effects: tuple[PendingEffect, ...]
    status: LeaseStatus
    reason: str | None = None
    store_id: str = ""
    takeovers: int = 0
    progress_mark: str | None = None

    @property
    def scope_key(self) -> str:
        """The scope key of the lease's execution."""
        return self.key.scope_key

    @property
    def pending_effect(self) -> PendingEffect | None:
        """The strongest standing entry (a non-idempotent one first), or ``None``.

        A summary for display; what a takeover decides reads the whole set.
        """
        if not self.pending_effects:
            return None
        return max(self.pending_effects, key=lambda e: _RANK[e.effect])


#: How strong an entry is, for :attr:`Lease.pending_effect`.
_RANK = {Effect.READ_ONLY: 0, Effect.IDEMPOTENT_WRITE: 1, Effect.NON_IDEMPOTENT_WRITE: 2}


def with_effects(lease: Lease, effects: Iterable[PendingEffect]) -> Lease:
    """``lease`` with ``effects`` as its stamp set (one entry per key, ordered by key)."""
    by_key = {effect.key: effect for effect in effects}
    return replace(lease, pending_effects=tuple(by_key[k] for k in sorted(by_key)))


def non_idempotent_standing(lease: Lease) -> tuple[PendingEffect, ...]:
    """The entries of ``lease``'s stamp set whose write may have happened (guarantee 3)."""
    return tuple(e for e in lease.pending_effects if e.effect is Effect.NON_IDEMPOTENT_WRITE)


def validate_ttl(ttl: float, *, name: str = "ttl") -> float:
    """Return ``ttl`` as a float, or raise ``ValueError`` naming ``name`` if not > 0."""
    return positive_seconds(name, ttl)


def check_text(value: object, name: str, what: str) -> str:
    """``value`` if it is a non-empty str every store can hold, else ``ValueError``."""
    return text_id(name, value, what=what)


def validate_holder(holder: str) -> str:
    """Return ``holder``, or raise ``ValueError`` unless it is a storable non-empty str."""
    return check_text(holder, "holder", "an instance id")


_UNSTORABLE = re.compile("[\x00\ud800-\udfff]")


@overload
def clean_reason(reason: str, *, required: Literal[True]) -> str: ...
@overload
def clean_reason(reason: str | None, *, required: bool = False) -> str | None: ...
def clean_reason(reason: str | None, *, required: bool = False) -> str | None:
    """``reason`` as every store keeps it: NUL and lone surrogates become U+FFFD.

    A reason often quotes an exception's message, and ending an execution must not fail
    because of what that message holds; so the text is cleaned, not refused.

    Raises:
        ValueError: ``reason`` is not a ``str`` (or ``None`` when not ``required``), or is
            empty when ``required``.
    """
    if reason is None and not required:
        return None
    if not isinstance(reason, str) or (required and not reason):
        wanted = "a non-empty str" if required else "a str or None"
        raise ValueError(f"reason must be {wanted} saying why the execution ended, got {reason!r}")
    return _UNSTORABLE.sub("\ufffd", reason)


def validate_pending_effect(effect: PendingEffect) -> PendingEffect:
    """``effect`` as every store keeps it (``effect.effect`` an :class:`Effect`).

    Raises:
        ValueError: a field no store can keep (unknown effect, empty or unstorable node or
            task id, a token that is not an int >= 0).
    """
    if not isinstance(effect, PendingEffect):
        raise ValueError(f"effect must be a PendingEffect, got {type(effect).__name__}")
    try:
        kind = Effect(effect.effect)
    except ValueError:
        raise ValueError(
            f"effect.effect must be one of {', '.join(e.value for e in Effect)}, "
            f"got {effect.effect!r}"
        ) from None
    check_text(effect.node, "effect.node", "the node's name")
    check_text(effect.task_id, "effect.task_id", "the task's id")
    for name in ("checkpoint_id", "call"):
        value = getattr(effect, name)
        if not isinstance(value, str):
            raise ValueError(f"effect.{name} must be a str, got {value!r}")
        if value:
            check_text(value, f"effect.{name}", "an id")
    token = effect.token
    if isinstance(token, bool) or not isinstance(token, int) or not 0 <= token < 2**63:
        raise ValueError(f"effect.token must be the lease's epoch (an int >= 0), got {token!r}")
    return effect if effect.effect is kind else replace(effect, effect=kind)


@runtime_checkable
class ExecutionLeaseRepository(Protocol):
    """The lease contract every store implements (memory, SQLite, PostgreSQL).

    Guarantees:

    * The token is the lease's ``epoch``, counted **per key**: 1 for the first holder, + 1
      with every take. Never a database revision or a global sequence, so a high-water mark
      keyed by scope key sees every take of that key and nothing else.
    * Each operation is one atomic statement: two instances racing on one key never both
      take it, and a renew racing a take either lands before it or is refused after it.
    * Expiry is judged by the store's clock (PostgreSQL ``now()``; an injectable clock for
      SQLite and memory), never by the worker's.
    * Holder operations (``renew``, ``release``, ``mark_pending_effect``,
      ``clear_pending_effects``) are guarded by key + holder + epoch + ``running`` and raise
      :class:`~langgraph_fence.ExecutionFencedError` carrying the epoch seen when refused;
      a refused operation changes nothing.
    * A lease from another store is refused with ``ValueError``.

    Any object on which ``getattr`` finds every member below is a valid store, a wrapper that
    delegates through ``__getattr__`` included, on every supported Python
    (:func:`langgraph_fence.contracts.require_implements`; ``isinstance`` against this
    Protocol refuses such a wrapper from Python 3.12 on, so the package does not use it).
    """

    @property
    def store_id(self) -> str:
        """Identifies this store; leases carry it and other stores refuse them."""
        ...

    async def acquire(
        self, key: LeaseKey, holder: str, ttl: float, *, reopen: bool = False
    ) -> Lease | None:
        """Take the lease (absent: epoch 1; free or expired: epoch + 1), or ``None``; in one
        statement, which dead-letters instead while a non-idempotent stamp stands and
        clears the idempotent ones (:func:`decide_acquire`)."""
        ...

    async def renew(self, lease: Lease, ttl: float) -> Lease:
        """Extend the hold to store-now + ``ttl``; guarded."""
        ...

    async def renew_many(
        self, leases: Sequence[Lease], ttl: float
    ) -> list[Lease | ExecutionFencedError]:
        """Renew every lease of ``leases`` as :meth:`renew` does, in one statement.

        Returns, for each lease in order, the renewed lease or the ``ExecutionFencedError``
        its refusal raised in :meth:`renew` (the epoch seen); each lease is guarded on its
        own, so a refused one changes nothing and does not keep the others from renewing.
        ``leases`` holds each key once.
        """
        ...

    async def release(self, lease: Lease, status: LeaseStatus, reason: str | None = None) -> Lease:
        """Give the lease up with ``status`` (pending, waiting, done, failed); guarded."""
        ...

    async def get(self, key: LeaseKey) -> Lease | None:
        """The lease of ``key`` as stored now, or ``None``."""
        ...

    async def mark_pending_effect(self, lease: Lease, effect: PendingEffect, ttl: float) -> Lease:
        """Add ``effect`` to the stamp set and renew, in one guarded write."""
        ...

    async def clear_pending_effects(self, lease: Lease, keys: Iterable[str] | None = None) -> Lease:
        """Remove the entries ``keys`` (all with ``None``) from the stamp set; guarded."""
        ...

    async def dead_letter(self, key: LeaseKey, reason: str, *, epoch: int | None = None) -> Lease:
        """End the execution as ``dead_lettered``; guarded by ``epoch`` when given."""
        ...

    async def takeover_candidates(
        self, limit: int = 100, *, after_tenant: str | None = None
    ) -> Sequence[Lease]:
        """Leases any instance may take now: running and expired, or pending and free.

        In claim order (:func:`fair_order`): round-robin by tenant, each tenant's first
        candidate (the longest expired or waiting), then each one's second, and so on,
        the tenants after ``after_tenant`` (the one the caller claimed for last) first at
        each rank; so one tenant's burst of submitted runs does not hide the others'.
        """
        ...

    async def take_over(
        self,
        candidate: Lease,
        holder: str,
        ttl: float,
        *,
        progress_mark: str | None = None,
        max_takeovers: int | None = None,
    ) -> Lease | None:
        """Take a candidate over and decide its fate, in one guarded statement.

        ``None`` when the candidate moved on since it was read (renewed, or taken by another
        instance). Otherwise epoch + 1 and either ``running`` for ``holder`` (the stamp set
        cleared), or ``dead_lettered`` when any ``NON_IDEMPOTENT_WRITE`` entry stands, or
        when the take is over the takeover budget (:func:`decide_take_over`): two instances
        never both resume, or both dead-letter, one execution.
        """
        ...

    async def yield_lease(self, lease: Lease) -> Lease:
        """Give the hold up while the tree waits for remote children (:func:`decide_yield`):
        ``waiting`` with the holder kept; guarded."""
        ...

    async def retake(self, lease: Lease, ttl: float) -> Lease:
        """Take ``lease`` (yielded, woken, or still held) again at epoch + 1 for its holder
        (:func:`decide_retake`), in one statement; refused once anyone else took it."""
        ...

    async def now(self) -> float:
        """The store's clock, in seconds."""
        ...

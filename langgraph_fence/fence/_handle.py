"""The run's handle: the one mutable holder of a run's lease state.

The runtime renews through it, the node wrapper stamps through it, the checkpointer reads its
token and records refusals on it; all of them share it by identity through
``config["configurable"]["__fence"]``. A fencing error recorded on it stands for the whole run
(every step, every thread), and its confirmed window says until when the hold is proven.
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from collections.abc import Awaitable, Callable, Iterable
from dataclasses import replace
from typing import TYPE_CHECKING

from langgraph_fence.database.retry import retry_window
from langgraph_fence.effects import standing_non_idempotent
from langgraph_fence.errors import (
    ExecutionDeadLetteredError,
    ExecutionFencedError,
    ExecutionLeaseLostError,
)
from langgraph_fence.fence.proofs import WriteProofs
from langgraph_fence.fence.tree_activity import RunHost, TreeActivity
from langgraph_fence.lease import Lease, LeaseKey, PendingEffect, validate_ttl
from langgraph_fence.lease.faults import fault_point
from langgraph_fence.redact import failure_reason

if TYPE_CHECKING:
    from langgraph_fence.lease import ExecutionLeaseRepository

# Its records are the fence's: one logger for an operator to set.
logger = logging.getLogger("langgraph_fence.fence")

StopListener = Callable[[BaseException], None]


def safety_margin(ttl: float) -> float:
    """How much earlier than the store may expire a hold, a worker stops trusting it.

    A tenth of the TTL, at most two seconds: room for clock-rate drift between this process
    and the store, and for the time a renewal's answer takes to come back.
    """
    return min(ttl / 10.0, 2.0)


class RunHandle:
    """The mutable lease state of one run, shared by identity by every part of the run.

    Args:
        repository: the lease store the lease came from.
        lease: the lease as acquired (the run's token is ``lease.epoch``).
        ttl: the hold each renewal asks for, in seconds.
        clock: this process's clock (``time.monotonic`` by default); ``confirmed_until`` is
            on it.
        confirmed_from: when the renewal that produced ``lease`` was sent, on ``clock``;
            defaults to now.
    """

    def __init__(
        self,
        repository: ExecutionLeaseRepository,
        lease: Lease,
        ttl: float,
        *,
        clock: Callable[[], float] = time.monotonic,
        confirmed_from: float | None = None,
    ) -> None:
        self.repository = repository
        self.ttl = validate_ttl(ttl)
        self.clock = clock
        # The lease, its confirmed window and the recorded error change together under this
        # lock: the keeper's renewer thread applies renewals while the run's loop (and its
        # sync steps' worker threads) stamp, clear, yield and record.
        self._state = threading.Lock()
        self._lease = lease
        # The lease and repository from_own_store() last found to match (see there).
        self._own: tuple[Lease, ExecutionLeaseRepository] | None = None
        sent = clock() if confirmed_from is None else confirmed_from
        self.confirmed_until = sent + self.ttl - safety_margin(self.ttl)
        self.error: ExecutionLeaseLostError | None = None
        self.stop_reason: str | None = None
        # The entries of the stamp set this run made and has not seen cleared, by key: what
        # its own writes and checkpoints may clear, and what the refuse-to-repeat rule reads.
        self.pending_effects: dict[str, PendingEffect] = {}
        # The checkpoints this run stored, and its entries whose writes landed unproven:
        # a later checkpoint of the run clears those it proves.
        self.proofs = WriteProofs()
        # Once a write step is dead-lettered the run is dead, whatever catches the error (a
        # tool-retry wrapper, a try/except in a node): every later step and tool body of the
        # run is refused with it, and the run ends dead-lettered.
        self.dead_letter: ExecutionDeadLetteredError | None = None
        # Task id -> the attempt in which a fenced tool of that task stamped a
        # NON_IDEMPOTENT_WRITE: a retried attempt of the task runs none of its tools.
        self.tool_stamp_attempts: dict[str, int] = {}
        # The last connection error a store call of this run met (a retried write, a failed
        # renewal): the cause of the lease loss when the window runs out before the store
        # answers again, so the loss says why the hold could not be proven.
        self.store_error: BaseException | None = None
        # Awaited by the fenced checkpointer before each root checkpoint and each root
        # task's writes of the run (a submitted run's recorded stream writes their events
        # first); None: nothing.
        self.before_root_write: Callable[[], Awaitable[None]] | None = None
        self._listeners: list[StopListener] = []
        # Which steps of the tree run now, and the yield while only remote waits do.
        self.activity = TreeActivity(self)
        # What the run needs of the instance it belongs to (set by the instance): its
        # keeper, its listeners, the run queue. None for a handle made without one (tests,
        # run_node).
        self.host: RunHost | None = None
        # The loop the run's store calls belong to; sync steps running in worker threads
        # submit their guarded writes to it.
        try:
            self.loop: asyncio.AbstractEventLoop | None = asyncio.get_running_loop()
        except RuntimeError:
            self.loop = None

    # -- what the lease is now

    @property
    def lease(self) -> Lease:
        """The lease as this run last confirmed it."""
        return self._lease

    def from_own_store(self) -> bool:
        """Whether the lease is a :class:`Lease` that the handle's repository's store
        returned (the same ``store_id``)."""
        lease, repository = self._lease, self.repository
        own = self._own
        # Checked once per lease object (immutable; each renewal is a new one), not on
        # each of the run's writes.
        if own is not None and own[0] is lease and own[1] is repository:
            return True
        if not isinstance(lease, Lease) or lease.store_id != repository.store_id:
            return False
        self._own = (lease, repository)
        return True

    @property
    def key(self) -> LeaseKey:
        """The execution's lease key."""
        return self._lease.key

    @property
    def scope_key(self) -> str:
        """The execution's scope key."""
        return self._lease.key.scope_key

    @property
    def token(self) -> int:
        """The fencing token this run writes under (the lease's epoch)."""
        return self._lease.epoch

    def replace_lease(self, lease: Lease, *, sent_at: float) -> None:
        """Adopt a lease this run confirmed by a write sent at ``sent_at`` (on ``clock``)."""
        if lease.key != self._lease.key:
            raise ValueError(
                f"lease of {lease.scope_key!r} cannot replace the run's lease of {self.scope_key!r}"
            )
        with self._state:
            self._adopt(lease, sent_at)

    def renewed(self, lease: Lease, *, sent_at: float) -> bool:
        """Adopt the answer of a renewal sent at ``sent_at``, unless the run stopped or
        took another token since it was sent; whether it was adopted.

        Checked and adopted in one step: an answer about an old token never sets the run's
        token back, whatever thread it comes from.
        """
        with self._state:
            if self.error is not None or lease.epoch != self._lease.epoch:
                return False
            self._adopt(lease, sent_at)
            return True

    def _adopt(self, lease: Lease, sent_at: float) -> None:
        self._lease = lease
        self.store_error = None  # the store answered: an earlier error explains nothing now
        until = sent_at + self.ttl - safety_margin(self.ttl)
        # Two renewals may answer out of order; the later confirmation stands.
        self.confirmed_until = max(self.confirmed_until, until)

    def note_yielded(self, lease: Lease) -> None:
        """Adopt the lease as the yield left it (the same token, no hold to confirm)."""
        if lease.key != self._lease.key or lease.epoch != self._lease.epoch:
            raise ValueError(f"lease {lease!r} is not the yield of the run's lease")
        with self._state:
            self._lease = lease

    # -- stopping

    def on_stop(self, listener: StopListener) -> Callable[[], None]:
        """Call ``listener(error)`` once the run is fenced or must stop; returns an unsubscribe."""
        self._listeners.append(listener)

        def unsubscribe() -> None:
            if listener in self._listeners:
                self._listeners.remove(listener)

        return unsubscribe

    def record(self, error: ExecutionLeaseLostError) -> ExecutionLeaseLostError:
        """Record a fencing error for the run and stop it; returns the error that stands.

        The first :class:`ExecutionFencedError` recorded stands for the rest of the run (it
        replaces a plain lease loss recorded earlier). Listeners are told of each error that
        comes to stand: once in all, or twice when a fence replaces a plain lease loss; an
        error that does not replace the standing one is not announced.
        """
        stands, new = self._stand(error)
        if new:
            self._announce(error)
        return stands

    def record_from_thread(self, error: ExecutionLeaseLostError) -> None:
        """:meth:`record` from a thread other than the run's loop's (the keeper's renewer
        thread): the error stands at once, for every check in any thread; the listeners are
        told on the run's loop, as soon as it runs."""
        if not self._stand(error)[1]:
            return
        loop = self.loop
        try:
            if loop is None:
                raise RuntimeError("no loop")
            loop.call_soon_threadsafe(self._announce, error)
        except RuntimeError:  # the run's loop is gone: nothing of the run is left to stop
            logger.debug("the loop of %s is closed: stop not announced", self.scope_key)

    def _stand(self, error: ExecutionLeaseLostError) -> tuple[ExecutionLeaseLostError, bool]:
        """Make ``error`` the run's recorded error if it comes to stand: the error that
        stands, and whether it is ``error``, new."""
        if not isinstance(error, ExecutionLeaseLostError):
            raise ValueError(
                f"error must be an ExecutionLeaseLostError, got {type(error).__name__}"
            )
        with self._state:
            current = self.error
            if current is not None and (
                isinstance(current, ExecutionFencedError)
                or not isinstance(error, ExecutionFencedError)
            ):
                return current, False
            self.error = error
        logger.warning(
            "execution %s %s at token %s: %s",
            self.scope_key,
            "fenced" if isinstance(error, ExecutionFencedError) else "lost its lease",
            self.token,
            error,
            extra={"scope_key": self.scope_key, "token": self.token},
        )
        return error, True

    def _announce(self, error: ExecutionLeaseLostError) -> None:
        for listener in list(self._listeners):
            try:
                listener(error)
            except Exception:  # a listener must not keep the others from hearing
                logger.exception("stop listener of %s failed", self.scope_key)

    def request_stop(self, reason: str) -> None:
        """Ask the run to stop at the next superstep boundary (a drain, not a fence)."""
        if self.stop_reason is None:
            self.stop_reason = reason

    # -- checks

    def check(self) -> None:
        """Raise the recorded fencing error, or a lease loss once the hold can't be proven.

        Local: no I/O.
        """
        if self.error is not None:
            raise self.error
        if self.clock() >= self.confirmed_until:
            # Why, when a store call of the run met a connection error meanwhile: the same
            # words whether this check or that call's last retry ends the run first.
            why = (
                ""
                if self.store_error is None
                else ": the store could not be reached while it lasted "
                f"({failure_reason(self.store_error)})"
            )
            lost = ExecutionLeaseLostError(
                f"the lease of execution {self.scope_key!r} at token {self.token} can no "
                f"longer be proven held: its last confirmed renewal has run out{why}. Another "
                "worker may take it over; this run must not write again.",
                scope_key=self.scope_key,
                token_held=self.token,
                token_seen=None,
            )
            lost.__cause__ = self.store_error  # why the store did not answer, if it said
            raise self.record(lost)

    def saw_store_error(self, error: BaseException) -> None:
        """Note a connection error a store call of this run met (it may be retried): the
        cause of a lease loss the window's end records afterwards."""
        self.store_error = error

    def record_dead_letter(self, error: ExecutionDeadLetteredError) -> ExecutionDeadLetteredError:
        """Record that the run is dead-lettered; returns the first dead letter recorded."""
        if self.dead_letter is None:
            self.dead_letter = error
            logger.warning(
                "execution %s at token %s dead-lettered: %s",
                self.scope_key,
                self.token,
                error,
                extra={"scope_key": self.scope_key, "token": self.token},
            )
        return self.dead_letter

    def check_alive(self) -> None:
        """Raise the recorded fencing error, else the run's dead letter: no I/O.

        Where a step or a tool body is about to start.
        """
        if self.error is not None:
            raise self.error
        if self.dead_letter is not None:
            raise self.dead_letter

    async def renew(self) -> Lease:
        """A strict renewal: one guarded round trip; a refusal is recorded and raised.

        A run already known to be fenced does not ask again. A run that only lost track of
        its lease (renewals failed until its window ran out) still asks: the answer tells
        whether it was taken over (the recorded error becomes ``ExecutionFencedError``),
        but a run that lost its lease stays stopped either way.
        """
        if isinstance(self.error, ExecutionFencedError):
            raise self.error
        sent_at = self.clock()
        try:
            with retry_window(self):  # a connection error is retried while the hold lasts
                lease = await self.repository.renew(self._lease, self.ttl)
        except ExecutionFencedError as exc:
            raise self.record(exc) from None
        if self.error is not None:
            raise self.error
        self.replace_lease(lease, sent_at=sent_at)
        return lease

    async def mark_pending_effect(self, effect: PendingEffect) -> Lease:
        """Add ``effect`` to the stamp set and renew, in one guarded write; a refusal is
        recorded and raised."""
        self.check()
        sent_at = self.clock()
        try:
            with retry_window(self):
                lease = await self.repository.mark_pending_effect(self._lease, effect, self.ttl)
        except ExecutionFencedError as exc:
            raise self.record(exc) from None
        self.pending_effects[effect.key] = effect
        self.replace_lease(lease, sent_at=sent_at)
        await fault_point("stamp.after", handle=self, effect=effect)
        return lease

    def standing_non_idempotent(self, task_id: str) -> PendingEffect | None:
        """The non-idempotent entry of ``task_id`` that this run stamped and has not seen
        cleared, if one stands: a step or tool call of that task must not run again (the
        refuse-to-repeat rule, :func:`~langgraph_fence.effects.standing_non_idempotent`)."""
        return standing_non_idempotent(self.pending_effects.values(), task_id)

    def forget_pending_effects(self, keys: Iterable[str]) -> dict[str, PendingEffect]:
        """Take note that the store cleared (or is clearing) the entries ``keys``; returns
        the entries this run still had of them, so a clear that failed can hand them back
        with :meth:`restore_pending_effects`. A clear is no renewal: the hold stays as it was.
        """
        gone = {k: e for k in keys if (e := self.pending_effects.pop(k, None)) is not None}
        with self._state:
            lease = self._lease
            remaining = tuple(e for e in lease.pending_effects if e.key not in gone)
            if remaining != lease.pending_effects:
                self._lease = replace(lease, pending_effects=remaining)
        return gone

    def restore_pending_effects(self, entries: dict[str, PendingEffect]) -> None:
        """Hand back entries :meth:`forget_pending_effects` took whose clear did not land."""
        self.pending_effects.update(entries)

    async def clear_pending_effects(self, keys: Iterable[str]) -> None:
        """Clear the entries ``keys`` of the stamp set in a statement of their own, guarded
        by the run's lease (a refusal is recorded and raised)."""
        # Taken off the handle first: a step's writes and the next checkpoint may both ask
        # to clear one entry at once, and one of them is enough.
        taken = self.forget_pending_effects(keys)
        if not taken:
            return
        try:
            with retry_window(self):
                await self.repository.clear_pending_effects(self._lease, list(taken))
        except ExecutionFencedError as exc:
            self.restore_pending_effects(taken)
            raise self.record(exc) from None
        except BaseException:
            self.restore_pending_effects(taken)
            raise

    def fenced(self, observed_token: int, *, source: str) -> ExecutionFencedError:
        """Record that ``source`` has seen ``observed_token`` (newer than ours) and stop."""
        error = ExecutionFencedError(
            f"{source} has seen token {observed_token} for execution {self.scope_key!r}, "
            f"newer than this run's token {self.token}: another worker took the execution "
            "over. Stop; this run must not write again.",
            scope_key=self.scope_key,
            token_held=self.token,
            token_seen=observed_token,
        )
        recorded = self.record(error)
        return recorded if isinstance(recorded, ExecutionFencedError) else error

"""The fence a step runs under: a live view of its run's lease.

:class:`RunHandle` is the one mutable holder of a run's lease state. The runtime renews
through it, the node wrapper stamps through it, the checkpointer reads its token and records
refusals on it; all of them share it by identity through
``config["configurable"]["__fence"]``. :class:`ExecutionFence` is the read-only face a step
sees: it reads the handle live, so a step sees a renewal or a takeover as soon as the handle
knows of it, and a fence used outside its own step (kept past it, or an ancestor's inside a
child step) refuses.
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Generator, Iterable, Iterator
from contextlib import (
    AbstractAsyncContextManager,
    AbstractContextManager,
    asynccontextmanager,
    contextmanager,
)
from contextvars import ContextVar, Token
from dataclasses import replace
from typing import TYPE_CHECKING, Any

from langgraph.errors import GraphDrained

from langgraph_fence.database.retry import retry_window
from langgraph_fence.errors import (
    ExecutionContextUnavailableError,
    ExecutionDeadLetteredError,
    ExecutionFencedError,
    ExecutionLeaseLostError,
)
from langgraph_fence.fence.proofs import WriteProofs
from langgraph_fence.fence.tree_activity import RunHost, TreeActivity
from langgraph_fence.from_thread import caller_discards_result, run_on_loop, running_loop
from langgraph_fence.lease import Lease, LeaseKey, PendingEffect, validate_ttl
from langgraph_fence.lease.faults import fault_point

if TYPE_CHECKING:
    from langgraph_fence.lease import ExecutionLeaseRepository

__all__ = ["ExecutionFence", "RunHandle", "safety_margin"]

logger = logging.getLogger(__name__)


StopListener = Callable[[BaseException], None]

#: The fence of the step running in this context, set with its frame
#: (:func:`langgraph_fence.steps.context.set_frame`): every fence refuses inside any step but its
#: own.
_running_fence: ContextVar[ExecutionFence | None] = ContextVar(
    "langgraph_fence_running_fence", default=None
)


def enter_step(fence: ExecutionFence | None) -> Token[ExecutionFence | None]:
    """Make ``fence`` the running step's fence in this context until :func:`leave_step`."""
    return _running_fence.set(fence)


def leave_step(token: Token[ExecutionFence | None]) -> None:
    """Undo the :func:`enter_step` that returned ``token``."""
    _running_fence.reset(token)


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
            lost = ExecutionLeaseLostError(
                f"the lease of execution {self.scope_key!r} at token {self.token} can no "
                "longer be proven held: its last confirmed renewal has run out. Another "
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


async def _confirm(handle: RunHandle) -> None:
    # Counted among the tree's running parts while it renews: a yield of a wait for remote
    # children of this step (another task of it) cannot land between the renewal and its
    # answer; a lease yielded already is taken again first (epoch + 1).
    async with handle.activity.held():
        # The round trip comes first: after a lapse it tells a takeover from a slow store.
        await handle.renew()
    if handle.stop_reason is not None:
        raise GraphDrained(handle.stop_reason)


async def _confirm_across(handle: RunHandle) -> None:
    """Confirm from a coroutine on a loop other than the run's (``asyncio.run`` in a sync
    node): the store's connections belong to the run's loop."""
    assert handle.loop is not None
    future = asyncio.run_coroutine_threadsafe(_confirm(handle), handle.loop)
    await asyncio.wrap_future(future)


class _Confirmed:
    """What a sync ``confirm_now()`` returns: already done, so awaiting it does nothing."""

    __slots__ = ()

    def __await__(self) -> Generator[Any, None, None]:
        return
        yield


_CONFIRMED = _Confirmed()


class ExecutionFence:
    """The lease the current step runs under, read live.

    Guarantees: :meth:`assert_held` raises once the run is known to be fenced or its hold
    can no longer be proven (no I/O); :meth:`confirm_now` proves it with one strict renewal
    round trip. A fence covers its own step only: kept past it, or used inside another step
    (an ancestor's fence inside a child step), it refuses with
    :class:`~langgraph_fence.ExecutionContextUnavailableError` before anything is written.
    While a wait of the step for remote children has yielded the tree's lease,
    :meth:`assert_held` refuses the same way (the lease is given up, not lost) and
    :meth:`confirm_now` takes it again first.

    The token is the lease's epoch for ``(tenant_id, lease_execution_id)``: a plain int, 1
    for the first holder, + 1 with every take. An external system that remembers the highest
    token it saw per :attr:`scope_key` can refuse stale writers (see
    :mod:`langgraph_fence.sinks`).
    """

    __slots__ = ("_active", "_handle", "_label")

    def __init__(self, handle: RunHandle, *, label: str = "step") -> None:
        self._handle = handle
        self._active = True
        self._label = label

    def _close(self) -> None:
        """End the fence with its step (called by the node wrapper)."""
        self._active = False

    def _require_active(self) -> RunHandle:
        if not self._active:
            raise ExecutionContextUnavailableError(
                f"the fence of {self._label} of execution {self._handle.scope_key!r} was used "
                "after its step ended; read get_execution_context().fence inside the step"
            )
        running = _running_fence.get()
        if running is not None and running is not self:
            # An ancestor's fence inside a child step (a PARENT_INSTANCE child or a subgraph
            # shares the root's lease but not its frame; an ANY_INSTANCE child has a lease of
            # its own), or a sibling's: the step running here writes under its own fence.
            raise ExecutionContextUnavailableError(
                f"the fence of {self._label} of execution {self._handle.scope_key!r} was used "
                f"inside another step, {running._label} of execution {running.scope_key!r}: "
                "a fence covers its own step only; use the fence of the step running here "
                "(get_execution_context().fence)"
            )
        return self._handle

    @asynccontextmanager
    async def _held(self) -> AsyncIterator[RunHandle]:
        """For a write made under this fence (a side effect, a spawn): refused outside the
        fence's own step; the block runs with the tree's lease held (re-taken first if a
        wait for remote children yielded it), see
        :meth:`~langgraph_fence.fence.tree_activity.TreeActivity.held`."""
        handle = self._require_active()
        async with handle.activity.held():
            yield handle

    @contextmanager
    def _held_as_is(self, what: str) -> Iterator[RunHandle]:
        """For a write that cannot take a yielded lease again first: refused outside the
        fence's own step and while the lease is yielded; otherwise the block runs counted
        among the tree's running parts, so no yield lands before it ends (no I/O).

        The sink's block is one: it runs inside the caller's transaction, opened already;
        on SQLite a re-take from inside it would wait for the caller's own write lock.
        """
        handle = self._require_active()
        activity = handle.activity
        if not activity.enter_held():
            if handle.error is not None:  # a fencing error first, always
                raise handle.error
            raise self._yielded(handle, what)
        try:
            yield handle
        finally:
            activity.leave()

    def _yielded(self, handle: RunHandle, what: str) -> ExecutionContextUnavailableError:
        return ExecutionContextUnavailableError(
            f"{what} under the fence of {self._label} of execution {handle.scope_key!r} was "
            "refused: no lease covers it now, a wait for remote children (wait_children) "
            f"yielded it at token {handle.token} while nothing else of the tree runs. Make "
            "the call inside `async with get_execution_context().side_effect():`, which takes "
            "the lease again first and holds it for the block, or after wait_children() returns"
        )

    @property
    def scope_key(self) -> str:
        """The scope key of the lease: ``tenant:execution``, each part URI-component encoded."""
        return self._handle.scope_key

    @property
    def tenant_id(self) -> str:
        """The tenant of the lease."""
        return self._handle.key.tenant_id

    @property
    def lease_execution_id(self) -> str:
        """The execution id of the lease (the root's for ParentInstance children)."""
        return self._handle.key.execution_id

    @property
    def token(self) -> int:
        """The fencing token: the lease's epoch as this run holds it now."""
        return self._handle.token

    @property
    def confirmed_until(self) -> float:
        """Until when the hold is proven, on the instance's clock (``time.monotonic``)."""
        return self._handle.confirmed_until

    def assert_held(self) -> None:
        """Raise unless the lease is still held as far as this process knows (no I/O).

        Raises:
            ExecutionFencedError: the lease was taken over.
            ExecutionLeaseLostError: the hold can no longer be proven.
            ExecutionContextUnavailableError: the step of this fence has ended, the call is
                made inside another step (an ancestor's fence inside a child), or the
                tree's lease is yielded now, given up while this step waits for remote
                children (:meth:`confirm_now`, a fenced tool, a store write and
                ``side_effect()`` take it again first).
        """
        handle = self._require_active()
        if handle.error is None and handle.activity.yielded:
            # Given up on purpose, not lost: no hold covers the caller, and none runs out
            # (the keeper watches no yielded lease), so no loss is ever recorded for it.
            raise self._yielded(handle, "assert_held()")
        handle.check()

    def confirm_now(self) -> Awaitable[None]:
        """Prove the lease is held with one strict renewal, before a call that can't check tokens.

        One name for both kinds of step, each getting what it can use:

        * in async code, ``await fence.confirm_now()``: the renewal runs when awaited (on
          the run's loop; from a coroutine on another loop, it is sent to the run's loop);
        * in sync code (a sync node or sync tool, which LangGraph runs in a worker thread),
          ``fence.confirm_now()``: the renewal runs on the run's loop and the call returns
          once it is confirmed, or raises. What it returns is already done (awaiting it is
          harmless), so no coroutine is ever left un-awaited.

        Either way the call after it starts only once the store confirmed the hold. While a
        wait of this step for remote children has yielded the tree's lease, the lease is
        taken again first (a new token).

        Raises:
            ExecutionFencedError: the lease was taken over (the renewal was refused).
            ExecutionLeaseLostError: the hold could not be proven (for a run that already
                lost track of its lease, the round trip still tells a takeover apart).
            ExecutionContextUnavailableError: the step of this fence has ended; or a sync
                call on the run's own event loop thread (waiting there would deadlock: use
                ``await fence.confirm_now()``), or with no running loop to renew on; or a
                call whose result is thrown away (``fence.confirm_now()`` as a statement,
                no ``await``) on a thread that runs an event loop: raised at once, never a
                coroutine nothing awaits.
            GraphDrained: the run is being drained (its instance is stopping): the step ends
                without its writes and runs again wherever the execution is resumed, so no
                side effect starts during a shutdown.
        """
        handle = self._require_active()
        running = running_loop()
        if running is None:
            run_on_loop(
                handle.loop,
                lambda: _confirm(handle),
                what=f"fence.confirm_now() of {self._label}",
                on_loop="use `await fence.confirm_now()` in async code",
            )
            return _CONFIRMED
        if caller_discards_result():
            # Called as a blocking call on a thread that runs an event loop: what it would
            # return is a coroutine nothing awaits, and nothing would be renewed.
            raise ExecutionContextUnavailableError(
                f"fence.confirm_now() of {self._label} was called without `await` on a "
                "thread that runs an event loop: it would renew nothing, and the call after "
                "it would start unproven; use `await fence.confirm_now()`"
            )
        if handle.loop is None or running is handle.loop:
            return _confirm(handle)
        return _confirm_across(handle)

    def fenced(self, observed_token: int) -> ExecutionFencedError:
        """The error to raise when an external system has seen ``observed_token`` > ours.

        Marks the run so the whole tree stops; raise the returned error from the step.

        Raises:
            ValueError: ``observed_token`` is not an int greater than :attr:`token`.
        """
        handle = self._require_active()
        if (
            isinstance(observed_token, bool)
            or not isinstance(observed_token, int)
            or observed_token <= handle.token
        ):
            raise ValueError(
                f"observed_token must be an int greater than this fence's token "
                f"{handle.token}, got {observed_token!r}: a token at or below ours is not stale"
            )
        return handle.fenced(observed_token, source="an external system")

    def __repr__(self) -> str:
        state = "active" if self._active else "ended"
        return f"<ExecutionFence {self.scope_key} token={self.token} {state}>"


def close_fence(fence: ExecutionFence) -> None:
    """End ``fence`` with its step (the node wrapper calls this)."""
    fence._close()


def held(fence: ExecutionFence) -> AbstractAsyncContextManager[RunHandle]:
    """For a write made under ``fence`` (a side effect, a spawn): refused outside the
    fence's own step; the block runs with the tree's lease held (re-taken first if a wait
    for remote children yielded it)."""
    return fence._held()


def held_as_is(fence: ExecutionFence, what: str) -> AbstractContextManager[RunHandle]:
    """For a write that cannot take a yielded lease again first (the sink's block):
    refused outside the fence's own step and while the lease is yielded."""
    return fence._held_as_is(what)


def running_handle() -> RunHandle | None:
    """The run handle of the fenced step running in this context, or ``None`` outside any
    (a store write finds the step that makes it this way)."""
    fence = _running_fence.get()
    return None if fence is None else fence._handle

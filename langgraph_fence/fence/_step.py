"""A step's fence: the read-only view of its run's lease that a step holds.

It reads the run's handle live, so a step sees a renewal or a takeover as soon as the handle
knows of it; a fence used outside its own step (kept past it, or an ancestor's inside a child
step) refuses.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Awaitable, Generator, Iterator
from contextlib import (
    AbstractAsyncContextManager,
    AbstractContextManager,
    asynccontextmanager,
    contextmanager,
)
from contextvars import ContextVar, Token
from typing import Any

from langgraph.errors import GraphDrained

from langgraph_fence.errors import ExecutionContextUnavailableError, ExecutionFencedError
from langgraph_fence.fence._handle import RunHandle
from langgraph_fence.from_thread import (
    await_on_loop,
    caller_discards_result,
    run_on_loop,
    running_loop,
)

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
    await await_on_loop(handle.loop, lambda: _confirm(handle))


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

"""RunHandle and ExecutionFence over a memory store, on controlled clocks."""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import Any

import pytest

from langgraph_fence import (
    Effect,
    ExecutionContextUnavailableError,
    ExecutionFence,
    ExecutionFencedError,
    ExecutionLeaseLostError,
    Lease,
    LeaseKey,
    MemoryLeaseRepository,
    PendingEffect,
)
from langgraph_fence.database.retry import retry_connection_errors, retry_window
from langgraph_fence.fence import RunHandle, safety_margin
from langgraph_fence.from_thread import run_on_loop
from langgraph_fence.steps.context import ExecutionContext, reset_frame, set_frame
from langgraph_fence.testing import ManualClock
from tests.support.databases import unique
from tests.support.polling import eventually

TTL = 10.0
MARGIN = safety_margin(TTL)


class InFlight:
    """A store whose calls take ``delay`` seconds of the local clock, and are counted."""

    def __init__(self, inner: MemoryLeaseRepository, clock: ManualClock, delay: float) -> None:
        self.inner = inner
        self.clock = clock
        self.delay = delay
        self.calls: list[str] = []

    def __getattr__(self, name: str) -> Any:
        target = getattr(self.inner, name)
        if not callable(target):
            return target

        async def call(*args: Any, **kwargs: Any) -> Any:
            self.calls.append(name)
            self.clock.advance(self.delay)  # the answer comes back `delay` later
            return await target(*args, **kwargs)

        return call


class Run:
    """A held lease with a handle and a fence; the store and the worker keep separate clocks
    so a takeover can be seen before the worker's own window runs out."""

    def __init__(self, delay: float = 0.0) -> None:
        self.store_clock = ManualClock()
        self.local = ManualClock(start=500.0)
        self.store = MemoryLeaseRepository(clock=self.store_clock)
        self.wire = InFlight(self.store, self.local, delay)
        self.key = LeaseKey(unique("t"), unique("e"))
        self.heard: list[BaseException] = []

    async def start(self) -> tuple[RunHandle, ExecutionFence]:
        lease = await self.store.acquire(self.key, "A", TTL)
        assert lease is not None
        handle = RunHandle(self.wire, lease, TTL, clock=self.local)  # type: ignore[arg-type]
        handle.on_stop(self.heard.append)
        return handle, ExecutionFence(handle, label="node 'charge'")

    async def take_over(self) -> Lease:
        self.store_clock.advance(TTL)
        newer = await self.store.acquire(self.key, "B", TTL)
        assert newer is not None
        return newer


async def test_fence_reads_the_handle() -> None:
    run = Run()
    handle, fence = await run.start()
    assert fence.scope_key == run.key.scope_key
    assert (fence.tenant_id, fence.lease_execution_id) == (run.key.tenant_id, run.key.execution_id)
    assert fence.token == handle.token == 1
    assert fence.confirmed_until == run.local() + TTL - MARGIN
    assert "token=1" in repr(fence)


def test_safety_margin() -> None:
    assert safety_margin(10.0) == 1.0
    assert safety_margin(300.0) == 2.0
    assert 0 < safety_margin(0.01) < 0.01


async def test_confirmed_until_counts_from_when_the_renewal_was_sent() -> None:
    run = Run(delay=3.0)
    handle, fence = await run.start()
    run.local.advance(4.0)
    sent = run.local()
    await handle.renew()
    assert run.local() == sent + 3.0  # the clock moved while the renewal was in flight
    assert fence.confirmed_until == sent + TTL - MARGIN
    assert run.wire.calls == ["renew"]


async def test_confirmed_until_never_goes_back() -> None:
    run = Run()
    handle, fence = await run.start()
    latest = fence.confirmed_until
    # An older renewal answering late does not shorten the window.
    handle.replace_lease(handle.lease, sent_at=run.local() - 5.0)
    assert fence.confirmed_until == latest
    other = await run.store.acquire(LeaseKey(unique("t"), unique("e")), "A", TTL)
    assert other is not None
    with pytest.raises(ValueError, match="cannot replace"):
        handle.replace_lease(other, sent_at=run.local())


async def test_assert_held_until_confirmed_until_then_lease_lost() -> None:
    run = Run()
    handle, fence = await run.start()
    fence.assert_held()
    run.local.advance(fence.confirmed_until - run.local() - 0.001)
    fence.assert_held()
    assert run.wire.calls == []  # no I/O
    run.local.advance(0.001)
    with pytest.raises(ExecutionLeaseLostError) as caught:
        fence.assert_held()
    error = caught.value
    assert type(error) is ExecutionLeaseLostError
    assert (error.scope_key, error.token_held) == (run.key.scope_key, 1)
    assert handle.error is error
    assert run.heard == [error]
    with pytest.raises(ExecutionLeaseLostError) as again:
        fence.assert_held()
    assert again.value is error
    assert run.heard == [error]


async def test_a_lapse_after_a_store_error_names_the_error_as_its_cause() -> None:
    """A guarded write that met a dead connection, and no renewal got through after it: the
    lease loss the window's end records says why (the operator sees the connection error)."""
    run = Run()
    handle, fence = await run.start()
    run.local.advance(fence.confirmed_until - run.local() - 1e-6)  # no room for a retry
    gone = ConnectionResetError("injected: connection lost")

    async def write() -> None:
        raise gone

    with retry_window(handle), pytest.raises(ConnectionResetError):
        await retry_connection_errors(write, what="a guarded write")
    run.local.advance(0.001)
    with pytest.raises(ExecutionLeaseLostError) as caught:
        fence.assert_held()
    assert caught.value.__cause__ is gone
    # The same words as the write's own loss, had its last retry ended the run first.
    assert "the store could not be reached while it lasted" in str(caught.value)
    assert "connection lost" in str(caught.value)


async def test_a_store_that_answered_since_is_no_cause_of_a_later_lapse() -> None:
    run = Run()
    handle, fence = await run.start()
    handle.saw_store_error(ConnectionResetError("earlier"))
    await fence.confirm_now()  # the store answered again
    run.local.advance(fence.confirmed_until - run.local())
    with pytest.raises(ExecutionLeaseLostError) as caught:
        fence.assert_held()
    assert caught.value.__cause__ is None
    assert "store could not be reached" not in str(caught.value)


async def test_assert_held_after_an_observed_takeover_is_fenced() -> None:
    run = Run()
    handle, fence = await run.start()
    await run.take_over()
    fence.assert_held()  # nothing observed yet, and the local window still holds
    with pytest.raises(ExecutionFencedError) as caught:
        await handle.renew()
    error = caught.value
    assert (error.token_held, error.token_seen) == (1, 2)
    with pytest.raises(ExecutionFencedError) as again:
        fence.assert_held()
    assert again.value is error
    assert run.heard == [error]


async def test_confirm_now_is_one_renewal() -> None:
    run = Run(delay=0.5)
    handle, fence = await run.start()
    run.store_clock.advance(6.0)
    run.local.advance(6.0)
    sent = run.local()
    await fence.confirm_now()
    assert run.wire.calls == ["renew"]
    stored = await run.store.get(run.key)
    assert stored is not None
    assert stored.expires_at == run.store_clock() + TTL
    assert handle.lease == stored
    assert fence.confirmed_until == sent + TTL - MARGIN


async def test_confirm_now_after_takeover_raises_and_stands() -> None:
    run = Run()
    handle, fence = await run.start()
    newer = await run.take_over()
    with pytest.raises(ExecutionFencedError) as caught:
        await fence.confirm_now()
    assert caught.value.token_seen == newer.epoch
    assert handle.error is caught.value
    with pytest.raises(ExecutionFencedError):
        await fence.confirm_now()
    assert run.wire.calls == ["renew"]  # the second one did not even ask
    assert await run.store.get(run.key) == newer


async def test_confirm_now_when_asked_to_stop_is_a_drain() -> None:
    from langgraph.errors import GraphDrained

    run = Run()
    handle, fence = await run.start()
    handle.request_stop("instance draining")
    with pytest.raises(GraphDrained, match="draining"):
        await fence.confirm_now()
    assert run.wire.calls == ["renew"]


async def test_mark_pending_effect_after_takeover_stamps_nothing() -> None:
    run = Run()
    handle, _fence = await run.start()
    newer = await run.take_over()
    effect = PendingEffect(Effect.NON_IDEMPOTENT_WRITE, "charge", "task-1", 1)
    with pytest.raises(ExecutionFencedError):
        await handle.mark_pending_effect(effect)
    assert handle.pending_effects == {}
    assert await run.store.get(run.key) == newer


async def test_fenced_returns_records_and_tells_listeners_once() -> None:
    run = Run()
    handle, fence = await run.start()
    error = fence.fenced(5)
    assert isinstance(error, ExecutionFencedError)
    assert (error.scope_key, error.token_held, error.token_seen) == (run.key.scope_key, 1, 5)
    assert handle.error is error
    assert run.heard == [error]
    second = fence.fenced(6)
    assert second is error  # the first fencing error stands
    assert run.heard == [error]
    with pytest.raises(ExecutionFencedError) as caught:
        fence.assert_held()
    assert caught.value is error


async def test_fenced_upgrades_a_plain_loss() -> None:
    run = Run()
    handle, fence = await run.start()
    run.local.advance(TTL)
    with pytest.raises(ExecutionLeaseLostError):
        fence.assert_held()
    lost = handle.error
    error = fence.fenced(2)
    assert handle.error is error
    assert type(error) is ExecutionFencedError
    # Listeners hear the loss, then the fence that replaced it; later errors are not news.
    assert run.heard == [lost, error]
    fence.fenced(3)
    assert run.heard == [lost, error]


@pytest.mark.parametrize("observed", [1, 0, -3, True, 1.5, "2", None])
async def test_fenced_refuses_a_token_that_is_not_newer(observed: object) -> None:
    run = Run()
    handle, fence = await run.start()
    with pytest.raises(ValueError, match="observed_token"):
        fence.fenced(observed)  # type: ignore[arg-type]
    assert handle.error is None
    assert run.heard == []
    fence.assert_held()


@pytest.mark.parametrize(
    "use",
    [
        lambda fence: fence.assert_held(),
        lambda fence: fence.fenced(9),
    ],
    ids=["assert_held", "fenced"],
)
async def test_a_fence_past_its_step_refuses(use: Callable[[ExecutionFence], object]) -> None:
    run = Run()
    handle, fence = await run.start()
    fence._close()
    with pytest.raises(ExecutionContextUnavailableError) as caught:
        use(fence)
    assert run.key.scope_key in str(caught.value)
    assert "node 'charge'" in str(caught.value)
    assert handle.error is None
    assert run.heard == []
    # Reading its values stays harmless.
    assert fence.token == 1
    assert "ended" in repr(fence)


async def test_confirm_now_past_its_step_refuses_without_io() -> None:
    run = Run()
    _handle, fence = await run.start()
    fence._close()
    with pytest.raises(ExecutionContextUnavailableError):
        await fence.confirm_now()
    assert run.wire.calls == []


async def test_a_fence_refuses_inside_another_steps_frame_and_works_where_none_runs() -> None:
    run = Run()
    handle, fence = await run.start()
    other = ExecutionContext(
        ExecutionFence(handle, label="node 'other'"),
        "other",
        "task-2",
        1,
        "other:1",
        "thread",
        Effect.READ_ONLY,
        handle,
    )
    reset = set_frame(other)  # a child step of the fence's step runs here
    try:
        for use in (fence.assert_held, lambda: fence.fenced(9), fence.confirm_now):
            with pytest.raises(ExecutionContextUnavailableError) as caught:
                use()
            said = str(caught.value)
            assert "node 'charge'" in said
            assert "inside another step, node 'other'" in said
        other.fence.assert_held()  # that step's own fence
    finally:
        reset_frame(reset)
    # Where no frame runs (a plain thread of the fence's own step), it works as before.
    fence.assert_held()
    assert run.wire.calls == []  # refused before any I/O
    assert handle.error is None
    assert run.heard == []


async def test_a_failing_listener_does_not_silence_the_others() -> None:
    run = Run()
    handle, fence = await run.start()

    def broken(_error: BaseException) -> None:
        raise RuntimeError("listener bug")

    handle.on_stop(broken)
    later: list[BaseException] = []
    unsubscribe = handle.on_stop(later.append)
    gone: list[BaseException] = []
    handle.on_stop(gone.append)()  # unsubscribed at once
    error = fence.fenced(3)
    assert run.heard == [error]
    assert later == [error]
    assert gone == []
    unsubscribe()


# -- confirm_now() from sync code (issue 22): the renewal happens, or the call raises at once


async def test_confirm_now_from_a_worker_thread_renews_before_it_returns() -> None:
    run = Run()
    _handle, fence = await run.start()
    run.store_clock.advance(6.0)
    done = await asyncio.to_thread(fence.confirm_now)  # a sync node's call, in its thread
    assert run.wire.calls == ["renew"]  # renewed before the call returned
    stored = await run.store.get(run.key)
    assert stored is not None
    assert stored.expires_at == run.store_clock() + TTL
    await done  # what it returns is already done: awaiting it asks nothing more
    assert run.wire.calls == ["renew"]


async def test_confirm_now_from_a_worker_thread_after_takeover_raises_there() -> None:
    run = Run()
    handle, fence = await run.start()
    newer = await run.take_over()
    with pytest.raises(ExecutionFencedError) as caught:
        await asyncio.to_thread(fence.confirm_now)
    assert caught.value.token_seen == newer.epoch
    assert handle.error is caught.value


async def test_confirm_now_from_a_coroutine_on_another_loop_renews_on_the_runs_loop() -> None:
    run = Run()
    _handle, fence = await run.start()

    def sync_node_running_its_own_loop() -> None:
        async def body() -> None:
            await fence.confirm_now()

        asyncio.run(body())

    await asyncio.to_thread(sync_node_running_its_own_loop)
    assert run.wire.calls == ["renew"]


def test_confirm_now_in_sync_code_without_the_runs_loop_raises_at_once() -> None:
    async def start() -> ExecutionFence:
        return (await Run().start())[1]

    fence = asyncio.run(start())  # the run's loop is gone: nothing could renew
    with pytest.raises(ExecutionContextUnavailableError, match="loop is not running"):
        fence.confirm_now()


async def test_a_blocking_hop_on_the_loops_own_thread_refuses_instead_of_deadlocking() -> None:
    made: list[bool] = []

    async def never() -> None:
        made.append(True)

    with pytest.raises(ExecutionContextUnavailableError, match="would deadlock: the fix"):
        run_on_loop(asyncio.get_running_loop(), never, what="x", on_loop="the fix")
    assert made == []  # no coroutine was made, so none is left un-awaited


async def test_a_renewal_answered_after_the_run_took_a_new_token_is_not_adopted() -> None:
    """The renewer thread applies answers while the run's loop goes on: an answer about the
    token the run held when it was sent never sets the run's token back, and one for a run
    already stopped moves no window on."""
    run = Run()
    handle, _ = await run.start()
    old = handle.lease
    renewed = await run.store.renew(old, TTL)
    run.store_clock.advance(TTL)
    retaken = await run.store.acquire(run.key, "A", TTL)  # the run's next token (a re-take)
    assert retaken is not None
    handle.replace_lease(retaken, sent_at=run.local())
    assert not handle.renewed(renewed, sent_at=run.local() + 1)
    assert handle.token == retaken.epoch
    current = await run.store.renew(retaken, TTL)
    assert handle.renewed(current, sent_at=run.local() + 1)
    assert handle.confirmed_until == run.local() + 1 + TTL - MARGIN
    handle.fenced(retaken.epoch + 1, source="a test")
    before = handle.confirmed_until
    assert not handle.renewed(current, sent_at=run.local() + 2)
    assert handle.confirmed_until == before


async def test_a_refusal_recorded_from_another_thread_stands_at_once_and_is_told_on_the_loop() -> (
    None
):
    """A refusal the renewer thread hears stands at once for every check in any thread;
    the run's stop listeners (its drain, its events) hear of it on the run's loop."""
    run = Run()
    handle, fence = await run.start()
    loop = asyncio.get_running_loop()
    heard_on: list[asyncio.AbstractEventLoop | None] = []
    handle.on_stop(lambda _e: heard_on.append(asyncio.get_running_loop()))
    newer = await run.take_over()
    refusal = ExecutionFencedError(
        "taken over", scope_key=run.key.scope_key, token_held=1, token_seen=newer.epoch
    )

    def in_thread() -> bool:
        handle.record_from_thread(refusal)
        try:
            fence.assert_held()
        except ExecutionFencedError as exc:
            return exc is refusal
        return False

    assert await asyncio.to_thread(in_thread)
    await eventually(lambda: run.heard == [refusal], timeout=10, what="the announcement")
    assert heard_on == [loop]


async def test_confirm_now_without_await_on_the_loops_thread_raises_at_once() -> None:
    """Issue 32, item 9: a call whose result nothing awaits renewed nothing and raised
    nothing; it raises at once now, and nothing is left un-awaited."""
    run = Run()
    _handle, fence = await run.start()
    with pytest.raises(ExecutionContextUnavailableError, match="without `await`"):
        fence.confirm_now()

    def sync_code_on_the_loop() -> None:
        fence.confirm_now()

    with pytest.raises(ExecutionContextUnavailableError, match="without `await`"):
        sync_code_on_the_loop()
    assert run.wire.calls == []
    pending = fence.confirm_now()  # kept, to be awaited later: allowed
    await pending
    await asyncio.wait_for(fence.confirm_now(), 5)  # handed to what awaits it: allowed
    assert run.wire.calls == ["renew", "renew"]

"""The test house's one poll-with-deadline helper: it returns what it waited for, fails at
the deadline naming it, and lets a probe's own failure through at once."""

from __future__ import annotations

import time

import pytest

from tests.support.polling import eventually, eventually_sync


async def test_eventually_returns_the_first_answer_that_is_not_none_or_false() -> None:
    answers = iter([None, False, 0])
    assert await eventually(lambda: next(answers), interval=0) == 0

    async def lease() -> str | None:
        return "lease"

    assert await eventually(lease) == "lease"


async def test_eventually_fails_at_the_deadline_naming_what_it_waited_for() -> None:
    started = time.monotonic()
    with pytest.raises(AssertionError, match="timed out waiting for the lease to expire"):
        await eventually(lambda: None, timeout=0.05, what="the lease to expire")
    assert time.monotonic() - started < 5.0

    async def said() -> str:
        return "what was left: 3 open"

    with pytest.raises(AssertionError, match="what was left: 3 open"):
        await eventually(lambda: False, deadline=time.monotonic(), what=said)


async def test_a_probe_that_raises_ends_the_wait_at_once() -> None:
    def probe() -> None:
        raise AssertionError("worker A exited early")

    with pytest.raises(AssertionError, match="worker A exited early"):
        await eventually(probe, timeout=60.0)


def test_eventually_sync_waits_the_same_way_without_a_loop() -> None:
    answers = iter([None, None, "ready"])
    assert eventually_sync(lambda: next(answers), interval=0) == "ready"
    with pytest.raises(AssertionError, match="timed out waiting for serves"):
        eventually_sync(lambda: False, timeout=0.01, what=lambda: "serves")
    with pytest.raises(TypeError, match="not both"):
        eventually_sync(lambda: True, timeout=1.0, deadline=1.0)

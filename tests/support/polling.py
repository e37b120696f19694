"""Polling with a deadline: the one way a test waits for something it cannot be told about.

A test that can be told (an event set by the code under test, the ``leases`` fixture's
controlled clock) waits on that. What is left (another process's output, a row another
connection writes, a lease expiring on the database's clock) is polled here, never slept
for: :func:`eventually` on the event loop, :func:`eventually_sync` in a thread or a plain
function. Both fail loudly at the deadline, naming what they waited for.

Free of pytest: the doomed processes of the chaos tests import it too.
"""

from __future__ import annotations

import asyncio
import inspect
import time
from collections.abc import Awaitable, Callable
from typing import TypeVar

T = TypeVar("T")

#: How long a wait may take unless told otherwise: generous, for a busy 2-core machine.
DEFAULT_TIMEOUT = 10.0
DEFAULT_INTERVAL = 0.02


def _until(timeout: float | None, deadline: float | None) -> float:
    """The monotonic deadline: ``deadline`` itself, or ``timeout`` seconds from now."""
    if timeout is not None and deadline is not None:
        raise TypeError("eventually takes timeout= or deadline=, not both")
    if deadline is not None:
        return deadline
    return time.monotonic() + (DEFAULT_TIMEOUT if timeout is None else timeout)


#: What a wait is for, said when it fails: a text, or a function that tells it then (it may
#: look at the state the wait gave up on).
What = str | Callable[[], str | Awaitable[str]]


def _found(value: object) -> bool:
    # None and False mean "not yet"; anything else (a lease, a dict, True, 0) is the answer.
    return value is not None and value is not False


async def eventually(
    predicate: Callable[[], Awaitable[T | None] | T | None],
    *,
    # A deadline checked between probes, not asyncio.timeout: a probe is never cancelled
    # half-way through a statement or a read.
    timeout: float | None = None,  # noqa: ASYNC109
    deadline: float | None = None,
    interval: float = DEFAULT_INTERVAL,
    what: What = "the condition",
) -> T:
    """Call ``predicate`` (sync or async) until it returns something, and return that.

    "Something" is any value but ``None`` and ``False``. The wait ends at ``deadline``
    (``time.monotonic()``, for one deadline shared by the steps of a test) or ``timeout``
    seconds from now (10 s unless given); then it raises ``AssertionError`` naming
    ``what`` (a text, or a function called then, sync or async, that says what was left).
    An exception the predicate raises (a probe failing because the process it
    watches exited) ends the wait at once with that exception.
    """
    until = _until(timeout, deadline)
    while True:
        value = predicate()
        if inspect.isawaitable(value):
            value = await value
        if _found(value):
            return value  # type: ignore[return-value]
        if time.monotonic() > until:
            said = what() if callable(what) else what
            if inspect.isawaitable(said):
                said = await said
            raise AssertionError(f"timed out waiting for {said} (last answer: {value!r})")
        await asyncio.sleep(interval)


def eventually_sync(
    predicate: Callable[[], T | None],
    *,
    timeout: float | None = None,
    deadline: float | None = None,
    interval: float = DEFAULT_INTERVAL,
    what: str | Callable[[], str] = "the condition",
) -> T:
    """:func:`eventually` for a thread with no event loop (a sync step, a plain test)."""
    until = _until(timeout, deadline)
    while True:
        value = predicate()
        if _found(value):
            return value  # type: ignore[return-value]
        if time.monotonic() > until:
            said = what() if callable(what) else what
            raise AssertionError(f"timed out waiting for {said} (last answer: {value!r})")
        time.sleep(interval)

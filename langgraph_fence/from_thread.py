"""Run a coroutine on a run's event loop from a worker thread, and wait for its answer.

LangGraph runs sync nodes and sync tools in worker threads, while a run's lease store (and
so every guarded write: a stamp, a strict renewal) belongs to the event loop the run was
started on. :func:`run_on_loop` is the one hop from such a thread to that loop.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Coroutine
from typing import Any, TypeVar

from .errors import ExecutionContextUnavailableError

__all__ = ["run_on_loop", "running_loop"]

T = TypeVar("T")


def running_loop() -> asyncio.AbstractEventLoop | None:
    """The event loop running in this thread, or ``None`` (a worker thread, plain sync code)."""
    try:
        return asyncio.get_running_loop()
    except RuntimeError:
        return None


def run_on_loop(
    loop: asyncio.AbstractEventLoop | None,
    make: Callable[[], Coroutine[Any, Any, T]],
    *,
    what: str,
    on_loop: str,
) -> T:
    """Run ``make()`` on ``loop`` and block this thread until it returns (or raises).

    The coroutine is made only once the hop is possible, so a refusal leaves no coroutine
    behind that nothing awaits. Its exception is raised here as the same object.

    Args:
        loop: the run's loop (``RunHandle.loop``).
        make: makes the coroutine to run.
        what: what is being called, for the errors ("node 'charge' stamping its write").
        on_loop: the fix to name when called on the loop's own thread.

    Raises:
        ExecutionContextUnavailableError: ``loop`` is missing or not running (no run to
            serve the call), or this thread is ``loop``'s own: waiting here for work the
            loop itself must run would deadlock.
    """
    if loop is None or not loop.is_running():
        raise ExecutionContextUnavailableError(
            f"{what} needs the event loop its run was started on, and that loop is not "
            "running: run the graph with Instance.ainvoke()/astream() (or graph.invoke() on "
            "a graph compiled with an instance's checkpointer)"
        )
    if running_loop() is loop:
        raise ExecutionContextUnavailableError(
            f"{what} was called as a blocking call on the event loop's own thread, where "
            f"waiting for the loop would deadlock: {on_loop}"
        )
    return asyncio.run_coroutine_threadsafe(make(), loop).result()

"""Run a coroutine on a run's event loop from a worker thread, and wait for its answer.

LangGraph runs sync nodes and sync tools in worker threads, while a run's lease store (and
so every guarded write: a stamp, a strict renewal) belongs to the event loop the run was
started on. :func:`run_on_loop` is the one hop from such a thread to that loop.
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Awaitable, Callable, Coroutine, Iterator
from contextlib import contextmanager
from typing import Any, TypeVar

from .errors import ExecutionContextUnavailableError

__all__ = ["LoopThread", "loop_thread", "run_on_loop", "running_loop"]

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


class LoopThread:
    """An event loop running in a thread of its own, for a sync program's instance."""

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self.loop = loop

    def call(self, make: Callable[[], Awaitable[T]]) -> T:
        """Run ``make()`` on the loop and block this thread until it returns (or raises)."""

        async def run() -> T:
            return await make()

        return run_on_loop(
            self.loop, run, what="a call to the instance's loop", on_loop="await it instead"
        )


@contextmanager
def loop_thread(name: str) -> Iterator[LoopThread]:
    """Start an event loop in a daemon thread; stop it and join the thread on exit."""
    loop = asyncio.new_event_loop()
    ready = threading.Event()

    def serve() -> None:
        asyncio.set_event_loop(loop)
        loop.call_soon(ready.set)
        loop.run_forever()

    thread = threading.Thread(target=serve, name=name, daemon=True)
    thread.start()
    ready.wait()
    try:
        yield LoopThread(loop)
    finally:
        loop.call_soon_threadsafe(loop.stop)
        thread.join()
        loop.close()

"""Every crossing to a run's event loop from elsewhere: a worker thread waiting for a
coroutine's answer (:func:`hop`, checked by :func:`run_on_loop`) or for a stream's items
(:func:`iterate_on_loop`), and a coroutine of another loop awaiting one
(:func:`await_on_loop`).

LangGraph runs sync nodes and sync tools in worker threads, while a run's lease store (and
so every guarded write: a stamp, a strict renewal) belongs to the event loop the run was
started on.
"""

from __future__ import annotations

import asyncio
import dis
import functools
import queue
import sys
import threading
from collections.abc import AsyncIterator, Awaitable, Callable, Coroutine, Iterator
from contextlib import contextmanager
from typing import Any, TypeVar

from langgraph_fence.errors import ExecutionContextUnavailableError

__all__ = [
    "LoopThread",
    "await_on_loop",
    "caller_discards_result",
    "hop",
    "iterate_on_loop",
    "loop_thread",
    "run_on_loop",
    "running_loop",
]

T = TypeVar("T")


def running_loop() -> asyncio.AbstractEventLoop | None:
    """The event loop running in this thread, or ``None`` (a worker thread, plain sync code)."""
    try:
        return asyncio.get_running_loop()
    except RuntimeError:
        return None


def caller_discards_result(depth: int = 2) -> bool:
    """Whether the call being made ``depth`` frames up (2: the caller of the function that
    asks) throws its result away: an expression statement, ``fence.confirm_now()`` with no
    ``await`` and no name to await it by later. Read from the caller's bytecode (the
    instruction after its call is ``POP_TOP``); ``False`` wherever that cannot be read (an
    interpreter without frames or ``dis`` offsets), so a call is never refused by mistake.
    """
    try:
        frame = sys._getframe(depth)
    except (AttributeError, ValueError):
        return False
    return _pops_result(frame.f_code, frame.f_lasti)


@functools.lru_cache(maxsize=256)
def _pops_result(code: Any, offset: int) -> bool:
    # The first real instruction after the call: Python 3.11 leaves f_lasti on one of the
    # call's inline CACHE entries, later versions on the call itself.
    # (3.13 lists no CACHE entries, and deprecates asking for them.)
    caches = {"show_caches": True} if sys.version_info < (3, 13) else {}
    for instruction in dis.get_instructions(code, **caches):
        if instruction.offset > offset and instruction.opname != "CACHE":
            return instruction.opname == "POP_TOP"
    return False


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
    return hop(loop, make)


def hop(loop: asyncio.AbstractEventLoop, make: Callable[[], Coroutine[Any, Any, T]]) -> T:
    """The one hop from a thread to ``loop``: run ``make()`` there and block this thread
    until it returns; its exception is raised here as the same object.

    The caller has checked that ``loop`` runs and is not this thread's own (waiting for it
    here would deadlock): :func:`run_on_loop` does, and names the fix when it is not so.
    """
    return asyncio.run_coroutine_threadsafe(make(), loop).result()


async def await_on_loop(
    loop: asyncio.AbstractEventLoop, make: Callable[[], Coroutine[Any, Any, T]]
) -> T:
    """Await ``make()`` run on ``loop`` from a coroutine of another loop (``asyncio.run``
    inside a sync step): what belongs to ``loop`` (a store's connections) stays on it."""
    return await asyncio.wrap_future(asyncio.run_coroutine_threadsafe(make(), loop))


_DONE = object()


def iterate_on_loop(
    loop: asyncio.AbstractEventLoop, make: Callable[[], AsyncIterator[Any]]
) -> Iterator[Any]:
    """The items of ``make()``, run as ONE task on ``loop``, handed to this thread as they
    come (the sync ``graph.stream`` / ``invoke`` of a graph compiled with an instance's
    checkpointer).

    One task for the whole stream (not one per chunk): the run's timers, context variables
    and cancel scopes live in it. Closing the iterator early cancels the run (as breaking
    out of ``graph.stream`` does), and waits for it to settle its lease.
    """
    chunks: queue.SimpleQueue[tuple[bool, Any]] = queue.SimpleQueue()
    lock = threading.Lock()
    settled = threading.Event()
    started: list[asyncio.Task[Any] | None] = []

    async def pump() -> None:
        with lock:
            if started:  # closed before it began: nothing ran
                settled.set()
                return
            started.append(asyncio.current_task())
        try:
            async for chunk in make():
                chunks.put((True, chunk))
        except BaseException as exc:
            chunks.put((False, exc))
            if not isinstance(exc, Exception):
                raise
        else:
            chunks.put((False, _DONE))
        finally:
            settled.set()

    asyncio.run_coroutine_threadsafe(pump(), loop)
    try:
        while True:
            ok, item = chunks.get()
            if ok:
                yield item
            elif item is _DONE:
                return
            else:
                raise item
    finally:
        with lock:
            task = started[0] if started else None
            if not started:
                started.append(None)
        if task is not None and not settled.is_set():
            loop.call_soon_threadsafe(task.cancel)
        # The run settles its lease on the loop before this thread goes on.
        while not settled.wait(0.1) and loop.is_running():
            pass


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

"""A ``SqlCheckpointer``'s life: the event loop it was set up on (its engine's connections
belong to that loop), whether it is closed and why, and its sync calls hopping to that loop.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Coroutine
from dataclasses import dataclass
from typing import Any, TypeVar

from langgraph_fence.from_thread import hop, running_loop

__all__ = ["Lifecycle"]

T = TypeVar("T")


@dataclass(slots=True)
class Lifecycle:
    """A saver's set-up loop and why it is closed: one holder shared by its copies."""

    loop: asyncio.AbstractEventLoop | None = None
    closed_reason: str | None = None

    def engine_disposed(self) -> None:
        # SQLAlchemy would quietly open new connections on a disposed engine; a saver whose
        # engine its owner disposed is a saver someone meant to close.
        if self.closed_reason is None:
            self.closed_reason = (
                "its engine was disposed (engine.dispose()): create a new engine and a new "
                "SqlCheckpointer on it"
            )

    def check_open(self) -> None:
        """Refuse a call on a closed saver."""
        if self.closed_reason is not None:
            raise RuntimeError(f"this SqlCheckpointer is closed: {self.closed_reason}")

    def ready(self) -> None:
        """Refuse an async call before ``setup()``, or on another loop than its own."""
        self.check_open()
        if self.loop is None:
            raise RuntimeError(
                "this SqlCheckpointer is not set up: await saver.setup() once (it creates or "
                "upgrades the tables) before using it, on the event loop that will use it"
            )
        if asyncio.get_running_loop() is not self.loop:
            raise RuntimeError(
                "this SqlCheckpointer was set up on another event loop, and its engine's "
                "connections belong to that loop: create the engine and the saver on the "
                "loop that runs the graph"
            )

    def run_sync(self, make: Callable[[], Coroutine[Any, Any, T]]) -> T:
        """Run ``make()`` on the saver's loop from a worker thread and wait for its answer."""
        self.check_open()
        loop = self.loop
        if loop is None:
            raise RuntimeError(
                "this SqlCheckpointer is not set up: await saver.setup() on the event loop "
                "that will serve it before calling its sync methods"
            )
        if running_loop() is loop:
            raise asyncio.InvalidStateError(
                "Synchronous calls to SqlCheckpointer are only allowed from a thread other "
                "than its event loop's (LangGraph's invoke/stream make them from worker "
                "threads). On the loop, use the async methods: await saver.aget_tuple(...), "
                "await graph.ainvoke(...)"
            )
        return hop(loop, make)

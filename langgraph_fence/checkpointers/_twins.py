"""Sync twins of a saver's async methods: each method written once, with two faces.

LangGraph's ``invoke``/``stream`` call a checkpointer's sync methods (``put``,
``get_tuple``...) from worker threads. A saver whose work is async answers them by running
the async method on the event loop that serves it and waiting for its answer:
:func:`sync_twin` makes that sync method from the async one, with the same parameters.
"""

from __future__ import annotations

import functools
import inspect
from collections.abc import AsyncIterator, Callable, Coroutine, Iterator
from typing import Any, Concatenate, ParamSpec, Protocol, TypeVar

__all__ = ["RunsOnLoop", "sync_iter_twin", "sync_twin"]

P = ParamSpec("P")
R = TypeVar("R")
T = TypeVar("T")


class RunsOnLoop(Protocol):
    """A saver that runs a coroutine on the loop serving it, from a worker thread."""

    def run_sync(self, make: Callable[[], Coroutine[Any, Any, T]]) -> T:
        """Run ``make()`` on the saver's loop and wait for its answer; refused on the loop's
        own thread (waiting there would deadlock)."""
        ...


S = TypeVar("S", bound=RunsOnLoop)


def _named(twin: Callable[..., Any], method: Callable[..., Any]) -> None:
    # Named as LangGraph calls it (``aput`` -> ``put``); ``__wrapped__`` (set by wraps)
    # keeps the async method's signature for inspect.signature, which LangGraph reads.
    name = method.__name__.removeprefix("a")
    twin.__name__ = name
    twin.__qualname__ = method.__qualname__.rsplit(".", 1)[0] + f".{name}"
    twin.__doc__ = f"Sync twin of :meth:`{method.__name__}`."


def sync_twin(
    method: Callable[Concatenate[S, P], Coroutine[Any, Any, R]],
) -> Callable[Concatenate[S, P], R]:
    """The sync twin of the async saver method ``method``: it runs the saver's own
    ``method`` (looked up on the saver, so a subclass's override runs) through
    ``run_sync``."""
    name = method.__name__

    @functools.wraps(method)
    def twin(self: S, /, *args: P.args, **kwargs: P.kwargs) -> R:
        run: R = self.run_sync(lambda: getattr(self, name)(*args, **kwargs))
        return run

    _named(twin, method)
    return twin


def sync_iter_twin(
    method: Callable[Concatenate[S, P], AsyncIterator[R]],
) -> Callable[Concatenate[S, P], Iterator[R]]:
    """:func:`sync_twin` for an async iterator method (``alist`` -> ``list``): the items
    are collected on the loop, then iterated here."""
    name = method.__name__

    async def collect(self: S, *args: Any, **kwargs: Any) -> list[R]:
        return [item async for item in getattr(self, name)(*args, **kwargs)]

    @functools.wraps(method)
    def twin(self: S, /, *args: P.args, **kwargs: P.kwargs) -> Iterator[R]:
        return iter(self.run_sync(lambda: collect(self, *args, **kwargs)))

    _named(twin, method)
    # The async method's parameters, and its items as an Iterator.
    signature = inspect.signature(method)
    returns = signature.return_annotation
    if isinstance(returns, str):  # the annotation as written: "AsyncIterator[...]"
        returns = returns.removeprefix("Async")
    twin.__signature__ = signature.replace(return_annotation=returns)  # type: ignore[attr-defined]
    return twin

"""What the real-process tests share: polling with a deadline (and ``own_schema``, from the
top-level conftest)."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable
from typing import TypeVar

import pytest

T = TypeVar("T")


async def poll(probe: Callable[[], Awaitable[T | None]], deadline: float, what: str) -> T:
    """Call ``probe`` until it returns something, or fail at ``deadline`` (monotonic)."""
    while True:
        found = await probe()
        if found is not None:
            return found
        if time.monotonic() > deadline:
            pytest.fail(f"timed out waiting for {what}")
        await asyncio.sleep(0.02)

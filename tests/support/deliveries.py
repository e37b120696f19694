"""What the completion callbacks' tests share: one look's deliveries to their end, and a
database of the test's own."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest

from langgraph_fence.testing import Leases

__all__ = ["db", "deliver"]


async def deliver(loop: Any) -> None:
    """One look of ``loop`` (a ``stepped`` serve loop) and the deliveries it began, to their
    end."""
    await loop.poll_once()
    await asyncio.wait_for(loop.deliveries.settle(), 20)


@pytest.fixture
def db(own_leases: Leases) -> Leases:
    """A database of the test's own: every serving loop delivers every due webhook of its
    database, and a shared schema would hold other tests' (their receivers gone)."""
    return own_leases

"""What the real-process tests share: a PostgreSQL schema per test, and polling with a deadline."""

from __future__ import annotations

import asyncio
import time
import uuid
from collections.abc import Awaitable, Callable, Iterator
from typing import TypeVar

import pytest

from tests.conftest import _pg_admin

T = TypeVar("T")


@pytest.fixture
def own_schema(pg_schema: tuple[str, str]) -> Iterator[tuple[str, str]]:
    """``(url, schema)``: a schema of this test's own, dropped after it.

    serve() looks at every execution in its schema: other tests' leftovers in the session's
    schema must not change what these workers see.
    """
    url, _ = pg_schema
    schema = f"lgf_chaos_{uuid.uuid4().hex[:12]}"
    _pg_admin(url, f'CREATE SCHEMA "{schema}"')
    try:
        yield url, schema
    finally:
        _pg_admin(url, f'DROP SCHEMA IF EXISTS "{schema}" CASCADE')


async def poll(probe: Callable[[], Awaitable[T | None]], deadline: float, what: str) -> T:
    """Call ``probe`` until it returns something, or fail at ``deadline`` (monotonic)."""
    while True:
        found = await probe()
        if found is not None:
            return found
        if time.monotonic() > deadline:
            pytest.fail(f"timed out waiting for {what}")
        await asyncio.sleep(0.02)

"""Issue 32, item 5: an item's TTL is judged by the database's clock, as a lease's expiry is.

A host whose clock is an hour fast must still see live items and must not sweep them; a
host an hour slow must not write items that everyone else sees as expired. The host's
clock is mocked; the database's is real. SQLite and PostgreSQL.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager

import pytest
from sqlalchemy.ext.asyncio import AsyncEngine

from checkpointers import SqlStore
from tests.support.databases import SQL_BACKENDS, unique

RUNS_ON = SQL_BACKENDS

HOUR = 3600.0


async def set_up(make_engine: Callable[[str], AsyncEngine], backend: str) -> AsyncEngine:
    """A database whose item table is set up (its clock is the real one)."""
    engine = make_engine(backend)
    await SqlStore(engine).setup()
    return engine


@contextmanager
def host_clock(skew: float) -> Iterator[None]:
    """This host's wall clock ``skew`` seconds off, wherever the code reads it: ``time.time``,
    and a ``clock`` default that captured it at import."""
    real = time.time

    def skewed() -> float:
        return real() + skew

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(time, "time", skewed)
        defaults = SqlStore.__init__.__kwdefaults__ or {}
        if defaults.get("clock") is real:
            patch.setitem(defaults, "clock", skewed)
        yield


async def test_a_fast_host_sees_live_items_and_sweeps_none(
    backend: str, make_engine: Callable[[str], AsyncEngine]
) -> None:
    engine = await set_up(make_engine, backend)
    ns = (unique("root"), "memories")
    await SqlStore(engine).aput(ns, "live", {"v": 1}, ttl=10.0)  # ten minutes, on a true clock
    with host_clock(+HOUR):
        fast = SqlStore(engine)
        item = await fast.aget(ns, "live", refresh_ttl=False)
        assert item is not None  # not expired: the database says ten minutes are left
        await fast.sweep_ttl()
    assert await SqlStore(engine).aget(ns, "live", refresh_ttl=False) is not None  # not swept


async def test_a_slow_host_writes_items_others_see(
    backend: str, make_engine: Callable[[str], AsyncEngine]
) -> None:
    engine = await set_up(make_engine, backend)
    ns = (unique("root"), "memories")
    with host_clock(-HOUR):
        await SqlStore(engine).aput(ns, "written", {"v": 1}, ttl=10.0)
    true = SqlStore(engine)
    item = await true.aget(ns, "written", refresh_ttl=False)
    assert item is not None  # live for ten minutes by the database's clock
    assert abs(item.updated_at.timestamp() - time.time()) < 60  # stamped by the database
    await true.sweep_ttl()
    assert await true.aget(ns, "written", refresh_ttl=False) is not None  # not swept

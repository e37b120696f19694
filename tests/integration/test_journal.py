"""The journal is a record written off the run's path: a database that cannot take it
delays it (kept, then written), bounds what it keeps, and never fails the caller; an
instance opened with ``Instance.open`` journals its runs."""

from __future__ import annotations

import time
from pathlib import Path
from typing import TypedDict

import pytest
from sqlalchemy import func, select

from langgraph_fence import EventKind, FenceEvent, Instance, LeaseKey
from langgraph_fence.database import create_engine
from langgraph_fence.lease import journal as journal_module
from langgraph_fence.lease.journal import JOURNAL, Journal, read_journal
from langgraph_fence.lease.sql import SqlLeaseRepository
from tests.support.graphs import one_step


class Count(TypedDict):
    count: int


def add(state: Count) -> Count:
    return {"count": state["count"] + 1}


def event(kind: EventKind, n: int = 1) -> FenceEvent:
    return FenceEvent(kind, LeaseKey("acme", f"e{n}").scope_key, n, "A", "why", time.time())


async def count(engine: object) -> int:
    async with engine.connect() as conn:  # type: ignore[attr-defined]
        return int((await conn.execute(select(func.count()).select_from(JOURNAL))).scalar_one())


async def test_entries_kept_while_the_table_cannot_be_written_are_written_later(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    engine = create_engine(f"sqlite+aiosqlite:///{tmp_path / 'j.db'}")
    try:
        monkeypatch.setattr(journal_module, "PENDING_LIMIT", 5)
        journal = Journal(engine)
        for n in range(8):  # no table yet: every write fails; the caller never sees it
            journal(event(EventKind.ACQUIRED, n))
        journal(event(EventKind.RENEWED_LATE))  # not journaled: one per late renewal
        assert journal.dropped == 3  # the oldest went past the limit
        await SqlLeaseRepository(engine).setup()
        await journal.flush()
        async with engine.connect() as conn:
            kept = [await read_journal(conn, "acme", f"e{n}") for n in range(8)]
        assert [len(entries) for entries in kept] == [0, 0, 0, 1, 1, 1, 1, 1]
        assert kept[3][0].kind == "acquired"
        assert kept[3][0].holder == "A"
        await journal.aclose()
    finally:
        await engine.dispose()


async def test_an_instance_opened_on_a_database_journals_its_runs(tmp_path: Path) -> None:
    url = f"sqlite+aiosqlite:///{tmp_path / 'i.db'}"
    async with Instance.open(url, instance_id="w1") as instance:
        graph = one_step(instance, Count, "add", add, name="count")
        await graph.ainvoke({"count": 0}, {"configurable": {"thread_id": "t1"}})
    engine = create_engine(url)
    try:
        async with engine.connect() as conn:
            entries = await read_journal(conn, "default", "t1")
    finally:
        await engine.dispose()
    assert [(e.kind, e.epoch, e.holder) for e in entries] == [("acquired", 1, "w1")]


async def test_journal_false_writes_none(tmp_path: Path) -> None:
    url = f"sqlite+aiosqlite:///{tmp_path / 'n.db'}"
    async with Instance.open(url, journal=False) as instance:
        assert instance.journal is None
        graph = one_step(instance, Count, "add", add, name="count")
        await graph.ainvoke({"count": 0}, {"configurable": {"thread_id": "t1"}})
    engine = create_engine(url)
    try:
        assert await count(engine) == 0
    finally:
        await engine.dispose()

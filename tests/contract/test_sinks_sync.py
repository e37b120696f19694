"""The exactly-once sink on a sync connection: the same contract as ``test_sinks.py``.

``fenced_write_sync`` runs the sink's statements (one definition, in ``sinks/_write.py``) on a sync
SQLAlchemy ``Connection``: the stdlib ``sqlite3`` driver, or PostgreSQL through psycopg. The
tables and the helpers are the async suite's; writers of both faces share one mark.
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Callable

import pytest
import sqlalchemy as sa
from sqlalchemy.exc import DBAPIError
from sqlalchemy.ext.asyncio import AsyncEngine

from langgraph_fence import ExecutionContextUnavailableError, ExecutionFence, ExecutionFencedError
from langgraph_fence.fence import RunHandle
from langgraph_fence.sinks import FencedWrite, fenced_write_sync, is_serialization_failure
from tests.support.databases import SQL_BACKENDS
from tests.support.sinks import (
    Abandon,
    Outcome,
    applied_rows,
    mark_of,
    takeovers,
    user_rows,
    write_with_retry,
)

# The async suite's fixtures: both backends, the sink set up, the user table beside it.
RUNS_ON = SQL_BACKENDS


DEADLINE = 10.0


@pytest.fixture
def sync_engine(
    backend: str,
    engines: tuple[AsyncEngine, AsyncEngine],
    make_sync_engine: Callable[[str], sa.Engine],
) -> sa.Engine:
    """A sync engine on the database of ``engines`` (sink set up, user table created)."""
    return make_sync_engine(backend)


def insert_user_row(conn: sa.Connection, scope: str, idem: str, token: int, who: str) -> None:
    conn.execute(
        sa.text(
            "INSERT INTO sink_user_rows (scope_key, idem, token, writer) VALUES (:s, :i, :t, :w)"
        ),
        {"s": scope, "i": idem, "t": token, "w": who},
    )


def write_sync(db: sa.Engine, handle: RunHandle, key: str, who: str) -> Outcome:
    """How a user of a sync engine runs a fenced write: retried whole on a conflict."""
    fence = ExecutionFence(handle)
    outcome = Outcome(who, handle.token, key)
    for _attempt in range(20):
        try:
            with db.begin() as conn, fenced_write_sync(conn, fence, key) as write:
                if write.applied:
                    outcome.applied_before = True
                    outcome.result = write.result
                else:
                    insert_user_row(conn, fence.scope_key, key, fence.token, who)
                    outcome.result = {"by": who, "token": fence.token}
                    write.record(outcome.result)
            return outcome
        except ExecutionFencedError as exc:
            outcome.refused = exc
            return outcome
        except DBAPIError as exc:
            if not is_serialization_failure(exc):
                raise
            outcome.errors.append(exc)
            outcome.retries += 1
    raise AssertionError(f"{who} kept failing on conflicts: {outcome.errors}")


async def test_a_stale_sync_writer_is_refused_and_nothing_of_its_transaction_lands(
    engine: AsyncEngine, sync_engine: sa.Engine
) -> None:
    old, new = await takeovers(2)
    scope = old.scope_key
    winner = write_sync(sync_engine, new, "charge", "new")
    assert winner.refused is None
    assert not winner.applied_before
    body_ran = False
    with pytest.raises(ExecutionFencedError) as refused, sync_engine.begin() as conn:
        insert_user_row(conn, scope, "before", 1, "old")
        with fenced_write_sync(conn, ExecutionFence(old), "refund"):
            body_ran = True
    assert not body_ran, "the check comes first: the block must not run for a stale token"
    error = refused.value
    assert (error.scope_key, error.token_held, error.token_seen) == (scope, 1, 2)
    assert old.error is error, "the run handle records the refusal so the whole tree stops"
    assert await user_rows(engine, scope) == [("charge", 2, "new")]
    assert set(await applied_rows(engine, scope)) == {"charge"}
    assert await mark_of(engine, scope) == 2


async def test_both_faces_share_one_mark_and_one_key(
    engine: AsyncEngine, sync_engine: sa.Engine
) -> None:
    old, new = await takeovers(2)
    scope = old.scope_key
    first = write_sync(sync_engine, old, "charge", "sync-old")
    second = await write_with_retry(engine, new, "charge", "async-new")
    assert second.applied_before
    assert second.result == {"by": "sync-old", "token": 1}
    late = write_sync(sync_engine, old, "other", "sync-old")
    assert late.refused is not None
    assert late.refused.token_seen == 2  # the async mark refuses
    assert first.result == {"by": "sync-old", "token": 1}
    assert await user_rows(engine, scope) == [("charge", 1, "sync-old")]


async def test_an_error_in_a_sync_block_rolls_back_the_users_rows_and_the_key(
    engine: AsyncEngine, sync_engine: sa.Engine
) -> None:
    (holder,) = await takeovers(1)
    fence = ExecutionFence(holder)
    scope = fence.scope_key
    with (
        pytest.raises(Abandon),
        sync_engine.begin() as conn,
        fenced_write_sync(conn, fence, "k") as write,
    ):
        insert_user_row(conn, scope, "k", 1, "first")
        write.record("done")
        raise Abandon
    assert await user_rows(engine, scope) == []
    assert await applied_rows(engine, scope) == {}
    # Caught inside a transaction that then commits: the claim is released, a retry applies.
    with (
        sync_engine.begin() as conn,
        pytest.raises(Abandon),
        fenced_write_sync(conn, fence, "k"),
    ):
        raise Abandon
    assert await applied_rows(engine, scope) == {}
    retried = write_sync(sync_engine, holder, "k", "retry")
    assert not retried.applied_before
    assert await applied_rows(engine, scope) == {"k": (1, {"by": "retry", "token": 1})}


async def test_the_same_key_twice_in_one_sync_transaction_is_applied_once_and_record_is_checked(
    engine: AsyncEngine, sync_engine: sa.Engine
) -> None:
    (holder,) = await takeovers(1)
    fence = ExecutionFence(holder)
    kept: list[FencedWrite] = []
    with sync_engine.begin() as conn:
        with fenced_write_sync(conn, fence, "k") as write:
            assert not write.applied
            write.record({"ok": True})
            with pytest.raises(RuntimeError, match="called twice"):
                write.record({"ok": False})
            kept.append(write)
        with pytest.raises(RuntimeError, match="after the fenced_write block"):
            kept[0].record(1)
        with fenced_write_sync(conn, fence, "k") as again:
            assert again.applied
            assert again.result == {"ok": True}
            with pytest.raises(RuntimeError, match="applied already"):
                again.record(2)
    with (
        pytest.raises(RuntimeError, match=r"without write\.record"),
        sync_engine.begin() as conn,
        fenced_write_sync(conn, fence, "forgot"),
    ):
        pass
    assert set(await applied_rows(engine, fence.scope_key)) == {"k"}


async def test_racing_sync_writers_of_one_key_in_two_threads_apply_it_exactly_once(
    engine: AsyncEngine, sync_engine: sa.Engine
) -> None:
    """Two worker threads (two attempts of one sync step), released together, many rounds."""
    (holder,) = await takeovers(1)
    for round_ in range(8):
        key = f"k{round_}"
        start = threading.Barrier(2, timeout=DEADLINE)

        def run(i: int, key: str = key, start: threading.Barrier = start) -> Outcome:
            start.wait()
            return write_sync(sync_engine, holder, key, f"w{i}")

        async with asyncio.timeout(DEADLINE):
            first, second = await asyncio.gather(
                asyncio.to_thread(run, 0), asyncio.to_thread(run, 1)
            )
        assert first.refused is None
        assert second.refused is None
        assert sorted([first.applied_before, second.applied_before]) == [False, True]
        assert first.result == second.result
    rows = await user_rows(engine, holder.scope_key)
    assert sorted(r[0] for r in rows) == [f"k{i}" for i in range(8)]


async def test_bad_sync_arguments_are_refused_with_the_fix(
    engine: AsyncEngine, sync_engine: sa.Engine
) -> None:
    (holder,) = await takeovers(1)
    fence = ExecutionFence(holder)
    with sync_engine.begin() as conn:
        with (
            pytest.raises(TypeError, match="fence must be an ExecutionFence"),
            fenced_write_sync(conn, holder, "k"),  # type: ignore[arg-type]
        ):
            pass
        for bad in ("", None, 7, "a\x00b", "a\ud800b"):  # a lone surrogate too, on both
            with (
                pytest.raises(ValueError, match="idempotency_key"),
                fenced_write_sync(conn, fence, bad),  # type: ignore[arg-type]
            ):
                pass
    with (
        pytest.raises(TypeError, match="conn must be a SQLAlchemy Connection"),
        fenced_write_sync(sync_engine, fence, "k"),  # type: ignore[arg-type]
    ):
        pass
    async with engine.begin() as async_conn:
        with (
            pytest.raises(TypeError, match=r"use `async with fenced_write"),
            fenced_write_sync(async_conn, fence, "k"),  # type: ignore[arg-type]
        ):
            pass
    with (
        sync_engine.connect() as conn,
        pytest.raises(ValueError, match="conn is not in a transaction"),
        fenced_write_sync(conn, fence, "k"),
    ):
        pass
    with sync_engine.connect() as conn:
        auto = conn.execution_options(isolation_level="AUTOCOMMIT")
        with (
            auto.begin(),
            pytest.raises(ValueError, match="AUTOCOMMIT"),
            fenced_write_sync(auto, fence, "k"),
        ):
            pass
    fence._close()  # a fence kept past its step
    with (
        pytest.raises(ExecutionContextUnavailableError),
        sync_engine.begin() as conn,
        fenced_write_sync(conn, fence, "k"),
    ):
        pass
    assert await mark_of(engine, fence.scope_key) is None, "refused before any statement"

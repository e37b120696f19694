"""The exactly-once sink on real SQLite and PostgreSQL: stale tokens, racing keys, scope keys.

Every test runs against both databases (the ``backend`` fixture) unless it tests something
only PostgreSQL has (isolation levels, row locks). Writers get their fences the way a run
does: a lease taken from a lease store, a :class:`RunHandle`, an :class:`ExecutionFence`.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from sqlalchemy import text
from sqlalchemy.exc import DBAPIError
from sqlalchemy.ext.asyncio import AsyncConnection, AsyncEngine, create_async_engine

from langgraph_fence import (
    ExecutionContextUnavailableError,
    ExecutionFence,
    ExecutionFencedError,
    LeaseKey,
    LeaseStatus,
    MemoryLeaseRepository,
    sinks,
)
from langgraph_fence.database import normalize_url, transaction
from langgraph_fence.fence import RunHandle
from langgraph_fence.sinks import (
    FencedWrite,
    fenced_write,
    is_serialization_failure,
    setup_sink,
)
from langgraph_fence.testing import ManualClock
from tests.support.databases import SQL_BACKENDS, pg_engine_options, unique
from tests.support.polling import eventually
from tests.support.sinks import (
    HOLD_TTL,
    LEASE_TTL,
    USER_TABLE,
    Abandon,
    Outcome,
    applied_rows,
    insert_user_row,
    mark_of,
    takeovers,
    user_rows,
    write_once,
    write_with_retry,
)

RUNS_ON = SQL_BACKENDS
DEADLINE = 10.0  # seconds any polling loop may take before the test fails


# -- fixtures and helpers


async def backend_pid(conn: AsyncConnection) -> int:
    return int((await conn.execute(text("SELECT pg_backend_pid()"))).scalar_one())


async def wait_until_lock_waiting(engine: AsyncEngine, pid: int) -> None:
    """Poll (with a deadline) until PostgreSQL backend ``pid`` waits on a lock."""

    async def waits() -> bool:
        async with engine.connect() as conn:
            waiting = await conn.execute(
                text("SELECT wait_event_type FROM pg_stat_activity WHERE pid = :p"), {"p": pid}
            )
            return waiting.scalar_one_or_none() == "Lock"

    await eventually(waits, timeout=DEADLINE, interval=0.005, what=f"backend {pid} to wait")


async def wait_for_event(event: asyncio.Event, *tasks: asyncio.Task[Any]) -> None:
    """Wait (with a deadline) for ``event``; a task that fails first fails with its error."""
    waiter = asyncio.ensure_future(event.wait())
    done, _ = await asyncio.wait(
        [waiter, *tasks], timeout=DEADLINE, return_when=asyncio.FIRST_COMPLETED
    )
    if waiter in done:
        return
    waiter.cancel()
    for task in tasks:
        if task.done():
            task.result()
    raise AssertionError(f"the event was not set within {DEADLINE}s")


async def settle(*aws: Awaitable[Outcome]) -> list[Outcome]:
    """Gather writers, failing the test instead of hanging when one never finishes."""
    async with asyncio.timeout(DEADLINE):
        return list(await asyncio.gather(*aws))


# -- a stale writer is refused and nothing of its transaction lands


async def test_stale_token_is_refused_and_nothing_of_its_transaction_lands(
    engine: AsyncEngine,
) -> None:
    old, new = await takeovers(2)
    scope = old.scope_key
    winner = await write_with_retry(engine, new, "charge", "new")
    assert winner.refused is None
    assert not winner.applied_before
    assert await mark_of(engine, scope) == 2

    body_ran = False
    with pytest.raises(ExecutionFencedError) as refused:
        async with transaction(engine) as conn:
            # The user's own row, written in the same transaction before the sink was asked.
            await insert_user_row(conn, scope, "before", 1, "old")
            async with fenced_write(conn, ExecutionFence(old), "refund"):
                body_ran = True

    assert not body_ran, "the check comes first: the block must not run for a stale token"
    error = refused.value
    assert (error.scope_key, error.token_held, error.token_seen) == (scope, 1, 2)
    assert old.error is error, "the run handle records the refusal so the whole tree stops"
    assert await user_rows(engine, scope) == [("charge", 2, "new")]
    assert set(await applied_rows(engine, scope)) == {"charge"}
    assert await mark_of(engine, scope) == 2
    # The fenced run stays refused, without I/O, whatever key it tries next.
    with pytest.raises(ExecutionFencedError) as again:
        async with transaction(engine) as conn, fenced_write(conn, ExecutionFence(old), "x"):
            pass
    assert again.value is error


async def test_stale_token_is_refused_even_for_a_key_it_applied_itself(engine: AsyncEngine) -> None:
    old, new = await takeovers(2)
    first = await write_with_retry(engine, old, "charge", "old")
    assert first.result == {"by": "old", "token": 1}
    # The new holder re-runs the step: the key is applied, it skips with the stored result.
    second = await write_with_retry(engine, new, "charge", "new")
    assert second.applied_before
    assert second.result == {"by": "old", "token": 1}
    assert await mark_of(engine, old.scope_key) == 2
    # The old holder, woken up, is refused before it even learns the key's state.
    third = await write_with_retry(engine, old, "charge", "old")
    assert third.refused is not None
    assert third.refused.token_seen == 2
    assert await user_rows(engine, old.scope_key) == [("charge", 1, "old")]


async def test_an_error_in_the_block_rolls_back_the_users_rows_and_the_key(
    engine: AsyncEngine,
) -> None:
    (holder,) = await takeovers(1)
    fence = ExecutionFence(holder)
    scope = fence.scope_key
    with pytest.raises(Abandon):
        async with transaction(engine) as conn, fenced_write(conn, fence, "k") as write:
            await insert_user_row(conn, scope, "k", 1, "first")
            write.record("done")
            raise Abandon
    assert await user_rows(engine, scope) == []
    assert await applied_rows(engine, scope) == {}
    assert await mark_of(engine, scope) is None

    # An error caught inside the transaction, which then commits: the key is not reported
    # applied (the claim is released), so a retry applies it.
    async with transaction(engine) as conn:
        with pytest.raises(Abandon):
            async with fenced_write(conn, fence, "k"):
                raise Abandon
    assert await applied_rows(engine, scope) == {}
    retried = await write_with_retry(engine, holder, "k", "retry")
    assert not retried.applied_before
    assert await applied_rows(engine, scope) == {"k": (1, {"by": "retry", "token": 1})}


async def test_equal_token_passes_and_the_mark_follows_the_newest_token(
    engine: AsyncEngine,
) -> None:
    _, h2, h3 = await takeovers(3)
    scope = h2.scope_key
    await write_with_retry(engine, h2, "a", "h2")
    # Another step of the same run (a second fence over the same lease): equal token passes.
    again = await write_with_retry(engine, h2, "b", "h2-again")
    assert again.refused is None
    assert not again.applied_before
    assert await mark_of(engine, scope) == 2
    await write_with_retry(engine, h3, "c", "h3")
    assert await mark_of(engine, scope) == 3
    stale = await write_with_retry(engine, h2, "d", "h2-late")
    assert stale.refused is not None
    assert await mark_of(engine, scope) == 3
    assert [row[0] for row in await user_rows(engine, scope)] == ["a", "b", "c"]


async def test_the_same_key_twice_in_one_transaction_is_applied_once(engine: AsyncEngine) -> None:
    (holder,) = await takeovers(1)
    fence = ExecutionFence(holder)
    async with transaction(engine) as conn:
        first = Outcome("one", 1, "k")
        await write_once(conn, fence, "k", "one", first)
        second = Outcome("two", 1, "k")
        await write_once(conn, fence, "k", "two", second)
    assert not first.applied_before
    assert second.applied_before
    assert second.result == {"by": "one", "token": 1}
    assert len(await user_rows(engine, fence.scope_key)) == 1


# -- hypothesis: random tokens, keys and outcomes


@dataclass
class Model:
    """What the sink must show after a sequence of committed or abandoned transactions."""

    mark: int = 0
    applied: dict[str, tuple[int, Any]] = field(default_factory=dict)
    rows: list[tuple[str, int, str]] = field(default_factory=list)


_OPS = st.lists(
    st.tuples(st.integers(1, 5), st.sampled_from(["k1", "k2", "k3"]), st.booleans()),
    min_size=1,
    max_size=8,
)


@settings(
    max_examples=25,
    deadline=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture],
)
@given(ops=_OPS)
async def test_sequential_writers_match_the_model(engine: AsyncEngine, ops: list[Any]) -> None:
    """Transactions one after another, each with a random token and key, committed or not."""
    handles = await takeovers(5)
    scope = handles[0].scope_key
    model = Model()
    previous_mark = 0
    for i, (token, key, commit) in enumerate(ops):
        who = f"w{i}"
        fence = ExecutionFence(handles[token - 1])
        outcome = Outcome(who, token, key)
        try:
            async with transaction(engine) as conn:
                await write_once(conn, fence, key, who, outcome)
                if not commit:
                    raise Abandon
        except ExecutionFencedError:
            assert token < model.mark, f"{who} at token {token} refused under mark {model.mark}"
        except Abandon:
            assert token >= model.mark
        else:
            assert commit, f"{who} at {token} passed mark {model.mark}"
            assert token >= model.mark, f"{who} at {token} passed mark {model.mark}"
        if token >= model.mark:
            if key in model.applied:
                assert outcome.applied_before
                assert outcome.result == model.applied[key][1]
            else:
                assert not outcome.applied_before
            if commit:
                model.mark = token
                if key not in model.applied:
                    model.applied[key] = (token, outcome.result)
                    model.rows.append((key, token, who))
        mark = await mark_of(engine, scope) or 0
        assert mark == model.mark
        assert mark >= previous_mark, "the mark never goes down"
        previous_mark = mark
        assert await applied_rows(engine, scope) == model.applied
        assert await user_rows(engine, scope) == model.rows


@settings(
    max_examples=20,
    deadline=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture],
)
@given(
    writers=st.lists(
        st.tuples(st.integers(1, 4), st.sampled_from(["a", "b"])), min_size=2, max_size=5
    )
)
async def test_concurrent_writers_keep_the_invariants(
    engines: tuple[AsyncEngine, AsyncEngine], writers: list[tuple[int, str]]
) -> None:
    """Writers with random tokens and keys racing on connections of two engines."""
    handles = await takeovers(4)
    scope = handles[0].scope_key
    start = asyncio.Barrier(len(writers))

    async def run(i: int, token: int, key: str) -> Outcome:
        await start.wait()
        return await write_with_retry(engines[i % 2], handles[token - 1], key, f"w{i}")

    outcomes = await settle(*(run(i, t, k) for i, (t, k) in enumerate(writers)))
    committed = [o for o in outcomes if o.refused is None]
    assert committed, "the newest token present can never be refused"
    newest = max(o.token for o in committed)
    assert await mark_of(engines[0], scope) == newest
    for refused in (o for o in outcomes if o.refused is not None):
        assert any(o.token > refused.token for o in committed), f"{refused} refused for nothing"
    stored = await applied_rows(engines[0], scope)
    rows = await user_rows(engines[0], scope)
    for key in {o.key for o in committed}:
        appliers = [o for o in committed if o.key == key and not o.applied_before]
        assert len(appliers) == 1, f"key {key!r} applied by {appliers}"
        assert stored[key] == (appliers[0].token, appliers[0].result)
        assert all(o.result == appliers[0].result for o in committed if o.key == key)
        assert [r for r in rows if r[0] == key] == [(key, appliers[0].token, appliers[0].who)]
    assert set(stored) == {o.key for o in committed}
    tokens_in_commit_order = [token for _key, token, _who in rows]
    assert tokens_in_commit_order == sorted(tokens_in_commit_order), "an older token landed late"


# -- two instances racing one idempotency key on two connections


async def test_racing_writers_of_one_key_apply_it_exactly_once(
    engines: tuple[AsyncEngine, AsyncEngine],
) -> None:
    """Equal tokens (two attempts of one step) released together, many rounds."""
    (holder,) = await takeovers(1)
    scope = holder.scope_key
    for round_ in range(8):
        key = f"k{round_}"
        start = asyncio.Barrier(2)

        async def run(i: int, key: str = key, start: asyncio.Barrier = start) -> Outcome:
            await start.wait()
            return await write_with_retry(engines[i], holder, key, f"w{i}")

        first, second = await settle(run(0), run(1))
        assert first.refused is None
        assert second.refused is None
        assert sorted([first.applied_before, second.applied_before]) == [False, True]
        assert first.result == second.result
    rows = await user_rows(engines[0], scope)
    assert sorted(r[0] for r in rows) == [f"k{i}" for i in range(8)]


async def test_a_writer_blocked_behind_the_applier_sees_its_result(
    engines: tuple[AsyncEngine, AsyncEngine], backend: str
) -> None:
    """The old holder applies while the new one (token 2) waits; the new one skips."""
    old, new = await takeovers(2)
    scope = old.scope_key
    applying = asyncio.Event()
    may_commit = asyncio.Event()
    pid_of_waiter: list[int] = []

    async def old_writer() -> Outcome:
        outcome = Outcome("old", 1, "charge")
        async with (
            transaction(engines[0]) as conn,
            fenced_write(conn, ExecutionFence(old), "charge") as write,
        ):
            assert not write.applied
            await insert_user_row(conn, scope, "charge", 1, "old")
            outcome.result = {"by": "old"}
            write.record(outcome.result)
            applying.set()
            await may_commit.wait()
        return outcome

    async def new_writer() -> Outcome:
        await applying.wait()

        async def begun(conn: AsyncConnection) -> None:
            if backend == "postgresql":
                pid_of_waiter.append(await backend_pid(conn))

        return await write_with_retry(engines[1], new, "charge", "new", begun=begun)

    old_task = asyncio.create_task(old_writer())
    new_task = asyncio.create_task(new_writer())
    await wait_for_event(applying, old_task, new_task)
    if backend == "postgresql":
        # Prove the new writer really waits on the old one's lock before letting it commit.
        await eventually(
            lambda: bool(pid_of_waiter), timeout=DEADLINE, interval=0.005, what="the waiter"
        )
        await wait_until_lock_waiting(engines[0], pid_of_waiter[0])
    may_commit.set()
    first, second = await settle(old_task, new_task)
    assert second.refused is None
    assert second.applied_before
    assert second.result == first.result == {"by": "old"}
    assert await user_rows(engines[0], scope) == [("charge", 1, "old")]
    assert await mark_of(engines[0], scope) == 2


@pytest.mark.parametrize("mark_exists", [False, True], ids=["new-mark", "existing-mark"])
@pytest.mark.parametrize("isolation", ["READ COMMITTED", "REPEATABLE READ", "SERIALIZABLE"])
async def test_postgresql_race_on_one_key_at_each_isolation_level(
    make_engine: Callable[[str], AsyncEngine], isolation: str, mark_exists: bool
) -> None:
    """Two instances on two engines: one applies, the other waits, then skips with its result.

    The waiter's transaction has its snapshot before the applier commits. At READ COMMITTED
    it simply waits (on the mark's row lock, or on its primary key for a new execution) and
    then reads the committed key. At REPEATABLE READ and SERIALIZABLE PostgreSQL fails it
    with a serialization failure instead; the user retries the whole transaction (as
    :func:`write_with_retry` does) and then skips.
    """
    first_engine, second_engine = make_engine("postgresql"), make_engine("postgresql")
    await setup_sink(first_engine)
    async with transaction(first_engine) as conn:
        await conn.execute(text(USER_TABLE["postgresql"]))
    try:
        (holder,) = await takeovers(1)
        scope = holder.scope_key
        if mark_exists:
            await write_with_retry(first_engine, holder, "earlier", "earlier")
        applied = asyncio.Event()
        may_commit = asyncio.Event()
        waiter_pid: list[int] = []
        snapshot_taken = asyncio.Event()

        async def applier() -> Outcome:
            await snapshot_taken.wait()
            outcome = Outcome("applier", 1, "k")
            async with first_engine.connect() as conn:
                conn = await conn.execution_options(isolation_level=isolation)
                async with conn.begin():
                    await write_once(conn, ExecutionFence(holder), "k", "applier", outcome)
                    applied.set()
                    await may_commit.wait()
            return outcome

        async def waiter() -> Outcome:
            async def begun(conn: AsyncConnection) -> None:
                waiter_pid.append(await backend_pid(conn))  # takes the snapshot
                snapshot_taken.set()
                await applied.wait()

            return await write_with_retry(
                second_engine, holder, "k", "waiter", isolation=isolation, begun=begun
            )

        applier_task = asyncio.create_task(applier())
        waiter_task = asyncio.create_task(waiter())
        await wait_for_event(applied, applier_task, waiter_task)
        await wait_until_lock_waiting(first_engine, waiter_pid[0])
        may_commit.set()
        first, second = await settle(applier_task, waiter_task)

        assert not first.applied_before
        assert second.applied_before
        assert second.result == first.result
        if isolation == "READ COMMITTED":
            assert second.retries == 0
        else:
            assert second.retries >= 1, "a snapshot older than the commit must be refused"
            assert all(is_serialization_failure(e) for e in second.errors)
        rows = await user_rows(first_engine, scope)
        assert [r for r in rows if r[0] == "k"] == [("k", 1, "applier")]
    finally:
        await first_engine.dispose()
        await second_engine.dispose()


# -- a parent and its ANY_INSTANCE child: independent epochs, independent marks


async def test_parent_and_any_instance_child_do_not_refuse_each_other(
    engine: AsyncEngine,
) -> None:
    tenant = unique("tenant")
    parent = await takeovers(3, tenant=tenant)  # the parent was taken over twice: token 3
    child = await takeovers(2, tenant=tenant)  # its child, an execution of its own
    assert parent[0].scope_key != child[0].scope_key

    # The parent at token 3 writes first; the child at token 1 is not refused by that mark.
    assert (await write_with_retry(engine, parent[2], "charge", "parent")).refused is None
    child_first = await write_with_retry(engine, child[0], "charge", "child")
    assert child_first.refused is None
    assert not child_first.applied_before
    assert await mark_of(engine, parent[0].scope_key) == 3
    assert await mark_of(engine, child[0].scope_key) == 1

    # The child is taken over (token 2); the parent's token 3 is unaffected by it...
    assert (await write_with_retry(engine, child[1], "ship", "child")).refused is None
    assert (await write_with_retry(engine, parent[2], "ship", "parent")).refused is None
    # ... and each scope still refuses its own stale holders only.
    assert (await write_with_retry(engine, parent[1], "late", "parent")).refused is not None
    assert (await write_with_retry(engine, child[0], "late", "child")).refused is not None
    assert parent[2].error is None
    assert child[1].error is None
    assert await mark_of(engine, parent[0].scope_key) == 3
    assert await mark_of(engine, child[0].scope_key) == 2
    assert set(await applied_rows(engine, parent[0].scope_key)) == {"charge", "ship"}
    assert set(await applied_rows(engine, child[0].scope_key)) == {"charge", "ship"}


# -- a write stale only because its own run moved on


async def test_a_write_overtaken_by_its_own_runs_new_token_is_refused_without_fencing_the_run(
    make_engine: Callable[[str], AsyncEngine],
) -> None:
    """The run re-took its lease (token 2) while a write under token 1 waited on the mark."""
    pg = make_engine("postgresql")
    await setup_sink(pg)
    try:
        clock = ManualClock()
        repo = MemoryLeaseRepository(clock=clock)
        key = LeaseKey(unique("tenant"), unique("exec"))
        lease = await repo.acquire(key, "me", LEASE_TTL)
        assert lease is not None
        handle = RunHandle(repo, lease, HOLD_TTL)
        fence = ExecutionFence(handle)
        scope = fence.scope_key
        pid: list[int] = []
        waiting = asyncio.Event()

        async def slow_write() -> None:
            async with transaction(pg) as conn:
                pid.append(await backend_pid(conn))
                waiting.set()
                async with fenced_write(conn, fence, "k"):
                    raise AssertionError("a write under a replaced token must not run")

        async with transaction(pg) as blocker:
            await blocker.execute(
                text("INSERT INTO fence_high_water (scope_key, token) VALUES (:s, 2)"),
                {"s": scope},
            )
            task = asyncio.create_task(slow_write())
            await wait_for_event(waiting, task)
            await wait_until_lock_waiting(pg, pid[0])
            # The run releases and re-takes its own lease (as the remote-children wait does).
            await repo.release(lease, LeaseStatus.WAITING)
            retaken = await repo.acquire(key, "me", LEASE_TTL)
            assert retaken is not None
            assert retaken.epoch == 2
            handle.replace_lease(retaken, sent_at=handle.clock())
        with pytest.raises(ExecutionFencedError) as refused:
            async with asyncio.timeout(DEADLINE):
                await task
        assert (refused.value.token_held, refused.value.token_seen) == (1, 2)
        assert handle.error is None, "the run holds token 2: it is not fenced"
    finally:
        await pg.dispose()


# -- bad input


async def test_bad_arguments_are_refused_with_the_fix(engine: AsyncEngine) -> None:
    (holder,) = await takeovers(1)
    fence = ExecutionFence(holder)
    async with transaction(engine) as conn:
        with pytest.raises(TypeError, match="fence must be an ExecutionFence"):
            async with fenced_write(conn, holder, "k"):  # type: ignore[arg-type]
                pass
        for bad in ("", None, 7, "a\x00b", "a\ud800b"):  # a lone surrogate too, on both
            with pytest.raises(ValueError, match="idempotency_key"):
                async with fenced_write(conn, fence, bad):  # type: ignore[arg-type]
                    pass
    with pytest.raises(TypeError, match="conn must be a SQLAlchemy AsyncConnection"):
        async with fenced_write(engine, fence, "k"):  # type: ignore[arg-type]
            pass
    async with engine.connect() as conn:
        with pytest.raises(ValueError, match="conn is not in a transaction"):
            async with fenced_write(conn, fence, "k"):
                pass
        auto = await conn.execution_options(isolation_level="AUTOCOMMIT")
        async with auto.begin():
            with pytest.raises(ValueError, match="AUTOCOMMIT"):
                async with fenced_write(auto, fence, "k"):
                    pass
    assert await mark_of(engine, fence.scope_key) is None, "refused before any statement"
    with pytest.raises(TypeError, match="engine_or_conn"):
        await setup_sink("sqlite:///x.db")  # type: ignore[arg-type]
    async with engine.connect() as conn:
        assert await setup_sink(conn) == 1
        await conn.begin()
        with pytest.raises(ValueError, match="inside a transaction"):
            await setup_sink(conn)
        await conn.rollback()


async def test_record_misuse_is_refused(engine: AsyncEngine) -> None:
    (holder,) = await takeovers(1)
    fence = ExecutionFence(holder)
    kept: list[FencedWrite] = []
    async with transaction(engine) as conn:
        async with fenced_write(conn, fence, "k") as write:
            with pytest.raises(ValueError, match="JSON-serialisable"):
                write.record(float("nan"))
            with pytest.raises(ValueError, match="JSON-serialisable"):
                write.record(object())
            write.record({"ok": True})
            with pytest.raises(RuntimeError, match="called twice"):
                write.record({"ok": False})
            kept.append(write)
        with pytest.raises(RuntimeError, match="after the fenced_write block"):
            kept[0].record(1)
        async with fenced_write(conn, fence, "k") as again:
            assert again.applied
            assert again.result == {"ok": True}
            with pytest.raises(RuntimeError, match="applied already"):
                again.record(2)
    # A block that forgets record() fails, and leaves the key unapplied.
    with pytest.raises(RuntimeError, match=r"without write\.record"):
        async with transaction(engine) as conn, fenced_write(conn, fence, "forgot"):
            pass
    assert set(await applied_rows(engine, fence.scope_key)) == {"k"}


async def test_a_fence_kept_past_its_step_is_refused(engine: AsyncEngine) -> None:
    (holder,) = await takeovers(1)
    fence = ExecutionFence(holder)
    fence._close()  # what the node wrapper does when the step ends
    with pytest.raises(ExecutionContextUnavailableError):
        async with transaction(engine) as conn, fenced_write(conn, fence, "k"):
            pass
    assert await mark_of(engine, fence.scope_key) is None


async def test_a_plain_sqlalchemy_engine_of_the_users_works(
    backend: str, request: pytest.FixtureRequest, tmp_path: Path
) -> None:
    """The documented usage on an engine the user made: ``engine.begin()``, default isolation."""
    if backend == "postgresql":
        url, schema = request.getfixturevalue("pg_schema")
        dsn = normalize_url(url).render_as_string(hide_password=False)
        plain = create_async_engine(dsn, **pg_engine_options(schema))
    else:
        plain = create_async_engine(f"sqlite+aiosqlite:///{tmp_path / 'plain.db'}")
    try:
        assert await setup_sink(plain) == 1
        (holder,) = await takeovers(1)
        fence = ExecutionFence(holder)
        seen = []
        for _attempt in range(2):
            async with plain.begin() as conn, fenced_write(conn, fence, "charge:42") as write:
                seen.append(write.applied)
                if not write.applied:
                    write.record({"payment_id": 7})
        assert seen == [False, True]
        assert await applied_rows(plain, fence.scope_key) == {"charge:42": (1, {"payment_id": 7})}
    finally:
        await plain.dispose()


async def test_sqlite_busy_counts_as_a_conflict_to_retry(tmp_path: Path) -> None:
    """A deferred SQLite transaction that cannot take the write lock: the user retries it."""
    plain = create_async_engine(
        f"sqlite+aiosqlite:///{tmp_path / 'busy.db'}", connect_args={"timeout": 0.01}
    )
    try:
        await setup_sink(plain)
        old, new = await takeovers(2)
        async with plain.connect() as first, plain.connect() as second:
            await first.begin()
            await second.begin()
            async with fenced_write(first, ExecutionFence(new), "k") as write:
                write.record(None)
            with pytest.raises(DBAPIError) as busy:
                async with fenced_write(second, ExecutionFence(old), "k"):
                    pass
            assert is_serialization_failure(busy.value)
            await first.commit()
            await second.rollback()
        assert old.error is None, "a lock timeout is not a refusal"
        assert await mark_of(plain, new.scope_key) == 2
    finally:
        await plain.dispose()


def test_the_reference_sql_in_the_docs_is_the_sql_the_sink_runs() -> None:
    doc = " ".join((Path(__file__).parents[2] / "docs" / "exactly-once.md").read_text().split())
    for statement in (sinks.CHECK_AND_RAISE_MARK_SQL, sinks.CLAIM_KEY_SQL):
        sqlite_form = " ".join(statement.split())
        assert sqlite_form.removesuffix("RETURNING token") in doc
        postgres_form = (
            sqlite_form.replace(":scope_key", "$1")
            .replace(":token", "$2")
            .replace(":idempotency_key", "$3")
        )
        assert postgres_form.removesuffix("RETURNING token") in doc
    for migration in sinks.SINK_MIGRATIONS:
        for ddl in (*migration.sqlite, *migration.postgresql):
            assert isinstance(ddl, str)
            assert " ".join(ddl.split()).rstrip(" )") in doc


def test_is_serialization_failure_is_false_for_other_errors() -> None:
    assert not is_serialization_failure(ValueError("no"))
    assert not is_serialization_failure(RuntimeError("chained"))

"""Issue 24 (hardening): what a crafted or broken row can do to a worker, on both databases.

A row written by anyone who can write to the database must not run code on load, must not
stop ``serve()``, and must cost a worker that does not serve its graph nothing per poll.
"""

from __future__ import annotations

import asyncio
import copy
import dataclasses
import time
from pathlib import Path
from typing import Any, TypedDict

import pytest
from langgraph.checkpoint.serde.jsonplus import JsonPlusSerializer
from langgraph.graph import END, START, StateGraph
from sqlalchemy import event, text
from sqlalchemy.exc import IntegrityError

from checkpointers import SqlCheckpointer
from langgraph_fence import FencedCheckpointer, LeaseKey, LeaseStatus, fence_graph
from langgraph_fence.execution.serve import Server
from langgraph_fence.instance import Instance
from langgraph_fence.lease.records import ExecutionRecord, SqlExecutionRecords
from langgraph_fence.serde import safe_serializer
from langgraph_fence.testing import Leases
from tests.support.cli import cli
from tests.support.databases import SQL_BACKENDS, unique
from tests.support.hardening import TENANT, Log, crafted, expired, leave_marker, log_graph
from tests.support.polling import eventually
from tests.support.serving import serving, until_status

RUNS_ON = SQL_BACKENDS


async def test_crafted_record_runs_no_code_and_is_dead_lettered(db: Leases, tmp_path: Path) -> None:
    served_marker, unserved_marker = tmp_path / "served-ran", tmp_path / "unserved-ran"
    poisoned = await expired(db, "served", raw=("msgpack", crafted(served_marker)))
    elsewhere = await expired(db, "not-served", raw=("msgpack", crafted(unserved_marker)))
    good = await expired(db, "served")
    db.advance(31.0)
    worker = db.instance("B")
    async with serving(worker, {"served": log_graph(worker)}):
        await until_status(db, poisoned, LeaseStatus.DEAD_LETTERED)
        await until_status(db, good, LeaseStatus.DONE)
    assert not served_marker.exists(), "decoding the crafted record ran its code"
    assert not unserved_marker.exists(), "a record of a graph not served here was decoded"
    lease = await db.store.get(poisoned)
    assert lease is not None
    assert lease.reason is not None
    assert f"{leave_marker.__module__}.leave_marker" in lease.reason
    assert "allow-list" in lease.reason
    untouched = await db.store.get(elsewhere)
    assert untouched is not None
    assert untouched.status is LeaseStatus.RUNNING
    assert untouched.holder == "died"
    assert untouched.epoch == 1


async def test_a_record_is_not_decoded_when_a_checkpoint_resumes_the_run(
    db: Leases, tmp_path: Path
) -> None:
    marker = tmp_path / "ran"
    first = db.instance("A")
    key = LeaseKey(TENANT, unique("job"))
    config: Any = {"configurable": {"thread_id": key.execution_id}}
    await first.ainvoke(log_graph(first), {"log": []}, config, tenant_id=TENANT)
    async with db.engine.begin() as conn:  # the record crafted after its first checkpoint
        await conn.execute(
            text("UPDATE fence_executions SET input = :b WHERE execution_id = :e"),
            {"b": crafted(marker), "e": key.execution_id},
        )
        await conn.execute(  # handed back, as a drained run is: any instance resumes it
            text("UPDATE fence_leases SET status = 'pending', holder = NULL WHERE scope_key = :s"),
            {"s": key.scope_key},
        )
    worker = db.instance("B")
    async with serving(worker, {"served": log_graph(worker)}):
        await until_status(db, key, LeaseStatus.DONE)
    assert not marker.exists()
    lease = await db.store.get(key)
    assert lease is not None
    assert lease.epoch == 2
    assert lease.reason is None


async def test_a_submitted_runs_crafted_record_runs_no_code_and_is_dead_lettered(
    db: Leases, tmp_path: Path
) -> None:
    """A submitted run's record is read back by its pin (on PostgreSQL, in the pin's own
    statement): decoded as any record is, under the served graph's allow-list."""
    marker = tmp_path / "submitted-ran"
    client = db.instance("A")
    poisoned = await client.submit(
        "served", {"log": []}, {"configurable": {"thread_id": unique("t")}}, tenant_id=TENANT
    )
    async with db.engine.begin() as conn:
        await conn.execute(
            text("UPDATE fence_executions SET input = :b WHERE execution_id = :e"),
            {"b": crafted(marker), "e": poisoned.key.execution_id},
        )
    good = await client.submit(
        "served", {"log": []}, {"configurable": {"thread_id": unique("t")}}, tenant_id=TENANT
    )
    worker = db.instance("B")
    async with serving(worker, {"served": log_graph(worker)}):
        await until_status(db, poisoned.key, LeaseStatus.DEAD_LETTERED)
        await until_status(db, good.key, LeaseStatus.DONE)
    assert not marker.exists(), "decoding the crafted record ran its code"
    lease = await db.store.get(poisoned.key)
    assert lease is not None
    assert lease.reason is not None
    assert lease.reason.startswith("its execution record cannot be loaded: "), lease.reason
    assert "allow-list" in lease.reason


async def test_undecodable_record_dead_letters_and_serve_goes_on(db: Leases) -> None:
    pickled = await expired(db, "served", raw=("pickle", b"\x80\x04K\x01."))
    good = await expired(db, "served")
    db.advance(31.0)
    worker = db.instance("B")
    async with serving(worker, {"served": log_graph(worker)}) as stop:
        await until_status(db, pickled, LeaseStatus.DEAD_LETTERED)
        await until_status(db, good, LeaseStatus.DONE)
        assert not stop.is_set()
    lease = await db.store.get(pickled)
    assert lease is not None
    assert lease.reason is not None
    assert "pickle" in lease.reason
    assert "NotImplementedError" in lease.reason
    assert lease.epoch == 2  # dead-lettered by the instance that took it, under its token


async def test_crafted_checkpoint_blob_runs_no_code_on_get_state(
    db: Leases, tmp_path: Path
) -> None:
    marker = tmp_path / "checkpoint-ran"
    instance = db.instance("A")
    graph = log_graph(instance)
    thread = unique("thread")
    config: Any = {"configurable": {"thread_id": thread}}
    await instance.ainvoke(graph, {"log": []}, config, tenant_id=TENANT)
    async with db.engine.begin() as conn:
        changed = await conn.execute(
            text(
                "UPDATE fence_checkpoint_blobs SET type = 'msgpack', blob = :b "
                "WHERE thread_id = :t AND channel = 'log'"
            ),
            {"b": crafted(marker), "t": thread},
        )
        assert changed.rowcount >= 1
    await graph.aget_state(config)
    assert not marker.exists(), "loading the crafted checkpoint blob ran its code"


@dataclasses.dataclass
class Point:
    x: int
    y: int


class Plot(TypedDict, total=False):
    point: Point
    moved: bool


async def test_strict_msgpack_compile_copies_the_fenced_checkpointer(
    db: Leases, monkeypatch: pytest.MonkeyPatch
) -> None:
    # What LANGGRAPH_STRICT_MSGPACK=true makes compile() do: derive an allow-list from the
    # graph's schemas and hand it to checkpointer.with_allowlist() (a copy of the saver).
    from langgraph._internal import _serde

    monkeypatch.setattr(_serde, "STRICT_MSGPACK_ENABLED", True)
    # The saver's serializer as LANGGRAPH_STRICT_MSGPACK=true makes it at import.
    saver = SqlCheckpointer(db.engine, serde=JsonPlusSerializer(allowed_msgpack_modules=None))
    early = saver.with_allowlist({(__name__, "Point")})  # a copy made before the set-up...
    await saver.setup()
    assert early is not saver
    assert early.loop is saver.loop  # ...is set up with its original
    instance = Instance(db.store, saver, records=db.records, clock=db.clock)
    plain = copy.copy(instance.checkpointer)  # what BaseCheckpointSaver.with_allowlist does
    assert isinstance(plain, FencedCheckpointer)
    assert plain.inner is saver

    async def move(state: Plot) -> dict[str, Any]:
        return {"point": Point(state["point"].x + 1, state["point"].y), "moved": True}

    builder = StateGraph(Plot)
    builder.add_node("move", move)
    builder.add_edge(START, "move")
    builder.add_edge("move", END)
    graph = fence_graph(builder).compile(checkpointer=instance.checkpointer, name="graph")
    copied = graph.checkpointer
    assert copied is not instance.checkpointer  # the allow-list went into a copy
    assert (__name__, "Point") in copied.inner.serde._allowed_msgpack_modules  # type: ignore[union-attr]
    config: Any = {"configurable": {"thread_id": unique("plot"), "tenant_id": TENANT}}
    await instance.ainvoke(graph, {"point": Point(1, 2)}, config, tenant_id=TENANT)
    state = await graph.aget_state(config)
    assert state.values["point"] == Point(2, 2)  # the type is rebuilt: it is allowed


async def test_strict_msgpack_a_recorded_input_of_the_graphs_own_type_is_resumed(
    db: Leases, monkeypatch: pytest.MonkeyPatch
) -> None:
    from langgraph._internal import _serde

    monkeypatch.setattr(_serde, "STRICT_MSGPACK_ENABLED", True)
    key = LeaseKey(TENANT, unique("plot"))
    await db.records.record(ExecutionRecord(key, "plot", key.execution_id, {"point": Point(1, 2)}))
    assert await db.store.acquire(key, "died", 30.0) is not None  # died before a checkpoint
    db.advance(31.0)
    worker = db.instance("B")
    builder = StateGraph(Plot)

    async def move(state: Plot) -> dict[str, Any]:
        return {"point": Point(state["point"].x + 1, state["point"].y), "moved": True}

    builder.add_node("move", move)
    builder.add_edge(START, "move")
    builder.add_edge("move", END)
    graph = fence_graph(builder).compile(checkpointer=worker.checkpointer, name="graph")
    async with serving(worker, {"plot": graph}):
        await until_status(db, key, LeaseStatus.DONE, LeaseStatus.DEAD_LETTERED)
    lease = await db.store.get(key)
    assert lease is not None, lease
    assert lease.status is LeaseStatus.DONE, lease
    state = await graph.aget_state(
        {"configurable": {"thread_id": key.execution_id, "tenant_id": key.tenant_id}}
    )
    assert state.values["point"] == Point(2, 2)


async def taken_by(db: Leases, key: LeaseKey, holder: str) -> bool:
    lease = await db.store.get(key)
    return lease is not None and (lease.holder == holder or lease.status is LeaseStatus.DONE)


@pytest.mark.parametrize("waiting", [0, 200, 800])
async def test_unserved_candidates_cost_nothing_per_poll(
    db: Leases, waiting: int, request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch
) -> None:
    tenant = unique("tenant")  # the session's schema may hold other tests' candidates
    unserved = [await expired(db, "not-served", tenant=tenant) for _ in range(waiting)]
    db.advance(1.0)  # the served one expires after them: it is behind them in the window
    served = await expired(db, "served", tenant=tenant)
    db.advance(31.0)
    worker = db.instance("B")
    polls = 0
    taken_in_poll: list[int] = []
    loaded: list[LeaseKey] = []
    record_reads = 0
    reads_at_poll: list[int] = []  # record reads so far, as each poll starts
    poll_seconds: list[float] = []
    take_work, take_over, load = Server.take_work, worker.repository.take_over, db.records.get

    async def counted_poll(server: Server, free: int, **options: Any) -> None:
        nonlocal polls
        polls += 1
        reads_at_poll.append(record_reads)
        began = time.perf_counter()
        await take_work(server, free, **options)
        poll_seconds.append(time.perf_counter() - began)

    async def counted_take_over(candidate: Any, holder: str, ttl: float, **budget: Any) -> Any:
        if candidate.key == served:
            taken_in_poll.append(polls)
        return await take_over(candidate, holder, ttl, **budget)

    async def counted_load(key: LeaseKey, **options: Any) -> Any:
        loaded.append(key)
        return await load(key, **options)

    def count_record_reads(_c: Any, _cur: Any, statement: str, *_: Any) -> None:
        nonlocal record_reads
        if "FROM fence_executions" in statement:
            record_reads += 1

    monkeypatch.setattr(Server, "take_work", counted_poll)
    worker.repository.take_over = counted_take_over  # type: ignore[method-assign]
    db.records.get = counted_load  # type: ignore[method-assign]
    event.listen(db.engine.sync_engine, "before_cursor_execute", count_record_reads)
    started = time.perf_counter()
    try:
        async with serving(worker, {"served": log_graph(worker)}):
            await eventually(lambda: taken_by(db, served, worker.instance_id))
            seconds = time.perf_counter() - started
            await eventually(lambda: polls >= 4)
            await until_status(db, served, LeaseStatus.DONE)
    finally:
        event.remove(db.engine.sync_engine, "before_cursor_execute", count_record_reads)
        del db.records.get  # the instance attribute: back to the method
    assert taken_in_poll == [1]  # taken in the first poll, however many wait ahead
    assert set(loaded) <= {served}  # no unserved record was loaded (decoded)
    # Polls 2 and 3 read no record: the unserved ones are remembered, not looked up again.
    assert reads_at_poll[3] - reads_at_poll[1] == 0
    for key in unserved[:5]:
        lease = await db.store.get(key)
        assert lease is not None
        assert lease.holder == "died"
    async with db.engine.begin() as conn:  # out of later tests' way
        await conn.execute(
            text("UPDATE fence_leases SET status = 'done', holder = NULL WHERE tenant_id = :t"),
            {"t": tenant},
        )
    request.node.user_properties.append(("takeover_seconds", seconds))
    later = max(poll_seconds[1:3]) * 1000
    print(
        f"\n[{request.node.callspec.id}] behind {waiting} unserved: taken in {seconds:.3f} s; "
        f"a later poll takes {later:.1f} ms"
    )


CARD = "4111111111111111"


async def test_failure_reasons_are_bounded_and_hold_no_driver_parameters(db: Leases) -> None:
    instance = db.instance("A")
    async with db.engine.begin() as conn:
        await conn.execute(
            text("CREATE TABLE IF NOT EXISTS hardening_cards (id TEXT PRIMARY KEY, card TEXT)")
        )

    async def charge(state: Log) -> dict[str, Any]:
        row = {"id": unique("charge"), "card": CARD}
        async with db.engine.begin() as conn:  # the second insert violates the primary key
            for _ in range(2):
                await conn.execute(text("INSERT INTO hardening_cards VALUES (:id, :card)"), row)
        return {}

    async def shout(state: Log) -> dict[str, Any]:
        raise RuntimeError(
            "connect to postgresql://app:hunter2@db/prod failed " + "x" * 5000 + "\nline two"
        )

    reasons = []
    for node, error in ((charge, IntegrityError), (shout, RuntimeError)):
        builder = StateGraph(Log)
        builder.add_node("node", node)
        builder.add_edge(START, "node")
        builder.add_edge("node", END)
        graph = fence_graph(builder).compile(checkpointer=instance.checkpointer, name="graph")
        key = LeaseKey(TENANT, unique("fails"))
        config: Any = {"configurable": {"thread_id": key.execution_id}}
        with pytest.raises(error):
            await instance.ainvoke(graph, {"log": []}, config, tenant_id=TENANT)
        lease = await db.store.get(key)
        assert lease is not None
        assert lease.status is LeaseStatus.FAILED
        assert lease.reason is not None
        reasons.append(lease.reason)
    charged, shouted = reasons
    assert charged.startswith("IntegrityError (")  # and the driver's SQLSTATE or error name
    assert CARD not in charged
    assert "[SQL" not in charged
    assert "parameters" not in charged
    assert shouted.startswith("RuntimeError: connect to postgresql://app:***@db/prod failed")
    assert "hunter2" not in shouted
    assert "line two" not in shouted
    assert len(shouted) <= 500


async def test_cli_listings_filter_by_tenant(db: Leases, request: pytest.FixtureRequest) -> None:
    mine, theirs = unique("mine"), unique("theirs")
    for tenant in (mine, theirs):
        key = LeaseKey(tenant, unique("job"))
        lease = await db.store.acquire(key, "A", 30.0)
        assert lease is not None
        await db.store.dead_letter(key, f"secret of {tenant} [/b]", epoch=lease.epoch)
    if request.node.callspec.params["backend"] == "sqlite":
        target = ["--db", db.engine.url.render_as_string(hide_password=False)]
    else:
        url, schema = request.getfixturevalue("pg_schema")
        target = ["--db", url, "--schema", schema]
    for command in ("executions", "dead-letters"):
        done = await asyncio.to_thread(cli, command, *target, "--tenant", mine)
        assert done.returncode == 0, done.stdout + done.stderr
        assert f"secret of {mine} [/b]" in done.stdout  # data, not rich markup
        assert theirs not in done.stdout


def test_a_mistyped_url_is_never_echoed_with_its_password() -> None:
    for url in ("postgresql//app:hunter2@db/prod", "postgresql://app:hunter2@db:port/prod"):
        done = cli("executions", "--db", url, columns=250)
        assert done.returncode == 2, done.stdout + done.stderr
        assert "hunter2" not in done.stdout + done.stderr
        assert "app:***@db" in done.stderr


async def test_record_serializer_is_configurable_and_refuses_by_default(db: Leases) -> None:
    key = LeaseKey(TENANT, unique("plot"))
    allowing = SqlExecutionRecords(db.engine, serde=safe_serializer([Point]))
    await allowing.record(ExecutionRecord(key, "plot", key.execution_id, {"point": Point(1, 2)}))
    record = await allowing.get(key)
    assert record is not None
    assert record.input == {"point": Point(1, 2)}
    with pytest.raises(ValueError, match=rf"{__name__}\.Point.*allow-list"):
        await SqlExecutionRecords(db.engine).get(key)  # the default: strict

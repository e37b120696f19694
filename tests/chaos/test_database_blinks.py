"""A database that blinks loses no execution (issue 9 item 5).

On a real PostgreSQL server the test owns (the private cluster of ``pg_cluster``, never
the shared server), or reached through a proxy the test cuts:

* a restart shorter than the lease, in the middle of a run (the run waits inside a node
  while the server restarts), leaves the execution ``done`` with its sink write applied
  once: the pooled connections the restart killed are replaced, the renewals and the next
  checkpoint write retried on fresh ones;
* a run cut off from the database while another instance takes its lease over ends with
  ``ExecutionFencedError`` once the database is back, not ``ExecutionLeaseLostError``;
* a checkpoint write cancelled mid-statement never hands its connection to the next one.

SQLite has no connection to lose: these faults are PostgreSQL's alone.
"""

from __future__ import annotations

import asyncio
import logging
import random
from pathlib import Path
from typing import Any

import pytest
import sqlalchemy as sa
from langgraph.checkpoint.base import empty_checkpoint
from langgraph.graph import END, START, StateGraph
from sqlalchemy.engine import make_url

from langgraph_fence import (
    Effect,
    ExecutionFencedError,
    ExecutionLeaseLostError,
    LeaseKey,
    LeaseStatus,
    SqlLeaseRepository,
    fence_graph,
    get_execution_context,
)
from langgraph_fence.database import create_engine, schema_options, transaction
from langgraph_fence.database.retry import is_database_connection_error
from langgraph_fence.errors import linked_errors
from langgraph_fence.fence import RunHandle
from langgraph_fence.instance import Instance
from langgraph_fence.keys import FENCE_CONFIG_KEY
from langgraph_fence.sinks import fenced_write, setup_sink
from tests.support.chaos_graphs import CREATE_EFFECTS, State
from tests.support.chaos_serve import STARTUP_DEADLINE, Chaos, effects, statuses
from tests.support.databases import unique
from tests.support.pg_cluster import CuttableProxy, PgCluster
from tests.support.polling import eventually

pytestmark = [pytest.mark.chaos, pytest.mark.postgres]

TENANT = "blink"
DEADLINE = 60.0  # for any one step on a loaded box
_INSERT = sa.text(
    "INSERT INTO chaos_effects (execution_id, variant, token, worker) "
    "VALUES (:execution_id, 'blink', :token, 'in-process')"
)


def waiting_graph(instance: Instance, entered: asyncio.Event, go_on: asyncio.Event) -> Any:
    """wait -> charge -> END: ``wait`` sets ``entered`` and waits for ``go_on``; ``charge``
    writes one row to ``chaos_effects`` through the exactly-once sink."""
    engine = instance.repository.engine  # type: ignore[attr-defined]

    async def wait(state: State) -> dict[str, list[str]]:
        entered.set()
        await go_on.wait()
        return {"log": ["wait"]}

    async def charge(state: State) -> dict[str, list[str]]:
        fence = get_execution_context().fence
        async with (
            transaction(engine) as conn,
            fenced_write(conn, fence, "charge") as write,
        ):
            if not write.applied:
                params = {"execution_id": fence.lease_execution_id, "token": fence.token}
                await conn.execute(_INSERT, params)
                write.record(fence.token)
        return {"log": ["charge"]}

    builder = StateGraph(State)
    builder.add_node("wait", wait)
    builder.add_node("charge", charge)
    builder.add_edge(START, "wait")
    builder.add_edge("wait", "charge")
    builder.add_edge("charge", END)
    graph = fence_graph(builder, effects={"charge": Effect.IDEMPOTENT_WRITE})
    return graph.compile(checkpointer=instance.checkpointer, name="blink")


async def _tables(engine: Any) -> None:
    await setup_sink(engine)
    async with engine.begin() as conn:
        await conn.execute(sa.text(CREATE_EFFECTS))


async def test_a_restart_shorter_than_the_lease_mid_run_leaves_the_run_done(
    cluster_schema: tuple[PgCluster, str],
) -> None:
    cluster, schema = cluster_schema
    ttl = 6.0  # renewed every 2 s: at least 3.4 s of confirmed window when the restart begins
    entered, go_on = asyncio.Event(), asyncio.Event()
    execution = unique("restart")
    async with Instance.open(
        cluster.url, engine_options=schema_options(schema), lease_ttl=ttl
    ) as instance:
        engine = instance.repository.engine  # type: ignore[attr-defined]
        await _tables(engine)
        graph = waiting_graph(instance, entered, go_on)
        config = {"configurable": {"thread_id": execution}}
        run = asyncio.create_task(instance.ainvoke(graph, {"log": []}, config, tenant_id=TENANT))
        await asyncio.wait_for(entered.wait(), DEADLINE)
        # Mid-run, no statement in flight: every pooled connection dies with the server.
        down = await asyncio.to_thread(cluster.restart, 1.5)
        assert down < ttl - 2.0, f"the restart took {down:.1f}s: not shorter than the lease"
        go_on.set()
        result = await asyncio.wait_for(run, DEADLINE)
        assert result["log"] == ["wait", "charge"]
        rows = [r for r in await statuses(engine, TENANT) if r[0] == execution]
        assert [(r[1], r[2]) for r in rows] == [(LeaseStatus.DONE.value, 1)], rows
        assert (await effects(engine, execution))[execution] == 1


async def test_a_run_cut_off_while_taken_over_ends_fenced_once_the_database_is_back(
    own_schema: tuple[str, str],
) -> None:
    url, schema = own_schema
    target = make_url(url)
    proxy = await CuttableProxy(target.host or "127.0.0.1", target.port or 5432).start()
    through_proxy = target.set(port=proxy.port).render_as_string(hide_password=False)
    ttl = 3.0
    entered, go_on = asyncio.Event(), asyncio.Event()
    execution = unique("cutoff")
    other = create_engine(url, **schema_options(schema))
    try:
        async with Instance.open(
            through_proxy, engine_options=schema_options(schema), lease_ttl=ttl
        ) as instance:
            await _tables(other)
            graph = waiting_graph(instance, entered, go_on)
            config = {"configurable": {"thread_id": execution}}
            run = asyncio.create_task(
                instance.ainvoke(graph, {"log": []}, config, tenant_id=TENANT)
            )
            await asyncio.wait_for(entered.wait(), DEADLINE)
            proxy.cut()  # this instance can no longer reach the database; the other can
            taker = SqlLeaseRepository(other)
            key = LeaseKey(TENANT, execution)

            async def taken() -> bool | None:
                for candidate in await taker.takeover_candidates(limit=1000):
                    if candidate.key == key:
                        lease = await taker.take_over(candidate, "the-other-instance", 30.0)
                        return True if lease is not None else None
                return None

            await eventually(taken, timeout=DEADLINE, what="the lease to expire and be taken")
            # The run's step ends while it is still cut off: its run now classifies the
            # loss, and must wait for the database to tell it what happened.
            refused = proxy.refused
            go_on.set()

            async def classifying() -> bool | None:
                return True if run.done() or proxy.refused >= refused + 2 else None

            await eventually(
                classifying,
                timeout=DEADLINE,
                what="the run to look at the store",
            )
            proxy.heal()
            with pytest.raises(ExecutionFencedError) as caught:
                await asyncio.wait_for(run, DEADLINE)
            assert caught.value.token_seen == 2
        rows = [r for r in await statuses(other, TENANT) if r[0] == execution]
        assert [(r[1], r[2]) for r in rows] == [(LeaseStatus.RUNNING.value, 2)], rows
    finally:
        await proxy.close()
        await other.dispose()


async def test_a_cancelled_checkpoint_write_never_hands_its_connection_on(
    own_schema: tuple[str, str],
) -> None:
    """A checkpoint write cancelled while it waits on the database (a drained run, a
    timeout) closes the driver connection it ran on: the saver's raw asyncpg calls bypass
    SQLAlchemy, so nothing else would keep that busy connection from the next operation
    (where asyncpg says "another operation is in progress")."""
    url, schema = own_schema
    tag = unique("lgf-cancel")
    settings = {"search_path": schema, "application_name": tag}
    blocker = create_engine(url, **schema_options(schema))
    async with Instance.open(
        url, engine_options={"connect_args": {"server_settings": settings}}
    ) as instance:
        saver = instance.checkpointer.inner  # type: ignore[attr-defined]
        key = LeaseKey(TENANT, unique("cancel"))
        lease = await instance.repository.acquire(key, instance.instance_id, 30.0)
        assert lease is not None
        handle = RunHandle(instance.repository, lease, 30.0)
        config: Any = {
            "configurable": {
                "thread_id": key.execution_id,
                "checkpoint_ns": "",
                "tenant_id": key.tenant_id,
                FENCE_CONFIG_KEY: handle,
            }
        }
        await saver.aput(config, empty_checkpoint(), {}, {})  # the saver holds a connection
        try:
            async with transaction(blocker) as lock:  # the lease row locked till its end
                await lock.execute(
                    sa.text(
                        "SELECT 1 FROM fence_leases WHERE tenant_id = :t AND execution_id = :e"
                        " FOR UPDATE"
                    ),
                    {"t": key.tenant_id, "e": key.execution_id},
                )
                write = asyncio.create_task(saver.aput(config, empty_checkpoint(), {}, {}))
                waiting = sa.text(
                    "SELECT pid FROM pg_stat_activity WHERE wait_event_type = 'Lock'"
                    " AND application_name = :tag"
                )

                async def blocked() -> int | None:
                    async with blocker.connect() as probe:
                        return (await probe.execute(waiting, {"tag": tag})).scalar()

                pid = await eventually(blocked, timeout=DEADLINE, what="the write to wait")
                write.cancel()
                with pytest.raises(asyncio.CancelledError):
                    await write
            gone = sa.text("SELECT count(*) FROM pg_stat_activity WHERE pid = :pid")

            async def closed() -> bool | None:
                async with blocker.connect() as probe:
                    count = (await probe.execute(gone, {"pid": pid})).scalar_one()
                    return True if count == 0 else None

            await eventually(
                closed,
                timeout=DEADLINE,
                what="the cancelled write's connection to close",
            )
            # The next write runs on a connection of its own, and lands.
            await saver.aput(config, empty_checkpoint(), {}, {})
        finally:
            await blocker.dispose()


async def test_a_run_cut_off_past_its_lease_is_handed_back_and_serve_rides_out_the_outage(
    own_schema: tuple[str, str], caplog: pytest.LogCaptureFixture
) -> None:
    """The window runs out: the run stops as lease-lost (never ``failed``), and a serve()
    loop that could not read the store meanwhile (it logs, backs off, goes on) takes the
    execution over once the database is back and finishes it."""
    url, schema = own_schema
    target = make_url(url)
    proxy = await CuttableProxy(target.host or "127.0.0.1", target.port or 5432).start()
    through_proxy = target.set(port=proxy.port).render_as_string(hide_password=False)
    entered, go_on = asyncio.Event(), asyncio.Event()
    execution = unique("outage")
    caplog.set_level(logging.WARNING, logger="langgraph_fence.serve")
    options = {"engine_options": schema_options(schema), "lease_ttl": 2.0}
    try:
        async with (
            Instance.open(through_proxy, **options) as cut_off,
            Instance.open(through_proxy, **options) as server,
        ):
            await _tables(server.repository.engine)  # type: ignore[attr-defined]
            done_event = asyncio.Event()
            done_event.set()
            served = {"blink": waiting_graph(server, asyncio.Event(), done_event)}
            stop = asyncio.Event()
            serving = asyncio.create_task(
                server.serve(served, poll_interval=0.2, stop=stop, handle_signals=False)
            )
            graph = waiting_graph(cut_off, entered, go_on)
            config = {"configurable": {"thread_id": execution}}
            run = asyncio.create_task(
                cut_off.ainvoke(graph, {"log": []}, config, tenant_id=TENANT, graph_name="blink")
            )
            await asyncio.wait_for(entered.wait(), DEADLINE)
            proxy.cut()  # both instances lose the database
            go_on.set()  # the step ends; its writes cannot be saved
            with pytest.raises(ExecutionLeaseLostError) as caught:
                await asyncio.wait_for(run, DEADLINE)
            assert not isinstance(caught.value, ExecutionFencedError)
            assert "store could not be reached" in str(caught.value)
            assert not serving.done(), "serve() exited on a store error"
            proxy.heal()
            engine = server.repository.engine  # type: ignore[attr-defined]

            async def finished() -> list[Any] | None:
                rows = [r for r in await statuses(engine, TENANT) if r[0] == execution]
                return rows if rows and rows[0][1] == LeaseStatus.DONE.value else None

            rows = await eventually(finished, timeout=DEADLINE, what="serve() to finish the run")
            assert rows[0][2] == 2  # taken over once
            assert (await effects(engine, execution))[execution] == 1
            assert not serving.done(), "serve() exited on a store error"
            stop.set()
            await asyncio.wait_for(serving, DEADLINE)
        logged = [r.getMessage() for r in caplog.records if "could not be read" in r.getMessage()]
        assert logged, "serve() did not say why it could not look at the store"
    finally:
        await proxy.close()


async def test_a_worker_started_while_the_database_is_down_waits_for_it(
    own_schema: tuple[str, str], tmp_path: Path
) -> None:
    """``langgraph-fence worker`` whose database cannot be reached when it starts says so and
    tries again (it used to exit 1); once the database is back it serves, and it stops
    cleanly on SIGTERM."""
    url, schema = own_schema
    target = make_url(url)
    proxy = await CuttableProxy(target.host or "127.0.0.1", target.port or 5432).start()
    through_proxy = target.set(port=proxy.port).render_as_string(hide_password=False)
    chaos = Chaos(tmp_path, through_proxy, schema, random.Random(9))
    try:
        proxy.cut()
        worker = await chaos.spawn()

        async def said(what: str) -> bool | None:
            if worker.proc.returncode is not None:
                pytest.fail(f"the worker exited {worker.proc.returncode}: {worker.err.read_text()}")
            seen = worker.out.read_text() + worker.err.read_text()
            return True if what in seen else None

        await eventually(
            lambda: said("the database cannot be reached"),
            timeout=STARTUP_DEADLINE,
            what="the worker to say its database cannot be reached",
        )
        proxy.heal()
        await eventually(
            lambda: said(" serves "),
            timeout=DEADLINE,
            what="the worker to serve",
        )
        codes = await chaos.shutdown()
        assert codes == {worker.name: 0}, (codes, worker.err.read_text()[-2000:])
    finally:
        await proxy.close()


async def test_a_start_whose_take_loses_its_connection_is_handed_back_to_its_caller(
    own_schema: tuple[str, str],
) -> None:
    """The take (binding, record and lease in one statement) on a pooled connection the
    database dropped: the caller gets the connection error, nothing of the start stands
    (no lease, no record, its slot given back), and the same start runs once it is back."""
    url, schema = own_schema
    target = make_url(url)
    proxy = await CuttableProxy(target.host or "127.0.0.1", target.port or 5432).start()
    through_proxy = target.set(port=proxy.port).render_as_string(hide_password=False)
    options = {"engine_options": schema_options(schema), "lease_ttl": 5.0}
    done = asyncio.Event()
    done.set()
    try:
        async with Instance.open(through_proxy, **options) as instance:
            await _tables(instance.repository.engine)  # type: ignore[attr-defined]
            graph = waiting_graph(instance, asyncio.Event(), done)
            warm = {"configurable": {"thread_id": unique("warm")}}
            await instance.ainvoke(graph, {"log": []}, warm, tenant_id=TENANT)  # pooled now
            thread = unique("cut-start")
            config = {"configurable": {"thread_id": thread}}
            proxy.cut()  # every pooled connection dies
            caught: BaseException | None = None
            try:
                await asyncio.wait_for(
                    instance.ainvoke(graph, {"log": []}, config, tenant_id=TENANT), DEADLINE
                )
            except Exception as exc:
                caught = exc
            assert caught is not None, "the start ran with its connection gone"
            assert any(is_database_connection_error(e) for e in linked_errors(caught)), caught
            assert instance.host.keeper.free == instance.host.keeper.max_held  # its slot is back
            proxy.heal()
            key = LeaseKey(TENANT, thread)
            assert await instance.repository.get(key) is None
            assert await instance.records.get(key) is None
            out = await instance.ainvoke(graph, {"log": []}, config, tenant_id=TENANT)
            assert out["log"] == ["wait", "charge"]
            lease = await instance.repository.get(key)
            assert lease is not None
            assert (lease.status, lease.epoch) == (LeaseStatus.DONE, 1)
    finally:
        await proxy.close()

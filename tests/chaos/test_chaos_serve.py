"""Chaos on real PostgreSQL: serve() workers frozen and killed while they charge.

Three ``langgraph-fence worker`` processes (the product's CLI, ``serve()`` inside) run
executions of two graphs (``chaos_graphs.py``): ``chaos_plain``, whose ``charge`` appends a
row to an external table with a plain INSERT (``NON_IDEMPOTENT_WRITE``), and ``chaos_sink``,
whose ``charge`` writes the same row through the exactly-once sink (``IDEMPOTENT_WRITE``).
A client process starts some executions itself through ``Instance.ainvoke``; the test
records the others as pending (lease taken by the test, execution recorded, lease handed
back: what a graceful stop leaves), in waves while the chaos runs. So ``ainvoke``'s first
run, serve's first take, its start from the recorded input and its takeover of expired runs
are all on the path. Once two servers are up, the test freezes random processes past their
lease (SIGSTOP, then SIGCONT) and kills others (SIGKILL) while new servers start; if the
client is killed, the test records as pending what it never started. After a quiet period
in which the survivors finish:

* every execution is ``done`` or ``dead_lettered`` with a reason: none lost, none still
  pending or running, none ``failed``;
* ``chaos_plain``: no execution charged twice; every ``done`` one charged exactly once;
* ``chaos_sink``: every execution ``done``, charged exactly once, none dead-lettered;
* the chaos hit running executions (some were taken over mid-run), and every server that
  was not killed stops cleanly on SIGTERM.

Bounded: one seed (printed; ``LGF_CHAOS_SEED`` replays the choices), at most four worker
processes and one client alive at once, a fixed count of executions, deadlines on every
wait; every child is killed in ``finally``.

Further tests kill the client inside each write ``ainvoke`` makes to start an execution
(held there by a table lock): nothing may be lost; and they check that executions of a graph a
worker does not serve do not hide the ones it does.
"""

from __future__ import annotations

import asyncio
import os
import random
import time
from collections import Counter
from pathlib import Path

import pytest
from sqlalchemy import text
from sqlalchemy.ext.asyncio import AsyncEngine

from langgraph_fence import (
    ExecutionLeaseHeldError,
    Lease,
    LeaseKey,
    LeaseStatus,
    SqlLeaseRepository,
)
from langgraph_fence.database import create_engine
from langgraph_fence.instance import Instance
from langgraph_fence.lease.records import SqlExecutionRecords
from tests.support.chaos_graphs import (
    AIM_WHILE_ENV,
    CREATE_EFFECTS,
    HOLD_GRAPH,
    NESTED_GRAPH,
    PLAIN_GRAPH,
    SINK_GRAPH,
    SLOW_ROOT_ENV,
    build_hold_graph,
    spawn_hold,
)
from tests.support.chaos_serve import (
    CONCURRENCY,
    MAX_ALIVE,
    STARTUP_DEADLINE,
    TTL,
    Chaos,
    Worker,
    effects,
    record_pending,
    statuses,
    tails,
)
from tests.support.databases import pg_engine_options, setup_all, unique
from tests.support.polling import eventually
from tests.support.processes import Started, stop_process, wait_ready

pytestmark = [pytest.mark.chaos, pytest.mark.postgres]

WORKERS = 3
PLAIN_COUNT = 100
SINK_COUNT = 50
STARTER_COUNT = 40  # of them started by a client through Instance.ainvoke
FEED_SECONDS = 15.0  # executions are recorded in waves over this long
CHAOS_SECONDS = 22.0  # signals are sent for this long
QUIET_DEADLINE = 30.0  # then the survivors must finish within this
TERMINAL = {LeaseStatus.DONE, LeaseStatus.FAILED, LeaseStatus.DEAD_LETTERED}


async def chaos_database(
    url: str, schema: str
) -> tuple[AsyncEngine, SqlLeaseRepository, SqlExecutionRecords]:
    """An engine on ``schema`` with every table set up (and the charges' table), its lease
    store and its records."""
    engine = create_engine(url, **pg_engine_options(schema))
    await setup_all(engine)
    async with engine.connect() as conn:
        await conn.execute(text(CREATE_EFFECTS))
    return engine, SqlLeaseRepository(engine), SqlExecutionRecords(engine)


async def ended(repo: SqlLeaseRepository, key: LeaseKey) -> Lease | None:
    """The lease of ``key`` once it has ended (done, failed or dead-lettered), else None."""
    lease = await repo.get(key)
    return lease if lease is not None and lease.status in TERMINAL else None


async def adopt(
    repo: SqlLeaseRepository, records: SqlExecutionRecords, jobs: list[tuple[LeaseKey, str]]
) -> set[LeaseKey]:
    """The starter was killed: record as pending what it never got to start.

    What it did start (a lease row exists) is serve's to take over; nothing else is
    touched, so an execution it started but did not record stays as it left it.
    """
    adopted = set()
    for key, graph in jobs:
        if await repo.get(key) is None:
            await record_pending(repo, records, key, graph)
            adopted.add(key)
    return adopted


def starter_fate(starter: Worker) -> str:
    if starter.killed:
        return "killed"
    return f"exit {starter.proc.returncode}"


#: The executions of each mix, by graph: ``flat`` as it always was; ``nested`` charges two
#: PARENT_INSTANCE levels down (``chaos_nested``) with every root checkpoint held back 0 to
#: 0.3 s, so the children's writes often land before the root checkpoint of their
#: superstep (the double charge of a resume that starts from the root).
MIXES = {
    "flat": {PLAIN_GRAPH: PLAIN_COUNT, SINK_GRAPH: SINK_COUNT},
    "nested": {NESTED_GRAPH: 100, PLAIN_GRAPH: 25, SINK_GRAPH: 25},
}
#: The graphs whose charge is a plain INSERT: at most once, exactly once when done.
AT_MOST_ONCE = (PLAIN_GRAPH, NESTED_GRAPH)


@pytest.mark.parametrize("mix", sorted(MIXES))
async def test_serve_workers_frozen_and_killed_never_charge_twice(
    own_schema: tuple[str, str], tmp_path: Path, capsys: pytest.CaptureFixture[str], mix: str
) -> None:
    url, schema = own_schema
    seed = int(os.environ.get("LGF_CHAOS_SEED", random.randrange(1 << 30)))
    rng = random.Random(seed)
    tenant = unique("chaos")
    prefix = unique("x")
    keys = [
        (LeaseKey(tenant, f"{prefix}-{graph[6]}{i:03d}"), graph)
        for graph, count in MIXES[mix].items()
        for i in range(count)
    ]
    rng.shuffle(keys)
    # A client process starts some of them itself, through Instance.ainvoke (epoch 1); the
    # test records the rest as pending for serve() to start (epoch 2 at the first take).
    by_starter = keys[:STARTER_COUNT]
    pending = keys[STARTER_COUNT:]
    started = time.monotonic()

    engine, repo, records = await chaos_database(url, schema)
    chaos = Chaos(tmp_path, url, schema, rng)
    aiming = tmp_path / "aiming"
    if mix == "nested":
        chaos.env[SLOW_ROOT_ENV] = "1"
        # Aimed kills while the chaos lasts (the file exists), so the quiet period is quiet.
        chaos.worker_env[AIM_WHILE_ENV] = str(aiming)
    codes: dict[str, int | None] = {}
    adopted: set[LeaseKey] = set()
    try:
        starter = await chaos.spawn_starter(tenant, by_starter)
        for _ in range(WORKERS):
            await chaos.spawn()
        # Start-up: the chaos begins once two servers are up (imports take seconds here).
        await chaos.until_up(
            lambda: len(chaos.ready_servers()) >= 2,
            started + STARTUP_DEADLINE,
            f"seed {seed}: two workers to start",
        )
        # Chaos: feed executions in waves, and every 0.8-1.6 s freeze or kill a worker.
        fed = 0
        aiming.touch()
        chaos_start = next_act = time.monotonic()
        chaos_end = chaos_start + CHAOS_SECONDS
        while (now := time.monotonic()) < chaos_end:
            share = (now - chaos_start) / FEED_SECONDS
            due = min(len(pending), int(len(pending) * share) + 1)
            while fed < due:
                key, graph = pending[fed]
                await record_pending(repo, records, key, graph)
                fed += 1
            if starter.killed and not starter.adopted:
                adopted = await adopt(repo, records, by_starter)
                starter.adopted = True
            chaos.continue_due(now)
            chaos.check_crashes()
            await chaos.replace_killed()
            chaos.update_ready()
            if now >= next_act and len(chaos.alive()) <= MAX_ALIVE and await chaos.act(now):
                next_act = now + rng.uniform(0.8, 1.6)
            await asyncio.sleep(0.05)
        aiming.unlink()
        while fed < len(pending):
            await record_pending(repo, records, *pending[fed])
            fed += 1
        chaos.continue_due(time.monotonic(), all_of_them=True)
        if starter.killed and not starter.adopted:
            adopted = await adopt(repo, records, by_starter)
            starter.adopted = True

        # Quiet: the survivors finish everything (or the test fails at the deadline).
        quiet_end = time.monotonic() + QUIET_DEADLINE
        trace = tmp_path / "quiet.trace"
        open_: list[tuple[str, str, int, str | None]] = []

        async def all_ended() -> bool:
            rows = await statuses(engine, tenant)
            open_[:] = [r for r in rows if LeaseStatus(r[1]) not in TERMINAL]
            if len(rows) == len(keys) and not open_:
                return True
            with trace.open("a") as out:  # what stays open, for a post-mortem
                out.write(f"{time.monotonic() - started:.1f} {len(rows)} {open_}\n")
            chaos.check_crashes()
            await chaos.replace_killed()
            if not chaos.alive():
                raise AssertionError(f"seed {seed}: no worker is left: {await still_open()}")
            return False

        async def still_open() -> str:
            unrecorded = [r[0] for r in open_ if await records.get(LeaseKey(tenant, r[0])) is None]
            return (
                f"seed {seed}: the executions to end in the quiet period; {len(open_)} still "
                f"open ({len(unrecorded)} of them without an execution record): {open_[:10]}\n"
                f"{tails(chaos, [w.name for w in chaos.alive()])}"
            )

        await eventually(all_ended, deadline=quiet_end, interval=0.2, what=still_open)
        quiet_took = time.monotonic() - (quiet_end - QUIET_DEADLINE)
        if not starter.killed:
            # Every run it started has ended one way or another: so must the client.
            try:
                await asyncio.wait_for(starter.proc.wait(), 10.0)
            except TimeoutError:
                pytest.fail(f"seed {seed}: the starter hung: {tails(chaos, ['starter'])}")
            chaos.check_crashes()
    finally:
        codes = await chaos.shutdown()

    try:
        rows = await statuses(engine, tenant)
        charged = await effects(engine, prefix)
    finally:
        await engine.dispose()
    by_id = {r[0]: r for r in rows}
    graph_of = {key.execution_id: graph for key, graph in keys}
    assert set(by_id) == set(graph_of), "an execution was lost"
    count = Counter((graph_of[r[0]], r[1]) for r in rows)
    # Started by the client: first held at 1; recorded as pending (by the test, or adopted
    # from a killed client): first held at 2.
    first_token = {key.execution_id: 1 for key, _ in by_starter if key not in adopted}
    takeovers = sum(1 for r in rows if r[2] > first_token.get(r[0], 2))
    # A dead letter whose charge did happen may be a false one (its writes were stored but
    # not yet proven seen by a resume), or the true refusal of a write cut off mid-step:
    # counted apart, so a run shows how many executions were stopped with their charge made.
    dead_charged = Counter(
        graph_of[r[0]] for r in rows if r[1] == "dead_lettered" and charged.get(r[0], 0) == 1
    )
    per_graph = "; ".join(
        f"{graph}: done {count[(graph, 'done')]}, dead-lettered "
        f"{count[(graph, 'dead_lettered')]} ({dead_charged[graph]} of them charged once)"
        for graph in MIXES[mix]
    )
    with capsys.disabled():
        print(
            f"\nchaos ({mix}) seed {seed}: {len(keys)} executions in "
            f"{time.monotonic() - started:.1f} s "
            f"(start-up {chaos_start - started:.1f} s, chaos {CHAOS_SECONDS:g} s, quiet period "
            f"{quiet_took:.1f} s); workers started {chaos.spawned}, "
            f"SIGKILL {chaos.kills} (+{chaos.aimed} aimed), SIGSTOP+SIGCONT {chaos.stops}; "
            "started by ainvoke "
            f"{len(by_starter)} (starter {starter_fate(starter)}); taken over mid-run "
            f"{takeovers}; {per_graph}; charge rows {sum(charged.values())}"
        )

    failures = []
    for execution_id, status, epoch, reason in rows:
        graph = graph_of[execution_id]
        rows_charged = charged.get(execution_id, 0)
        if status not in ("done", "dead_lettered"):
            failures.append(f"{execution_id} ({graph}) ended {status} at {epoch}: {reason}")
        elif status == "dead_lettered" and not reason:
            failures.append(f"{execution_id} ({graph}) dead-lettered without a reason")
        if rows_charged > 1:
            failures.append(f"{execution_id} ({graph}) charged {rows_charged} times")
        if status == "done" and rows_charged != 1:
            failures.append(f"{execution_id} ({graph}) done but charged {rows_charged} times")
        if graph == SINK_GRAPH and status != "done":
            failures.append(f"{execution_id} ({graph}, the sink) ended {status}: {reason}")
    assert not failures, f"seed {seed}:\n" + "\n".join(failures[:30])
    assert not chaos.crashes, f"seed {seed}: workers crashed: {tails(chaos, chaos.crashes)}"
    bad_exits = {name: code for name, code in codes.items() if code != 0}
    assert not bad_exits, f"seed {seed}: workers did not stop cleanly on SIGTERM: {bad_exits}"
    assert chaos.kills >= 1, f"seed {seed}: the chaos did not happen"
    assert chaos.stops >= 1, f"seed {seed}: the chaos did not happen"
    assert takeovers >= 1, f"seed {seed}: no execution was taken over mid-run"
    assert time.monotonic() - started < STARTUP_DEADLINE + CHAOS_SECONDS + QUIET_DEADLINE + 30


async def blocked_on(engine: AsyncEngine, schema: str, table: str) -> bool:
    """Whether some session waits for a lock on ``schema.table``."""
    async with engine.connect() as conn:
        waiting = (
            await conn.execute(
                text(
                    "SELECT count(*) FROM pg_locks l JOIN pg_class c ON c.oid = l.relation"
                    " JOIN pg_namespace n ON n.oid = c.relnamespace"
                    " WHERE n.nspname = :schema AND c.relname = :table AND NOT l.granted"
                ),
                {"schema": schema, "table": table},
            )
        ).scalar_one()
    return bool(waiting)


@pytest.mark.parametrize(
    "table",
    ["fence_thread_bindings", "fence_executions", "fence_leases", "fence_checkpoints"],
    ids=["at-its-binding", "at-its-record", "at-its-acquire", "at-its-first-checkpoint"],
)
async def test_a_client_killed_while_it_starts_an_execution_loses_nothing(
    own_schema: tuple[str, str], tmp_path: Path, table: str
) -> None:
    """A client is SIGKILLed inside each write ``ainvoke`` makes to start an execution.

    The test holds a lock on ``table``, so the client's write there waits in PostgreSQL;
    once PostgreSQL shows it waiting, the test SIGKILLs the client (a crash or an OOM kill
    at that point), lets go of the lock, and a ``serve`` worker runs. Guarantee 6
    (DESIGN.md): the execution either never began (no lease: nothing to take over) or is
    taken over and ends ``done`` or ``dead_lettered`` with a reason; never a lease left
    ``running`` that no instance can resume. Its charge happened at most once, and exactly
    once if it is done.
    """
    url, schema = own_schema
    tenant = unique("start")
    key = LeaseKey(tenant, unique("x-p"))
    engine, repo, records = await chaos_database(url, schema)
    chaos = Chaos(tmp_path, url, schema, random.Random(0))
    try:
        server = await chaos.spawn()  # up before the lock: its start-up reads the tables
        await chaos.until_up(
            lambda: server.ready, time.monotonic() + STARTUP_DEADLINE, "the worker to start"
        )
        async with engine.connect() as locker:
            locker = await locker.execution_options(isolation_level="READ COMMITTED")
            async with locker.begin():
                await locker.execute(text(f"LOCK TABLE {table} IN EXCLUSIVE MODE"))
                starter = await chaos.spawn_starter(tenant, [(key, PLAIN_GRAPH)])

                async def client_waits() -> bool:
                    if starter.proc.returncode is not None:
                        raise AssertionError(f"the client exited: {tails(chaos, ['starter'])}")
                    return await blocked_on(engine, schema, table)

                await eventually(
                    client_waits,
                    timeout=STARTUP_DEADLINE,
                    what=lambda: f"the client to wait on {table}: {tails(chaos, ['starter'])}",
                )
                starter.killed = True
                starter.proc.kill()
                await starter.proc.wait()
        began = await repo.get(key)

        async def settled() -> tuple[Lease | None] | None:
            lease = await repo.get(key)
            chaos.check_crashes()
            assert not chaos.crashes, tails(chaos, chaos.crashes)
            return (lease,) if lease is None or lease.status in TERMINAL else None

        async def left() -> str:
            lease = await repo.get(key)
            assert lease is not None
            recorded = await records.get(key) is not None
            return (
                f"{key.scope_key} to end; it was left {lease.status.value} at token "
                f"{lease.epoch}, holder {lease.holder}, its {TTL} s lease long expired "
                f"(execution {'recorded' if recorded else 'NOT recorded'}): the client was "
                f"killed while it waited on {table}, and no instance took the execution over"
            )

        # TTL, a few polls, one short run
        (lease,) = await eventually(settled, timeout=15.0, interval=0.1, what=left)
        charged = (await effects(engine, key.execution_id)).get(key.execution_id, 0)
    finally:
        await chaos.shutdown()
        await engine.dispose()
    if table == "fence_checkpoints":
        assert began is not None, "the client was past its acquire: the lease must exist"
    if lease is None:
        assert charged == 0
    else:
        assert lease.status in (LeaseStatus.DONE, LeaseStatus.DEAD_LETTERED), lease
        assert lease.status is LeaseStatus.DONE or lease.reason, lease
        assert charged <= 1, charged
        assert charged == 1 or lease.status is not LeaseStatus.DONE, charged


async def test_executions_serve_cannot_run_do_not_starve_those_it_can(
    own_schema: tuple[str, str], tmp_path: Path
) -> None:
    """Executions of a graph a worker does not serve must not hide the ones it does.

    Twelve pending executions of ``payroll`` (served by some other deployment) sort first
    among the takeover candidates; one pending ``chaos_plain`` execution sorts after them. A
    ``langgraph-fence worker --concurrency 3`` serving only the chaos graphs must leave the
    twelve untouched and still run the thirteenth.
    """
    url, schema = own_schema
    engine, repo, records = await chaos_database(url, schema)
    others = [LeaseKey("a-payroll", f"run-{i:02d}") for i in range(CONCURRENCY * 4)]
    for key in others:
        await record_pending(repo, records, key, "payroll")
    mine = LeaseKey("z-shop", unique("x-p"))
    await record_pending(repo, records, mine, PLAIN_GRAPH)
    chaos = Chaos(tmp_path, url, schema, random.Random(0))
    try:
        worker = await chaos.spawn()
        await chaos.until_up(
            lambda: worker.ready, time.monotonic() + STARTUP_DEADLINE, "the worker to start"
        )
        lease = await eventually(
            lambda: ended(repo, mine),
            timeout=10.0,  # a few polls and one short run
            interval=0.1,
            what=(
                f"{mine.scope_key} to end within 10 s of a worker serving its graph: serve() "
                f"reads the takeover candidates {CONCURRENCY * 4} at a time (concurrency x 4), "
                f"oldest first, and the {len(others)} executions of a graph it does not serve "
                "fill that window on every poll"
            ),
        )
        assert lease.status is LeaseStatus.DONE, lease
        for key in others:
            left = await repo.get(key)
            assert left is not None
            assert left.status is LeaseStatus.PENDING
            assert left.epoch == 1
    finally:
        await chaos.shutdown()
        await engine.dispose()


async def test_a_refused_start_does_not_rewrite_the_record_of_a_running_execution(
    own_schema: tuple[str, str], tmp_path: Path
) -> None:
    """A second ``ainvoke`` on a held execution is refused, and must change nothing.

    Worker A (``chaos_graphs.py hold``) runs ``fence_hold`` and stays inside ``work``. A
    client (this test) calls ``ainvoke`` on the same execution with another graph name and
    input: refused with ``ExecutionLeaseHeldError``. A is then SIGKILLed; the ``serve``
    worker, which serves ``fence_hold``, must take the execution over from its own record
    and finish it, with A's input.
    """
    url, schema = own_schema
    tenant, thread = unique("tenant"), unique("thread")
    key = LeaseKey(tenant, thread)
    inside_work = tmp_path / "inside-work.json"
    engine, repo, records = await chaos_database(url, schema)
    chaos = Chaos(tmp_path, url, schema, random.Random(0), graphs="hold_graphs")
    holder: Started | None = None
    try:
        server = await chaos.spawn()
        holder = await spawn_hold(url, schema, tenant, thread, 2.0, 0.5, inside_work, tmp_path)
        await chaos.until_up(lambda: server.ready, time.monotonic() + STARTUP_DEADLINE, "serve")
        await wait_ready(holder, lambda: inside_work.exists(), timeout=STARTUP_DEADLINE)
        before = await records.get(key)
        assert before is not None, before
        assert before.graph == HOLD_GRAPH, before

        async with Instance.open(
            url, engine_options=pg_engine_options(schema), instance_id="client", lease_ttl=2.0
        ) as client:
            other = build_hold_graph(client)
            with pytest.raises(ExecutionLeaseHeldError):
                await client.ainvoke(
                    other,
                    {"log": ["another start"]},
                    {"configurable": {"thread_id": thread}},
                    tenant_id=tenant,
                    graph_name="refunds",
                )
        after = await records.get(key)
        holder.proc.kill()
        await holder.wait()
        lease = await eventually(
            lambda: ended(repo, key),
            timeout=15.0,  # TTL, a few polls, one short run
            interval=0.1,
            what=(
                f"{key.scope_key} to end after its holder died: if its record was rewritten "
                f"by the refused start from {before} to {after}, serve() looks for graph "
                f"{after and after.graph!r}"
            ),
        )
        assert after == before, "the refused start rewrote the execution's record"
        assert lease.status is LeaseStatus.DONE, lease
    finally:
        if holder is not None:
            await stop_process(holder, grace=1.0)
        await chaos.shutdown()
        await engine.dispose()

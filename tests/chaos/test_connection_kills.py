"""Never twice, never failed, never lost under killed connections: serve() workers whose
connections die every 0.5 s.

The reliability chaos of issues 20 and 9: executions of ``chaos_plain`` (prepare -> charge
-> finish, ``charge`` a plain INSERT into an external table: ``NON_IDEMPOTENT_WRITE``) and
``chaos_sink`` (the same through the exactly-once sink: ``IDEMPOTENT_WRITE``), half each, on
two worker processes on PostgreSQL, while every connection of those workers is killed
(``pg_terminate_backend``) every 0.5 s for 15 s. The first version charged one execution
twice in 2 runs of 10 (a checkpoint whose write died while the charge's writes landed on
it: the orphan writes cleared the stamp); before issue 9, 11 to 17 of 20 ended ``failed``
for good and a worker exited. Now no worker exits, no execution ends ``failed`` (a
connection error is retried within the lease window, then the run is handed back), every
one ends within the quiet period, none is charged twice, and every ``done`` one's charge
is applied exactly once. A sink execution always ends ``done``; a plain one whose charge
may have happened when its connection died is dead-lettered (at most once: never
repeated), the one outcome besides ``done`` it may have.

Only the workers' own connections are killed (tagged with an ``application_name`` of this
test's own); the shared server and everything else on it are left alone. ``LGF_CHAOS_ROUNDS``
repeats the whole run (default 1; the closing note's figure is 10).
"""

from __future__ import annotations

import asyncio
import os
import sys
import uuid
from pathlib import Path
from typing import Any

import pytest
from sqlalchemy import text

from langgraph_fence import LeaseKey, LeaseStatus, SqlLeaseRepository
from langgraph_fence.database import create_engine
from langgraph_fence.lease.records import SqlExecutionRecords
from tests.support.chaos_graphs import CREATE_EFFECTS, PLAIN_GRAPH, SINK_GRAPH
from tests.support.chaos_serve import effects, record_pending, statuses
from tests.support.databases import pg_engine_options, setup_all, unique
from tests.support.polling import eventually

pytestmark = [pytest.mark.chaos, pytest.mark.postgres]

ROOT = Path(__file__).parents[2]
EXECUTIONS = 20
WORKERS = 2
KILL_EVERY = 0.5
KILL_FOR = 15.0
QUIET_DEADLINE = 60.0
STARTUP_DEADLINE = 60.0  # two processes importing LangGraph on a busy 2-core box
TTL = 1.5
ROUNDS = int(os.environ.get("LGF_CHAOS_ROUNDS", "1"))
TENANT = "conn-kills"


async def one_round(
    url: str, schema: str, directory: Path
) -> tuple[dict[str, tuple[str, int, str, str | None]], int, list[int | None]]:
    """One run of the chaos: each execution's (status, charges, graph, reason), connections
    killed, and the exit code of each worker that exited during it (none: all served)."""
    tag = f"lgf-kill-{uuid.uuid4().hex[:8]}"
    engine = create_engine(url, **pg_engine_options(schema))
    procs: list[asyncio.subprocess.Process] = []
    try:
        await setup_all(engine)
        async with engine.begin() as conn:
            await conn.execute(text(CREATE_EFFECTS))
        repo = SqlLeaseRepository(engine)
        records = SqlExecutionRecords(engine)
        prefix = unique("ck")
        keys = [LeaseKey(TENANT, f"{prefix}-{i:02d}") for i in range(EXECUTIONS)]
        graph_of = {k.execution_id: (PLAIN_GRAPH, SINK_GRAPH)[i % 2] for i, k in enumerate(keys)}

        async def start_worker(n: int) -> asyncio.subprocess.Process:
            log = os.open(directory / f"{tag}-{n}.log", os.O_WRONLY | os.O_CREAT, 0o644)
            try:
                return await asyncio.create_subprocess_exec(
                    sys.executable,
                    "-m",
                    "tests.support.chaos_graphs",
                    "serve",
                    url,
                    schema,
                    tag,
                    str(TTL),
                    "0.2",
                    cwd=ROOT,
                    stdout=log,
                    stderr=log,
                )
            finally:
                os.close(log)

        for n in range(WORKERS):
            procs.append(await start_worker(n))
        kill = text(
            "SELECT count(pg_terminate_backend(pid)) FROM pg_stat_activity"
            " WHERE application_name = :tag AND pid <> pg_backend_pid()"
        )
        logs = [directory / f"{tag}-{n}.log" for n in range(WORKERS)]

        async def serving() -> bool | None:
            up = all(log.exists() and "serving" in log.read_text() for log in logs)
            return True if up else None

        await eventually(serving, timeout=STARTUP_DEADLINE, what="the workers to serve")
        killed = 0
        exits: list[int | None] = []
        loop = asyncio.get_running_loop()
        end = loop.time() + KILL_FOR
        while loop.time() < end:
            # Executions arrive while connections die: two per kill until all are in.
            for key in keys[:2]:
                await record_pending(repo, records, key, graph_of[key.execution_id])
            keys = keys[2:]
            await asyncio.sleep(KILL_EVERY)  # the fault's own rhythm, not a wait for a state
            async with engine.connect() as conn:
                killed += int((await conn.execute(kill, {"tag": tag})).scalar_one())
            exits.extend(p.returncode for p in procs if p.returncode is not None)
            if exits:
                break  # a worker exited: the test fails on it

        # Quiet: the workers finish what they can; every execution reaches an end.
        ended = {LeaseStatus.DONE.value, LeaseStatus.DEAD_LETTERED.value, LeaseStatus.FAILED.value}
        rows: list[Any] = []

        async def quiet() -> bool:
            rows[:] = [r for r in await statuses(engine, TENANT) if r[0].startswith(prefix)]
            exits.extend(p.returncode for p in procs if p.returncode is not None)
            return bool(exits) or (len(rows) == EXECUTIONS and all(r[1] in ended for r in rows))

        await eventually(
            quiet,
            timeout=QUIET_DEADLINE,
            interval=0.1,
            what=lambda: f"the executions to end in the quiet period; still: {rows}",
        )
        charges = await effects(engine, prefix)
        assert killed > 0, "no connection was killed: the chaos did not happen"
        outcome = {r[0]: (r[1], charges.get(r[0], 0), graph_of[r[0]], r[3]) for r in rows}
        return outcome, killed, exits
    finally:
        for proc in procs:
            if proc.returncode is None:
                proc.kill()
                await proc.wait()
        await engine.dispose()


async def test_killed_connections_fail_lose_and_charge_twice_nothing(
    own_schema: tuple[str, str], tmp_path: Path
) -> None:
    url, schema = own_schema
    for round_ in range(ROUNDS):
        outcome, killed, exits = await one_round(url, schema, tmp_path)
        assert not exits, f"round {round_}: a worker exited (codes {exits}); logs in {tmp_path}"
        assert len(outcome) == EXECUTIONS, f"round {round_}: executions lost: {outcome}"
        twice = {e: o for e, o in outcome.items() if o[1] > 1}
        assert not twice, f"round {round_}: charged more than once: {twice}"
        failed = {e: o for e, o in outcome.items() if o[0] == LeaseStatus.FAILED.value}
        assert not failed, f"round {round_}: infrastructure errors ended runs failed: {failed}"
        for execution_id, (status, charges, graph, reason) in outcome.items():
            if status == LeaseStatus.DONE.value:
                assert charges == 1, (round_, execution_id, status, charges)
            else:
                # Only a plain charge whose connection died mid-write is dead-lettered.
                assert graph == PLAIN_GRAPH, (round_, execution_id, status, reason)
                assert status == LeaseStatus.DEAD_LETTERED.value, (execution_id, status)
        counts: dict[str, int] = {}
        for status, *_ in outcome.values():
            counts[status] = counts.get(status, 0) + 1
        print(
            f"connection kills round {round_}: {killed} connections killed, no worker exited,"
            f" executions {counts}, none failed, none charged twice"
        )

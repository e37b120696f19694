"""Chaos on real PostgreSQL: submitted runs over two ``langgraph-fence worker`` processes,
one SIGKILLed while it runs some of them (issue 17).

A client submits ``COUNT`` runs of ``chaos_plain`` (``chaos_graphs.py``: its ``charge``
appends one row per execution to ``chaos_effects`` with a plain INSERT, a
``NON_IDEMPOTENT_WRITE``). Two workers claim them; once the first one holds runs, it is
SIGKILLed. Then every run ends ``done`` or ``dead_lettered`` (none lost, none ``failed``,
none still pending or running), no execution charged more than once, every ``done`` one
exactly once and with its output; and the kill hit a run past its charge (in ``finish``),
which the survivor takes over and finishes without charging again (its input is not run
again: the claim pinned the checkpoint it follows).

Bounded: two worker processes, ``COUNT`` runs, deadlines on every wait; every child is
killed in ``finally``.
"""

from __future__ import annotations

import os
import signal
from pathlib import Path

import pytest
from sqlalchemy import text

from langgraph_fence import LeaseStatus
from langgraph_fence.instance import Instance
from tests.support.chaos_graphs import CREATE_EFFECTS, PLAIN_GRAPH, build_chaos_graph
from tests.support.databases import pg_engine_options, unique
from tests.support.polling import eventually
from tests.support.processes import start_worker, stop_process

pytestmark = [pytest.mark.chaos, pytest.mark.postgres]

GRAPHS = "tests.support.chaos_graphs:chaos_graphs"
COUNT = 40
TTL = 1.5
STARTUP_DEADLINE = 45.0
END_DEADLINE = 60.0
ENDED = {LeaseStatus.DONE, LeaseStatus.DEAD_LETTERED, LeaseStatus.FAILED}


async def test_a_killed_worker_loses_no_submitted_run_and_repeats_no_charge(
    own_schema: tuple[str, str], tmp_path: Path
) -> None:
    url, schema = own_schema
    tenant = unique("chaos")
    async with Instance.open(
        url, engine_options=pg_engine_options(schema), instance_id=unique("client")
    ) as client:
        engine = client._run_queue()._engine
        async with engine.connect() as conn:
            await conn.execute(text(CREATE_EFFECTS))
        runs = [
            await client.submit(
                PLAIN_GRAPH,
                {"log": []},
                {"configurable": {"thread_id": unique("r")}},
                tenant_id=tenant,
            )
            for _ in range(COUNT)
        ]
        queue = client._run_queue()
        victim_name, survivor_name = unique("victim"), unique("survivor")
        workers = []
        try:
            victim = await start_worker(
                tmp_path, "victim", url, schema, GRAPHS, ttl=TTL, poll=0.1,
                instance_id=victim_name, extra=["--concurrency", "4"], wait=False,
            )  # fmt: skip
            workers.append(victim)

            graph = build_chaos_graph(client, PLAIN_GRAPH)  # to read the threads' state
            threads = {run.key.execution_id: run for run in runs}

            async def victim_past_a_charge() -> str | None:
                # A run the victim holds whose charge's checkpoint landed: it is in finish.
                for held in await queue.runs():
                    if held.holder != victim_name or held.thread_id is None:
                        continue
                    config = {"configurable": {"thread_id": held.thread_id, "tenant_id": tenant}}
                    log = (await graph.aget_state(config)).values.get("log", [])
                    if any(entry.startswith("charge@") for entry in log):
                        return held.key.execution_id
                return None

            past_charge = await eventually(
                victim_past_a_charge, timeout=STARTUP_DEADLINE, what="a victim's run past charge"
            )
            assert past_charge in threads
            survivor = await start_worker(
                tmp_path, "survivor", url, schema, GRAPHS, ttl=TTL, poll=0.1,
                instance_id=survivor_name, extra=["--concurrency", "4"], wait=False,
            )  # fmt: skip
            workers.append(survivor)
            os.kill(victim.pid, signal.SIGKILL)
            await victim.wait()

            async def all_ended() -> bool | None:
                states = [await run.state() for run in runs]
                return True if all(s.status in ENDED for s in states) else None

            await eventually(all_ended, timeout=END_DEADLINE, what="every submitted run's end")
        finally:
            for started in workers:
                await stop_process(started, grace=10)
        async with engine.connect() as conn:
            charges = dict(
                (row.execution_id, int(row.n))
                for row in await conn.execute(
                    text("SELECT execution_id, count(*) AS n FROM chaos_effects GROUP BY 1")
                )
            )
        states = {run.key.execution_id: await run.state() for run in runs}
        statuses = [s.status for s in states.values()]
        assert LeaseStatus.FAILED not in statuses, workers[-1].post_mortem()
        assert all(n <= 1 for n in charges.values()), charges  # never past a standing stamp
        for execution_id, state in states.items():
            if state.status is LeaseStatus.DONE:
                assert charges.get(execution_id) == 1, execution_id
        done = [run for run in runs if states[run.key.execution_id].status is LeaseStatus.DONE]
        assert done, statuses
        output = await done[0].result(timeout=5)
        assert any(entry.startswith("charge@") for entry in output["log"])
        # The kill hit a run past its charge: the survivor took it over at a later token and
        # finished it without charging again.
        assert states[past_charge].epoch >= 2
        assert states[past_charge].status is LeaseStatus.DONE
        assert charges.get(past_charge) == 1

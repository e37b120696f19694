"""Chaos on real PostgreSQL: a parent in one worker process waits for ANY_INSTANCE children
run by another; both are SIGKILLed mid-wait / mid-child (issue 11).

A client submits one ``fan`` run (``children_graphs.py``) with three items. Worker P serves
``fan``: it claims the run and spawns three ``tally`` children; worker C serves ``tally``
and runs them, each held in its node. Then C is SIGKILLed mid-child and P mid-wait, and two
fresh workers (one per graph) are started. The children are released: the new child worker
takes each child over (a later token), the new parent worker takes the tree over and its
re-run of ``fan_out`` finds the three children (none spawned again) and completes with
their outputs (the killed parent had yielded the root lease while it waited: the last
child's end wakes the tree, and the new parent worker takes it one TTL later). Nothing
hangs: every wait has a deadline.

Bounded: four worker processes, one run, three children; every process is killed in
``finally``.
"""

from __future__ import annotations

import signal
from pathlib import Path

import pytest
from sqlalchemy import text

from langgraph_fence import LeaseKey, LeaseStatus
from langgraph_fence.execution.children import child_execution_id
from langgraph_fence.instance import Instance
from langgraph_fence.lease.transitions import is_yielded
from tests.support.children_graphs import CREATE_TABLES, FAN
from tests.support.databases import pg_engine_options, unique
from tests.support.polling import eventually
from tests.support.processes import Started, start_worker

pytestmark = [pytest.mark.chaos, pytest.mark.postgres]

GRAPHS = "tests.support.children_graphs"
DEADLINE = 60.0
TTL = 1.5
ITEMS = ["a", "b", "c"]


async def test_killed_child_worker_and_killed_waiting_parent_still_finish_the_tree(
    own_schema: tuple[str, str], tmp_path: Path
) -> None:
    url, schema = own_schema
    tenant = unique("chaos")
    thread = unique("fan")
    async with Instance.open(
        url, engine_options=pg_engine_options(schema), instance_id=unique("client")
    ) as client:
        queue = client._run_queue()
        engine = queue._engine
        async with engine.begin() as conn:
            for statement in CREATE_TABLES:
                await conn.execute(text(statement))
        run = await client.submit(
            FAN, {"items": ITEMS}, {"configurable": {"thread_id": thread}}, tenant_id=tenant
        )
        root = LeaseKey(tenant, thread)
        children = [LeaseKey(tenant, child_execution_id(root, f"c{i}")) for i in range(3)]
        names = {role: unique(role) for role in ("parent", "child", "parent2", "child2")}
        workers: dict[str, Started] = {}
        try:
            for role, factory in (("parent", "fan_graphs"), ("child", "child_graphs")):
                workers[role] = await start_worker(
                    tmp_path, role, url, schema, f"{GRAPHS}:{factory}", ttl=TTL, poll=0.1,
                    instance_id=names[role], extra=["--concurrency", "4"], wait=False,
                )  # fmt: skip

            async def started_by(pid: int) -> int | None:
                async with engine.connect() as conn:
                    found = await conn.execute(
                        text(
                            "SELECT count(DISTINCT execution_id) FROM chaos_children "
                            "WHERE pid = :pid"
                        ),
                        {"pid": pid},
                    )
                    n = int(found.scalar_one())
                return n if n == len(ITEMS) else None

            # Every child is inside its node on the child worker; the parent waits for them.
            await eventually(
                lambda: started_by(workers["child"].pid),
                timeout=DEADLINE,
                what="the three children running on the child worker",
            )

            # Only the wait runs on the parent worker: it has yielded the root lease
            # (waiting, its holder kept); killed so, it is woken once the children end.
            async def yielded() -> bool:
                state = await run.state()
                return is_yielded(state.status, state.holder)

            await eventually(yielded, timeout=DEADLINE, what="the parent to yield its lease")
            assert (await run.state()).holder == names["parent"]
            for role in ("child", "parent"):
                workers[role].proc.send_signal(signal.SIGKILL)
                await workers[role].wait()
            for role, factory in (("parent2", "fan_graphs"), ("child2", "child_graphs")):
                workers[role] = await start_worker(
                    tmp_path, role, url, schema, f"{GRAPHS}:{factory}", ttl=TTL, poll=0.1,
                    instance_id=names[role], extra=["--concurrency", "4"], wait=False,
                )  # fmt: skip
            async with engine.begin() as conn:
                await conn.execute(text("INSERT INTO chaos_release VALUES (TRUE)"))
            output = await run.result(timeout=DEADLINE)
        finally:
            for worker in workers.values():
                if worker.returncode is None:
                    worker.proc.kill()
                    await worker.wait()
        assert output["results"] == ["A", "B", "C"], workers["parent2"].said()
        final = await run.state()
        assert final.status is LeaseStatus.DONE
        assert final.epoch >= 2  # the tree was taken over
        # Three children, spawned once: each key once, each taken over by the new worker.
        async with engine.connect() as conn:
            rows = await conn.execute(
                text(
                    "SELECT execution_id, status, epoch FROM fence_leases "
                    "WHERE tenant_id = :t AND execution_id <> :root ORDER BY execution_id"
                ),
                {"t": tenant, "root": thread},
            )
            leases = [(r.execution_id, r.status, int(r.epoch)) for r in rows]
        assert [lease[0] for lease in leases] == [child.execution_id for child in children]
        assert all(status == "done" and epoch >= 2 for _, status, epoch in leases), leases

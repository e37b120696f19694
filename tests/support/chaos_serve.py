"""The serve-chaos harness: worker processes started, SIGSTOPped, killed and replaced
(:class:`Chaos`), executions recorded for them, and what they left (statuses, effects,
rows)."""

from __future__ import annotations

import asyncio
import os
import random
import signal
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from sqlalchemy import text
from sqlalchemy.ext.asyncio import AsyncEngine

from langgraph_fence import (
    LeaseKey,
    LeaseStatus,
    SqlLeaseRepository,
)
from langgraph_fence.lease.records import ExecutionRecord, SqlExecutionRecords
from tests.support.polling import eventually
from tests.support.processes import start_process, start_worker

STARTUP_DEADLINE = 45.0  # for the first two servers to come up (imports, on a busy box)


@dataclass
class Chaos:
    root: Path
    url: str
    schema: str
    rng: random.Random
    graphs: str = "chaos_graphs"  # the factory in chaos_graphs.py the servers serve
    env: dict[str, str] = field(default_factory=dict)  # of every worker and client
    worker_env: dict[str, str] = field(default_factory=dict)  # of the servers only
    aimed: int = 0  # servers that SIGKILLed themselves at an aimed fault point
    to_replace: int = 0
    workers: list[Worker] = field(default_factory=list)
    spawned: int = 0
    kills: int = 0
    stops: int = 0
    crashes: list[str] = field(default_factory=list)

    async def spawn(self) -> Worker:
        self.spawned += 1
        name = f"w{self.spawned}"
        started = await start_worker(
            self.root,
            name,
            self.url,
            self.schema,
            f"tests.support.chaos_graphs:{self.graphs}",
            ttl=TTL,
            poll=POLL,
            extra=["--concurrency", str(CONCURRENCY)],
            verbose=True,
            wait=False,
            env={**self.env, **self.worker_env},
        )
        worker = Worker(name, started.proc, started.out, started.err)
        self.workers.append(worker)
        return worker

    async def spawn_starter(self, tenant: str, jobs: list[tuple[LeaseKey, str]]) -> Worker:
        """A client process that starts ``jobs`` with ``Instance.ainvoke``, 4 at a time."""
        ids = self.root / "starter.ids"
        ids.write_text("".join(f"{graph} {key.execution_id}\n" for key, graph in jobs))
        args = ["-m", "tests.support.chaos_graphs", "start", self.url, self.schema, tenant]
        started = await start_process(
            [*args, str(TTL), str(ids), "4"], self.root, "starter", env=self.env
        )
        worker = Worker("starter", started.proc, started.out, started.err, kind="starter")
        self.workers.append(worker)
        return worker

    async def replace_killed(self) -> None:
        """Start a server for each that killed itself (aimed), while room remains."""
        while self.to_replace and len(self.alive()) < MAX_ALIVE:
            self.to_replace -= 1
            await self.spawn()

    async def until_up(self, ready: Callable[[], bool], deadline: float, what: str) -> None:
        """Until ``ready()`` holds (the workers' readiness refreshed before each look); a
        worker that crashes first fails the wait at once, with its stderr."""

        def up() -> bool:
            self.update_ready()
            self.check_crashes()
            if self.crashes:
                raise AssertionError(f"{what}: crashed first: {tails(self, self.crashes)}")
            return ready()

        await eventually(up, deadline=deadline, interval=0.05, what=what)

    def alive(self) -> list[Worker]:
        return [w for w in self.workers if w.proc.returncode is None and not w.killed]

    def update_ready(self) -> None:
        for worker in self.alive():
            if not worker.ready and worker.out.exists():
                said = worker.out.read_text(errors="replace")
                worker.ready = ("serves" if worker.kind == "serve" else "ready") in said

    def ready_servers(self) -> list[Worker]:
        return [w for w in self.alive() if w.ready and w.kind == "serve"]

    def check_crashes(self) -> None:
        for worker in self.workers:
            code = worker.proc.returncode
            finished = worker.kind == "starter" and code == 0
            if code == -signal.SIGKILL and self.worker_env and worker.kind == "serve":
                if not worker.killed:  # an aimed kill: it killed itself, as planned
                    worker.killed = True
                    self.aimed += 1
                    self.to_replace += 1
                continue
            crashed = code is not None and not worker.killed and not finished
            if crashed and worker.name not in self.crashes:
                self.crashes.append(worker.name)

    async def act(self, now: float) -> bool:
        """One random act of chaos: freeze one worker past its lease, or kill one.

        Only workers that are up (serving, or starting executions) are hit, and only while
        at least two servers are up and not frozen, so that the chaos lands inside runs;
        returns ``False`` when that is not so yet. The first act freezes, the second kills:
        every run has both, however few acts a slow machine leaves room for.
        """
        up = [w for w in self.alive() if w.ready and w.stopped_until is None]
        if sum(1 for w in up if w.kind == "serve") < 2:
            return False
        choice = self.rng.random()
        if self.stops == 0:
            choice = 0.0
        elif self.kills == 0:
            choice = 0.6
        if choice < 0.5:
            victim = self.rng.choice(up)
            os.kill(victim.proc.pid, signal.SIGSTOP)
            victim.stopped_until = now + TTL + self.rng.uniform(0.3, 1.5)
            self.stops += 1
        elif choice < 0.85:
            victim = self.rng.choice(up)
            victim.killed = True
            victim.proc.kill()
            await victim.proc.wait()
            self.kills += 1
            await self.spawn()  # a new one starts while the others work
        return True

    def continue_due(self, now: float, *, all_of_them: bool = False) -> None:
        for worker in self.alive():
            if worker.stopped_until is not None and (all_of_them or worker.stopped_until <= now):
                os.kill(worker.proc.pid, signal.SIGCONT)
                worker.stopped_until = None

    async def shutdown(self) -> dict[str, int | None]:
        """SIGCONT + SIGTERM every worker; SIGKILL what has not stopped in 10 s.

        Returns the exit code of every server that was serving (one still importing when
        SIGTERM came has no handler yet and holds nothing: it just dies).
        """
        self.update_ready()
        codes: dict[str, int | None] = {}
        for worker in self.workers:
            if worker.proc.returncode is None:
                try:
                    os.kill(worker.proc.pid, signal.SIGCONT)
                    worker.proc.terminate()
                except ProcessLookupError:
                    pass
        for worker in self.workers:
            try:
                await asyncio.wait_for(worker.proc.wait(), 10.0)
            except TimeoutError:
                worker.proc.kill()
                await worker.proc.wait()
                codes[worker.name] = None
                continue
            if not worker.killed and worker.kind == "serve" and worker.ready:
                codes[worker.name] = worker.proc.returncode
        return codes


async def record_pending(
    repo: SqlLeaseRepository, records: SqlExecutionRecords, key: LeaseKey, graph: str
) -> None:
    """An execution no instance holds yet: recorded, then handed back for any to take."""
    lease = await repo.acquire(key, "chaos-test", 30.0)
    assert lease is not None, key
    await records.record(ExecutionRecord(key, graph, key.execution_id, {"log": []}))
    await repo.release(lease, LeaseStatus.PENDING)


async def statuses(engine: AsyncEngine, tenant: str) -> list[tuple[str, str, int, str | None]]:
    async with engine.connect() as conn:
        rows = (
            await conn.execute(
                text(
                    "SELECT execution_id, status, epoch, reason FROM fence_leases"
                    " WHERE tenant_id = :t ORDER BY execution_id"
                ),
                {"t": tenant},
            )
        ).all()
    return [(r[0], r[1], int(r[2]), r[3]) for r in rows]


async def effects(engine: AsyncEngine, prefix: str) -> Counter[str]:
    async with engine.connect() as conn:
        rows = (
            await conn.execute(
                text(
                    "SELECT execution_id, count(*) FROM chaos_effects"
                    " WHERE execution_id LIKE :p GROUP BY execution_id"
                ),
                {"p": f"{prefix}%"},
            )
        ).all()
    return Counter({r[0]: int(r[1]) for r in rows})


async def rows_of(engine: AsyncEngine, thread: str) -> tuple[list[Any], list[Any]]:
    """Every checkpoint and write row of ``thread``, with the token each was written under."""
    async with engine.connect() as conn:
        checkpoints = (
            await conn.execute(
                text(
                    "SELECT checkpoint_ns, checkpoint_id, parent_checkpoint_id, fence_token"
                    " FROM fence_checkpoints WHERE thread_id = :t"
                    " ORDER BY checkpoint_ns, checkpoint_id"
                ),
                {"t": thread},
            )
        ).all()
        writes = (
            await conn.execute(
                text(
                    "SELECT checkpoint_ns, checkpoint_id, task_id, idx, channel, fence_token"
                    " FROM fence_checkpoint_writes WHERE thread_id = :t"
                    " ORDER BY checkpoint_ns, checkpoint_id, task_id, idx"
                ),
                {"t": thread},
            )
        ).all()
    return [tuple(r) for r in checkpoints], [tuple(r) for r in writes]


TTL = 1.5


POLL = 0.2


CONCURRENCY = 3


MAX_ALIVE = 4


@dataclass(eq=False)
class Worker:
    name: str
    proc: asyncio.subprocess.Process
    out: Path
    err: Path
    kind: str = "serve"  # or "starter": a client calling Instance.ainvoke
    stopped_until: float | None = None
    killed: bool = False
    adopted: bool = False
    ready: bool = False  # it said so on stdout: serving, or starting executions


def tails(chaos: Chaos, names: list[str]) -> str:
    parts = []
    for worker in chaos.workers:
        if worker.name in names:
            text_ = worker.err.read_text(errors="replace") if worker.err.exists() else ""
            parts.append(f"--- {worker.name} (exit {worker.proc.returncode}):\n{text_[-2500:]}")
    return "\n".join(parts)

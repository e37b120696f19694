"""A worker SIGKILLed mid-write after a human's approval never repeats the write.

Each of LangGraph's human-in-the-loop patterns (``tests/support/approvals.py``) runs here up to
its approval; a worker process then resumes it approved and dies by SIGKILL right after its
write (the line is on disk, the step has not returned). An instance in this process takes
the execution over once the dead worker's lease lapses: the write's stamp stands, so the
execution is dead-lettered, never resumed into a second write. The operator abandons it,
and the thread takes new input again.
"""

from __future__ import annotations

import asyncio
import signal
import sys
from pathlib import Path
from typing import Any

import pytest

from langgraph_fence import Instance, LeaseKey, LeaseStatus
from tests.support.approvals import (
    AGENTS,
    PATTERNS,
    build,
    effects_of,
    first_input,
    graph_name,
)
from tests.support.databases import unique
from tests.support.polling import eventually
from tests.support.write_steps import ROOT, Database, engine_options

pytestmark = pytest.mark.chaos

TTL = 3.0  # the doomed worker must reach its write before a late renewal lapses it
DEADLINE = 60.0
TENANT = "acme"
ENDED = (LeaseStatus.DONE, LeaseStatus.DEAD_LETTERED, LeaseStatus.FAILED)


async def _doomed(database: Database, pattern: str, thread: str, directory: Path) -> int:
    """The worker that resumes ``thread`` approved; its exit code."""
    log = directory / f"doomed-{pattern}.log"
    with log.open("wb") as out:
        proc = await asyncio.create_subprocess_exec(
            sys.executable,
            "-m",
            "tests.support.approvals",
            database.url,
            database.schema or "-",
            TENANT,
            pattern,
            thread,
            str(directory),
            str(TTL),
            cwd=ROOT,
            stdout=out,
            stderr=out,
        )
        code = await asyncio.wait_for(proc.wait(), DEADLINE)
    assert code == -signal.SIGKILL, f"{pattern}: exited {code}\n{log.read_text()[-3000:]}"
    return code


@pytest.mark.parametrize("pattern", PATTERNS)
async def test_a_worker_killed_mid_write_after_the_approval_never_repeats_it(
    database: Database, pattern: str, tmp_path: Path
) -> None:
    (tmp_path / "effects").mkdir()
    write = "send_email" if pattern in AGENTS else "charge"
    thread = unique(pattern)
    config: Any = {"configurable": {"thread_id": thread}}
    options = engine_options(database.url, database.schema)
    async with Instance.open(database.url, engine_options=options, lease_ttl=TTL) as first:
        graph = build(first, pattern, tmp_path)
        await first.ainvoke(graph, first_input(pattern), config, tenant_id=TENANT)
    assert effects_of(tmp_path, thread) == []

    await _doomed(database, pattern, thread, tmp_path)
    assert effects_of(tmp_path, thread) == [write]

    key = LeaseKey(TENANT, thread)
    async with Instance.open(
        database.url, engine_options=options, instance_id="taker", lease_ttl=TTL
    ) as taker:
        graph = build(taker, pattern, tmp_path)
        stop = asyncio.Event()
        serving = asyncio.create_task(
            taker.serve(
                {graph_name(pattern): graph}, poll_interval=0.05, stop=stop, handle_signals=False
            )
        )

        async def ended() -> Any:
            lease = await taker.repository.get(key)
            return lease if lease is not None and lease.status in ENDED else None

        try:
            lease = await eventually(ended, timeout=DEADLINE, what="the takeover to end")
        finally:
            stop.set()
            await asyncio.wait_for(serving, 30)
        assert lease.status is LeaseStatus.DEAD_LETTERED, lease
        assert lease.reason is not None
        assert "non-idempotent" in lease.reason, lease.reason
        assert effects_of(tmp_path, thread) == [write]  # never repeated

        # The operator settles it; the thread then takes new input (up to its approval).
        await taker.repository.abandon(key, "refunded by hand")
        await taker.ainvoke(graph, first_input(pattern), config, tenant_id=TENANT)
        assert effects_of(tmp_path, thread) == [write]
        settled = await taker.repository.get(key)
        assert settled is not None
        assert settled.status in (LeaseStatus.WAITING, LeaseStatus.DONE), settled

"""A submitted run's stream read from another process through an interrupt and a SIGKILL
(issue 37), on real PostgreSQL with ``langgraph-fence worker`` processes.

A thread's first run (to its interrupt) and its resume are submitted recording their
streams. The resume's first ``charge`` holds its worker (``stream_graphs``); that worker is
SIGKILLed there, a second worker takes the run over after the lease's TTL and finishes it.
This process, which ran neither, reads both streams while the resume runs and after: each
equals the in-process ``astream`` of the same runs, event for event (interrupt ids aside).
"""

from __future__ import annotations

import asyncio
import os
import signal
from pathlib import Path
from typing import Any

import pytest
from langgraph.types import Command

from langgraph_fence import LeaseStatus
from langgraph_fence.instance import Instance
from tests.support.databases import pg_engine_options, unique
from tests.support.polling import eventually
from tests.support.processes import start_worker, stop_process
from tests.support.serving import cfg
from tests.support.stream_graphs import HOLD_DIR_ENV, MODES, orders, plain

pytestmark = [pytest.mark.chaos, pytest.mark.postgres]

GRAPHS = "tests.support.stream_graphs:stream_graphs"
TTL = 1.5


async def test_a_stream_read_elsewhere_through_an_interrupt_and_a_sigkill(
    own_schema: tuple[str, str], tmp_path: Path
) -> None:
    url, schema = own_schema
    holds = tmp_path / "holds"
    holds.mkdir()
    env = {HOLD_DIR_ENV: str(holds)}
    async with Instance.open(
        url, engine_options=pg_engine_options(schema), instance_id=unique("client")
    ) as client:
        reference = cfg(unique("reference"))
        graph = orders(client)
        expected = [
            plain([e async for e in graph.astream(given, reference, stream_mode=MODES)])
            for given in ({"item": "book"}, Command(resume="yes"))
        ]
        thread = unique("t")
        workers = []
        try:
            victim = await start_worker(
                tmp_path, "victim", url, schema, GRAPHS, ttl=TTL, poll=0.1, env=env
            )
            workers.append(victim)
            first = await client.submit(
                "orders", {"item": "book"}, cfg(thread), tenant_id="a", stream_mode=MODES
            )
            assert plain([e async for e in first.astream()]) == expected[0]
            assert (await first.state()).status is LeaseStatus.WAITING
            resumed = await client.submit(
                "orders", Command(resume="yes"), cfg(thread), tenant_id="a", stream_mode=MODES
            )
            live = asyncio.create_task(_read(resumed))
            await eventually(
                lambda: (holds / f"{thread}.held").exists(), timeout=60, what="the held charge"
            )
            os.kill(victim.proc.pid, signal.SIGKILL)
            await victim.proc.wait()
            survivor = await start_worker(
                tmp_path, "survivor", url, schema, GRAPHS, ttl=TTL, poll=0.1, env=env
            )
            workers.append(survivor)
            assert await asyncio.wait_for(live, 90) == expected[1]
            state = await resumed.state()
            assert (state.status, state.epoch > 1) == (LeaseStatus.DONE, True)  # taken over
            assert plain([e async for e in resumed.astream()]) == expected[1]
        finally:
            for worker in workers:
                await stop_process(worker, grace=5)


async def _read(run: Any) -> list[Any]:
    return plain([e async for e in run.astream(poll_interval=0.05)])

"""Review reproducers (issue 37, flow keys). Each test states what the docs promise and
fails on 1826fbd."""

from __future__ import annotations

import asyncio
from typing import Any

from sqlalchemy import text

from langgraph_fence import LeaseKey, LeaseStatus
from langgraph_fence.queue import Flow
from langgraph_fence.testing import Leases
from tests.support.databases import unique
from tests.support.serving import cfg, look, stepped
from tests.support.shout import Work, build


async def submit(client: Any, text_: str, flow: Flow, thread: str | None = None, **kw: Any) -> Any:
    return await client.submit(
        "shout", {"text": text_}, cfg(thread or unique("t")), tenant_id="a", flow=flow, **kw
    )


async def test_review_a_delayed_keyed_run_does_not_hold_the_keys_only_slot_until_its_time(
    leases: Leases,
) -> None:
    """flow + not_before: the delayed run is admitted first (oldest), then counts as
    'running' (admitted pending) for its whole delay: the key's other runs wait an hour."""
    client, worker = leases.instance("client"), leases.instance("worker")
    work = Work()
    loop = stepped(worker, {"shout": build(worker, work)}, concurrency=10)
    one = Flow("k", max_running=1)
    later = await submit(client, "later", one, not_before=3600)
    now = await submit(client, "now", one)
    await look(loop)
    await look(loop)
    await look(loop)
    assert [t for _, t in work.started] == ["now"], (
        f"started {work.started}; later={await later.state()}, now={await now.state()}"
    )


async def test_review_resolve_retry_of_a_keyed_run_goes_through_admission(
    leases: Leases,
) -> None:
    """A keyed run that failed and is retried by an operator (resolve --retry) becomes
    pending with expires_at NULL: takeable at once, never admitted, so max_running=1 runs 2."""
    client, worker = leases.instance("client"), leases.instance("worker")
    work = Work()
    work.gates["b"] = asyncio.Event()
    loop = stepped(worker, {"shout": build(worker, work)}, concurrency=10)
    one = Flow("k", max_running=1)
    a = await submit(client, "a", one)
    # a fails at once (an operator dead-letters it, e.g. by a failover quarantine)
    async with leases.engine.begin() as conn:
        await conn.execute(
            text(
                "UPDATE fence_leases SET status = 'dead_lettered', expires_at = NULL "
                "WHERE execution_id = :e"
            ),
            {"e": a.key.execution_id},
        )
    b = await submit(client, "b", one)
    await loop.poll_once()
    await asyncio.wait_for(work.entered.setdefault("b", asyncio.Event()).wait(), 10)
    await leases.store.retry(a.key)  # langgraph-fence resolve --retry
    await loop.poll_once()
    await asyncio.sleep(0.5)
    running = sorted(t for _, t in work.started)
    work.gates["b"].set()
    await asyncio.gather(*loop.running)
    assert running == ["b"], f"max_running=1 but started {running}"


async def test_review_a_direct_ainvoke_does_not_erase_a_keyed_runs_start(
    leases: Leases,
) -> None:
    """max_starts=1 per 60 s. A keyed run starts and ends on thread T; an ainvoke of T's
    graph (allowed: the thread is not busy) rewrites the record, clearing started_at; the
    keyed run's row is still 'current' with no start of its own, so its start is forgotten
    and a second keyed run starts inside the window."""
    client, worker = leases.instance("client"), leases.instance("worker")
    work = Work()
    graph = build(worker, work)
    loop = stepped(worker, {"shout": graph}, concurrency=10)
    rate = Flow("api", max_starts=1, per=60.0)
    thread = unique("t")
    first = await submit(client, "first", rate, thread=thread)
    await look(loop)
    assert (await first.state()).status is LeaseStatus.DONE
    await worker.ainvoke(graph, {"text": "direct"}, cfg(thread), tenant_id="a", graph_name="shout")
    leases.advance(1.0)
    second = await submit(client, "second", rate)
    await look(loop)
    await look(loop)
    keyed = [t for _, t in work.started if t != "direct"]
    assert keyed == ["first"], f"max_starts=1 per 60 s but started {keyed} within 1 s"
    del second

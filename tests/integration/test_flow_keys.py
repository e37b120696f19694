"""Flow keys (issue 37): ``submit(..., flow=Flow(key, max_running=..., max_starts=...,
per=...))`` admits a key's runs only under its limits, whichever worker looks, on the
store's clock (the ``leases`` fixture's ManualClock); other keys are not held back; bad
limits are refused. The multi-process proof (three workers, sampled every 10 ms) is
``tests/chaos/test_flow_keys_chaos.py``."""

from __future__ import annotations

import asyncio
import re
from typing import Any

import pytest
from sqlalchemy import text

from langgraph_fence import Instance, LeaseStatus
from langgraph_fence.queue import Flow, list_runs
from langgraph_fence.testing import Leases
from tests.support.databases import Database, unique
from tests.support.serving import cfg, look, opened, stepped
from tests.support.shout import SUBMIT_TABLES, Work, build, rows


async def running(leases: Leases) -> int:
    async with leases.engine.connect() as conn:
        found = await conn.execute(
            text("SELECT count(*) FROM fence_leases WHERE status = 'running'")
        )
        return int(found.scalar_one())


async def submit(
    client: Instance, text_: str, flow: Flow, thread: str | None = None, **options: Any
) -> Any:
    return await client.submit(
        "shout", {"text": text_}, cfg(thread or unique("t")), tenant_id="a", flow=flow, **options
    )


async def test_a_key_runs_at_most_max_running_and_holds_back_no_other_key(
    leases: Leases,
) -> None:
    client, worker = leases.instance("client"), leases.instance("worker")
    work = Work()
    names = [f"u{n}" for n in range(5)]
    for name in [*names, "v0"]:
        work.gates[name] = asyncio.Event()
    loop = stepped(worker, {"shout": build(worker, work)}, concurrency=10)
    user = Flow("user-7", max_running=2)
    runs = [await submit(client, name, user) for name in names]
    other = await submit(client, "v0", Flow("user-8", max_running=1))
    states = [await run.state() for run in runs]
    assert all(s.status is LeaseStatus.PENDING and s.held_back for s in states)
    assert {r.held_back for r in await list_runs(leases.engine)} == {True}

    await loop.poll_once()
    for name in ("u0", "u1", "v0"):  # two of user-7 (oldest first), and user-8's own
        await asyncio.wait_for(work.entered.setdefault(name, asyncio.Event()).wait(), 20)
    assert await running(leases) == 3
    await loop.poll_once()  # nothing more: user-7 is at its limit
    assert sorted(t for _, t in work.started) == ["u0", "u1", "v0"]
    for n in range(2, 5):
        work.gates[f"u{n - 2}"].set()  # one of the two ends...
        await runs[n - 2].result(timeout=20)
        await loop.poll_once()  # ...and the next one is admitted and runs
        await asyncio.wait_for(work.entered.setdefault(f"u{n}", asyncio.Event()).wait(), 20)
        assert await running(leases) == 3
    for gate in work.gates.values():
        gate.set()
    await asyncio.gather(*loop.running)
    started = [t for _, t in work.started if t.startswith("u")]
    assert set(started[:2]) == {"u0", "u1"}  # admitted together, in submit order after
    assert started[2:] == names[2:]
    assert (await other.result(timeout=5))["out"] == "V0"


async def test_a_key_starts_at_most_max_starts_in_any_window(leases: Leases) -> None:
    client, worker = leases.instance("client"), leases.instance("worker")
    work = Work()
    loop = stepped(worker, {"shout": build(worker, work)}, concurrency=10)
    rate = Flow("api", max_starts=2, per=10.0)
    runs = [await submit(client, f"r{n}", rate) for n in range(5)]
    await look(loop)
    await look(loop)
    assert len(work.started) == 2
    leases.advance(9.9)
    await look(loop)
    assert len(work.started) == 2  # the window of the first two has not passed
    leases.advance(0.2)
    await look(loop)
    assert len(work.started) == 4
    leases.advance(10.1)
    await look(loop)
    started = [t for _, t in work.started]  # two at a time, oldest submits first
    assert [set(started[:2]), set(started[2:4]), started[4:]] == [
        {"r0", "r1"},
        {"r2", "r3"},
        ["r4"],
    ]
    for run in runs:
        assert (await run.state()).status is LeaseStatus.DONE


async def test_a_cancelled_held_back_run_never_starts_and_frees_nothing_it_held(
    leases: Leases,
) -> None:
    client, worker = leases.instance("client"), leases.instance("worker")
    work = Work()
    loop = stepped(worker, {"shout": build(worker, work)}, concurrency=10)
    one = Flow("k", max_running=1)
    first, second = await submit(client, "first", one), await submit(client, "second", one)
    assert await second.cancel()
    await look(loop)
    await look(loop)
    assert [t for _, t in work.started] == ["first"]
    assert (await first.state()).status is LeaseStatus.DONE
    assert (await second.state()).status is LeaseStatus.CANCELLED


@pytest.mark.parametrize(
    ("flow", "says"),
    [
        ({"key": ""}, "flow.key must be a non-empty str"),
        ({"key": "k"}, "a Flow needs a limit"),
        ({"key": "k", "max_running": 0}, "flow.max_running must be a positive int"),
        ({"key": "k", "max_running": True}, "flow.max_running must be a positive int"),
        ({"key": "k", "max_starts": 5}, "flow.per must be the window"),
        ({"key": "k", "max_starts": 5, "per": -1.0}, "flow.per must be the window"),
    ],
)
def test_a_bad_flow_is_refused_naming_it(flow: dict[str, Any], says: str) -> None:
    with pytest.raises(ValueError, match=re.escape(says)):
        Flow(**flow)


async def test_a_flow_that_is_no_flow_is_refused_before_anything_is_written(
    database: Database,
) -> None:
    async with opened(database, "client") as client:
        before = await rows(client, SUBMIT_TABLES)
        with pytest.raises(TypeError, match=re.escape("flow must be a langgraph_fence.queue.Flow")):
            await client.submit(
                "shout", {"text": "x"}, cfg(unique("t")), tenant_id="a",
                flow={"key": "k", "max_running": 1},  # type: ignore[arg-type]
            )  # fmt: skip
        assert await rows(client, SUBMIT_TABLES) == before


async def test_a_delayed_keyed_run_takes_no_slot_of_its_key_before_its_time(
    leases: Leases,
) -> None:
    """flow + not_before: the delayed run is the oldest, but it is admitted only at its
    time; meanwhile the key's other runs are admitted under the limit."""
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


async def test_an_operators_retry_of_a_keyed_run_goes_through_admission_again(
    leases: Leases,
) -> None:
    """A keyed run dead-lettered and retried by an operator (resolve --retry) is held back
    again, for a look to admit it under the limit: max_running=1 never runs two."""
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
    await submit(client, "b", one)
    await loop.poll_once()
    await asyncio.wait_for(work.entered.setdefault("b", asyncio.Event()).wait(), 10)
    await leases.store.retry(a.key)  # langgraph-fence resolve --retry
    await loop.poll_once()  # b still runs: a stays held back, nothing more started
    assert (await a.state()).held_back
    assert [t for _, t in work.started] == ["b"]
    work.gates["b"].set()
    await asyncio.gather(*loop.running)
    await look(loop)  # b ended: a is admitted and runs
    assert [t for _, t in work.started] == ["b", "a"]


async def test_a_direct_ainvoke_on_the_thread_does_not_erase_a_keyed_runs_start(
    leases: Leases,
) -> None:
    """max_starts=1 per 60 s. A keyed run starts and ends on thread T; an ainvoke of T's
    graph (allowed: the thread is not busy) rewrites the execution's record; the run's start
    is on its own row and still counts: no second keyed run starts inside the window."""
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
    assert (await second.state()).held_back

"""Two Agent Server attempts of one run racing for the thread at the run's start: the older
attempt's take lands after the newer attempt recorded itself (the older one frozen right
before its take). The older one must give the lease back and never run; the newer one,
refused meanwhile, must take the thread once it is given back.

In process, on the ``leases`` fixture's SQLite store: each attempt is ``instance.ainvoke``
with the config the Agent Server passes (``configurable["run_id"]``,
``metadata["run_attempt"]`` and ``langgraph_api_version``); the race is forced by the lease
store recording the newer attempt just before the older one's take (a fault injected at that
boundary, on the store's one-statement take that ``Instance.open``'s runs use), not by
timing.
"""

from __future__ import annotations

import asyncio
from typing import Any, TypedDict

import pytest

from langgraph_fence import Instance, LeaseKey, LeaseStatus
from langgraph_fence.errors import (
    ExecutionFencedError,
    ExecutionSupersededError,
    ServerAttemptSuperseded,
)
from langgraph_fence.lease.attempts import Attempt
from langgraph_fence.testing import Leases
from tests.support.databases import unique
from tests.support.graphs import one_step

RUN = "01a242de-fb57-7303-8854-81b32a2fd5c1"
OLDER, NEWER = Attempt(RUN, 1), Attempt(RUN, 2)


def newer_recorded_before_the_first_take(leases: Leases, key: LeaseKey) -> None:
    """A fault at the boundary: attempt 2 records itself just before the first take of the
    store (its one-statement take, as ``Instance.open``'s runs take)."""
    take = leases.store.take
    fired: list[bool] = []

    async def late(*args: Any, **kwargs: Any) -> Any:
        if not fired:
            fired.append(True)
            await leases.store.supersede(key, NEWER, "newer", 30.0)
        return await take(*args, **kwargs)

    leases.store.take = late  # type: ignore[method-assign]


def refusals(leases: Leases) -> asyncio.Event:
    """Set once the store's take refuses a start."""
    take = leases.store.take
    refused = asyncio.Event()

    async def watched(*args: Any, **kwargs: Any) -> Any:
        taken = await take(*args, **kwargs)
        if taken.lease is None:
            refused.set()
        return taken

    leases.store.take = watched  # type: ignore[method-assign]
    return refused


class State(TypedDict, total=False):
    by: str


def instance_on(leases: Leases, repository: Any, name: str) -> Instance:
    return Instance(
        repository,
        leases.saver,
        instance_id=name,
        lease_ttl=30.0,
        clock=leases.clock,
        records=leases.records,
    )


def server_config(thread: str, attempt: int) -> dict[str, Any]:
    """The config the Agent Server passes attempt ``attempt`` of the run on ``thread``."""
    return {
        "configurable": {"thread_id": thread, "run_id": RUN},
        "metadata": {"run_attempt": attempt, "langgraph_api_version": "0.16.7"},
    }


def server_run(instance: Instance, thread: str, attempt: int) -> Any:
    """Attempt ``attempt`` of the server run, as the server calls the graph."""

    async def step(state: State) -> dict[str, str]:
        return {"by": instance.instance_id}

    graph = one_step(instance, State, "step", step, name="agent")
    return instance.ainvoke(graph, {}, server_config(thread, attempt), tenant_id="acme")


async def test_an_older_attempt_whose_take_lands_late_gives_the_thread_back(
    leases: Leases,
) -> None:
    thread = unique("thread")
    key = LeaseKey("acme", thread)
    older = instance_on(leases, leases.store, "older")
    newer_recorded_before_the_first_take(leases, key)
    with pytest.raises(ExecutionSupersededError, match=r"attempt 1 of run .* superseded by"):
        await server_run(older, thread, 1)
    given_back = await leases.store.get(key)
    assert given_back is not None
    # Given back as the newer attempt will find it: ended, nobody's to take over.
    assert (given_back.holder, given_back.status) == (None, LeaseStatus.DONE)
    # The newer attempt takes the thread at the next token; the older one never again.
    newer = instance_on(leases, leases.store, "newer")
    assert await server_run(newer, thread, 2) == {"by": "newer"}
    after = await leases.store.get(key)
    assert after is not None
    assert (after.epoch, after.status) == (given_back.epoch + 1, LeaseStatus.DONE)
    with pytest.raises(ExecutionSupersededError):
        await server_run(older, thread, 1)


async def test_the_newer_attempt_refused_meanwhile_takes_the_thread_once_given_back(
    leases: Leases,
) -> None:
    thread = unique("thread")
    key = LeaseKey("acme", thread)
    newer = instance_on(leases, leases.store, "newer")
    await leases.store.supersede(key, OLDER, "older", 30.0)  # the older attempt recorded itself
    await leases.store.supersede(key, NEWER, "newer", 30.0)  # ...then the newer one...
    # ...then the older one's take landed: it holds the lease, not knowing yet.
    held = await leases.store.acquire(key, "older", 30.0, reopen=True)
    assert held is not None
    refused = refusals(leases)
    newer_run = asyncio.ensure_future(server_run(newer, thread, 2))
    await asyncio.wait_for(refused.wait(), 30)  # refused while the older one holds it
    assert not newer_run.done()  # and asking again
    # The older attempt records its take: refused (a newer attempt started); it gives it back.
    assert not await leases.store.record_epoch(key, OLDER, held.epoch)
    await leases.store.release(held, LeaseStatus.DONE)
    assert await asyncio.wait_for(newer_run, 30) == {"by": "newer"}
    after = await leases.store.get(key)
    assert after is not None
    assert (after.epoch, after.status) == (held.epoch + 1, LeaseStatus.DONE)


def gated_run(
    instance: Instance, thread: str, attempt: int
) -> tuple[Any, asyncio.Event, asyncio.Event]:
    """Attempt ``attempt`` of the server run, started, its step waiting on a gate: (the
    run's task, the step entered, the gate)."""
    entered, gate = asyncio.Event(), asyncio.Event()

    async def step(state: State) -> dict[str, str]:
        entered.set()
        await gate.wait()
        return {"by": instance.instance_id}

    graph = one_step(instance, State, "step", step, name="agent")
    config = server_config(thread, attempt)
    task = asyncio.ensure_future(instance.ainvoke(graph, {}, config, tenant_id="acme"))
    return task, entered, gate


async def test_an_attempt_taken_over_by_a_newer_one_ends_without_a_status_of_its_own(
    leases: Leases,
) -> None:
    thread = unique("thread")
    key = LeaseKey("acme", thread)
    first = instance_on(leases, leases.store, "first")
    run, entered, gate = gated_run(first, thread, 1)
    await asyncio.wait_for(entered.wait(), 30)
    taken = await leases.store.supersede(key, NEWER, "second", 30.0)
    assert taken is not None
    assert taken.holder == "second"
    gate.set()
    with pytest.raises(ServerAttemptSuperseded) as ended:
        await asyncio.wait_for(run, 30)
    assert isinstance(ended.value.__cause__, ExecutionFencedError)


async def test_a_fenced_attempt_with_no_newer_attempt_keeps_its_error_for_the_server(
    leases: Leases,
) -> None:
    """Nobody newer will write the run's status: the run must end with an ``Exception``
    (the server marks it failed), not the silent ``BaseException`` (it would stay
    ``running`` and block its thread)."""
    thread = unique("thread")
    key = LeaseKey("acme", thread)
    first = leases.instance("first")
    run, entered, gate = gated_run(first, thread, 1)
    await asyncio.wait_for(entered.wait(), 30)
    leases.stall(first)  # its renewals stop; its lease lapses
    leases.advance(31.0)
    intruder = await leases.store.acquire(key, "intruder", 30.0, reopen=True)
    assert intruder is not None
    leases.resume(first)
    gate.set()
    with pytest.raises(ExecutionFencedError):
        await asyncio.wait_for(run, 30)

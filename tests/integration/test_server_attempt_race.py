"""Two Agent Server attempts of one run racing for the thread at the run's start: the older
attempt's take lands after the newer attempt recorded itself (the older one frozen right
before its take). The older one must give the lease back and never run; the newer one,
refused meanwhile, must take the thread once it is given back.

In process, on the ``leases`` fixture's SQLite store: each attempt is ``instance.ainvoke``
with the config the Agent Server passes (``configurable["run_id"]``,
``metadata["run_attempt"]`` and ``langgraph_api_version``); the race is forced by a lease
store that records the newer attempt just before the older one's take (a fault injected at
that boundary), not by timing.
"""

from __future__ import annotations

import asyncio
from typing import Any, TypedDict

import pytest

from langgraph_fence import Instance, LeaseKey, LeaseStatus
from langgraph_fence.errors import ExecutionSupersededError
from langgraph_fence.lease.attempts import attempt_stamp
from langgraph_fence.testing import Leases
from tests.support.databases import unique
from tests.support.graphs import one_step

RUN = "01a242de-fb57-7303-8854-81b32a2fd5c1"
OLDER, NEWER = attempt_stamp(RUN, 1), attempt_stamp(RUN, 2)


class NewerRecordedBeforeTheTake:
    """The lease store, with attempt 2 recorded just before the first take it is asked."""

    def __init__(self, inner: Any, key: LeaseKey) -> None:
        self.inner = inner
        self.key = key
        self.fired = False

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)

    async def acquire(self, *args: Any, **kwargs: Any) -> Any:
        if not self.fired:
            self.fired = True
            await self.inner.supersede(self.key, NEWER)
        return await self.inner.acquire(*args, **kwargs)


class Refusals:
    """The lease store, counting the takes it refused."""

    def __init__(self, inner: Any) -> None:
        self.inner = inner
        self.refused = asyncio.Event()

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)

    async def acquire(self, *args: Any, **kwargs: Any) -> Any:
        taken = await self.inner.acquire(*args, **kwargs)
        if taken is None:
            self.refused.set()
        return taken


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


def server_run(instance: Instance, thread: str, attempt: int) -> Any:
    """Attempt ``attempt`` of the server run, as the server calls the graph."""

    async def step(state: State) -> dict[str, str]:
        return {"by": instance.instance_id}

    graph = one_step(instance, State, "step", step, name="agent")
    config = {
        "configurable": {"thread_id": thread, "run_id": RUN},
        "metadata": {"run_attempt": attempt, "langgraph_api_version": "0.16.7"},
    }
    return instance.ainvoke(graph, {}, config, tenant_id="acme")


async def test_an_older_attempt_whose_take_lands_late_gives_the_thread_back(
    leases: Leases,
) -> None:
    thread = unique("thread")
    key = LeaseKey("acme", thread)
    older = instance_on(leases, NewerRecordedBeforeTheTake(leases.store, key), "older")
    with pytest.raises(ExecutionSupersededError, match=r"attempt 1 of run .* superseded by"):
        await server_run(older, thread, 1)
    given_back = await leases.store.get(key)
    assert given_back is not None
    assert (given_back.holder, given_back.status) == (None, LeaseStatus.PENDING)
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
    watched = Refusals(leases.store)
    newer = instance_on(leases, watched, "newer")
    await leases.store.supersede(key, OLDER)  # the older attempt recorded itself...
    await leases.store.supersede(key, NEWER)  # ...then the newer one...
    # ...then the older one's take landed: it holds the lease, not knowing yet.
    held = await leases.store.acquire(key, "older", 30.0, reopen=True)
    assert held is not None
    newer_run = asyncio.ensure_future(server_run(newer, thread, 2))
    await asyncio.wait_for(watched.refused.wait(), 30)  # refused while the older one holds it
    assert not newer_run.done()  # and asking again
    # The older attempt's check after its take finds the newer stamp and gives it back.
    with pytest.raises(ExecutionSupersededError):
        await leases.store.supersede(key, OLDER)
    await leases.store.release(held, LeaseStatus.PENDING)
    assert await asyncio.wait_for(newer_run, 30) == {"by": "newer"}
    after = await leases.store.get(key)
    assert after is not None
    assert (after.epoch, after.status) == (held.epoch + 1, LeaseStatus.DONE)

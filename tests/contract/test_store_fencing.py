"""The store is fenced too: a step's store writes are made under its token.

Every store kind is run through the same take-over: A holds the lease at token 1, the lease
expires and B takes it (token 2) and writes its memory from a step of its own; then A's step
writes: it is refused with ``ExecutionFencedError``, recorded on A's run, and B's value
stands. Our ``SqlStore`` (SQLite, PostgreSQL) checks inside its write statement; over
``InMemoryStore`` and the official ``AsyncPostgresStore`` ``FencedStore`` checks before it
delegates (and the window that leaves is shown, as documented).
"""

from __future__ import annotations

import asyncio
import urllib.parse
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from typing import Any

import pytest
from langgraph.store.base import BaseStore, Op, PutOp, Result
from langgraph.store.memory import InMemoryStore
from sqlalchemy import text
from sqlalchemy.ext.asyncio import AsyncEngine

from checkpointers import SqlStore
from langgraph_fence import ExecutionFencedError, FencedStore, LeaseKey
from langgraph_fence.fence import RunHandle
from langgraph_fence.lease.stores import SqlLeaseRepository
from langgraph_fence.saver.store import tenant_label
from langgraph_fence.testing import ManualClock
from tests.support.databases import unique
from tests.support.leases import run_step

TTL = 30.0
KINDS = ["sql-sqlite", "sql-postgresql", "fenced-memory", "fenced-postgres-official"]


@dataclass
class Setup:
    store: BaseStore
    repo: SqlLeaseRepository
    clock: ManualClock
    engine: AsyncEngine
    guarded: bool  # the token is checked inside the write


@pytest.fixture(params=KINDS)
async def setup(
    request: pytest.FixtureRequest, make_engine: Callable[[str], AsyncEngine]
) -> AsyncIterator[Setup]:
    kind: str = request.param
    backend = "sqlite" if kind == "sql-sqlite" else "postgresql"
    engine = make_engine(backend)
    clock = ManualClock()
    repo = SqlLeaseRepository(engine, clock=clock)
    await repo.setup()
    if kind.startswith("sql-"):
        sql = SqlStore(engine)
        await sql.setup()
        yield Setup(FencedStore(sql), repo, clock, engine, guarded=True)
    elif kind == "fenced-memory":
        yield Setup(FencedStore(InMemoryStore()), repo, clock, engine, guarded=False)
    else:
        from langgraph.store.postgres import AsyncPostgresStore

        url, schema = request.getfixturevalue("pg_schema")
        options = urllib.parse.quote(f"-csearch_path={schema}")
        async with AsyncPostgresStore.from_conn_string(f"{url}?options={options}") as official:
            await official.setup()
            yield Setup(FencedStore(official), repo, clock, engine, guarded=False)
    await engine.dispose()


async def take_over(s: Setup, key: LeaseKey) -> tuple[RunHandle, RunHandle]:
    """A holds ``key`` at token 1; its lease expires and B takes it at token 2."""
    lease_a = await s.repo.acquire(key, "A", TTL)
    assert lease_a is not None
    handle_a = RunHandle(s.repo, lease_a, TTL)  # A's own clock: it still believes it holds
    s.clock.advance(TTL + 1)
    lease_b = await s.repo.acquire(key, "B", TTL)
    assert lease_b is not None
    assert lease_b.epoch == lease_a.epoch + 1
    return handle_a, RunHandle(s.repo, lease_b, TTL)


def remember(store: BaseStore, ns: tuple[str, ...]) -> Callable[[Any], Any]:
    async def node(state: Any) -> dict[str, Any]:
        from langgraph_fence import get_execution_context

        token = get_execution_context().fence.token
        await store.aput(ns, "summary", {"by": token})
        return {}

    return node


async def token_column(s: Setup, ns: tuple[str, ...], key: str) -> Any:
    async with s.engine.connect() as conn:
        return (
            await conn.execute(
                text("SELECT fence_token FROM fence_store_items WHERE prefix = :p AND key = :k"),
                {"p": ".".join(ns), "k": key},
            )
        ).scalar_one()


async def test_a_stale_step_s_put_is_refused_and_the_new_holder_s_value_stands(
    setup: Setup,
) -> None:
    tenant, thread = unique("tenant"), unique("thread")
    ns = (unique("memories"), "user-1")
    handle_a, handle_b = await take_over(setup, LeaseKey(tenant, thread))
    await run_step(remember(setup.store, ns), handle_b, thread)

    seen: list[Any] = []

    async def read_then_write(state: Any) -> dict[str, Any]:
        # Reads, searches and list_namespaces are never fenced, even on a stale token.
        seen.append(await setup.store.aget(ns, "summary"))
        seen.append(await setup.store.asearch(ns))
        seen.append(await setup.store.alist_namespaces(prefix=ns[:1]))
        return await remember(setup.store, ns)(state)  # type: ignore[no-any-return]

    with pytest.raises(ExecutionFencedError) as refused:
        await run_step(read_then_write, handle_a, thread)
    assert refused.value.token_held == 1
    assert refused.value.token_seen == 2
    assert handle_a.error is refused.value  # recorded on A's run, like a refused checkpoint
    assert handle_b.error is None
    assert seen[0].value == {"by": 2}
    assert [i.key for i in seen[1]] == ["summary"]
    assert seen[2] == [ns]

    async def read(state: Any) -> Any:
        return await setup.store.aget(ns, "summary")

    item = await run_step(read, handle_b, thread)
    assert item is not None
    assert item.value == {"by": 2}
    if setup.guarded:
        assert await token_column(setup, ns, "summary") == 2


async def test_a_stale_step_s_delete_and_sync_put_are_refused(setup: Setup) -> None:
    tenant, thread = unique("tenant"), unique("thread")
    ns = (unique("memories"), "user-1")
    handle_a, handle_b = await take_over(setup, LeaseKey(tenant, thread))
    await run_step(remember(setup.store, ns), handle_b, thread)

    async def forget(state: Any) -> dict[str, Any]:
        await setup.store.adelete(ns, "summary")
        return {}

    def put_sync(state: Any) -> dict[str, Any]:  # a sync node: LangGraph's worker thread
        setup.store.put(ns, "summary", {"by": "stale sync"})
        return {}

    for node in (forget, put_sync):
        with pytest.raises(ExecutionFencedError):
            await run_step(node, handle_a, thread)

    async def read(state: Any) -> Any:
        return await setup.store.aget(ns, "summary")

    item = await run_step(read, handle_b, thread)
    assert item is not None
    assert item.value == {"by": 2}


async def test_a_batch_under_a_stale_token_lands_none_of_its_writes(setup: Setup) -> None:
    tenant, thread = unique("tenant"), unique("thread")
    ns = (unique("memories"), "user-1")
    handle_a, _ = await take_over(setup, LeaseKey(tenant, thread))

    async def several(state: Any) -> dict[str, Any]:
        await setup.store.abatch([PutOp(ns, f"k{i}", {"i": i}) for i in range(3)])
        return {}

    with pytest.raises(ExecutionFencedError):
        await run_step(several, handle_a, thread)
    assert await setup.store.asearch(ns) == []


async def test_a_write_from_outside_any_step_is_allowed(setup: Setup) -> None:
    ns = (unique("admin"), "fix")
    await setup.store.aput(ns, "k", {"v": "by hand"})
    item = await setup.store.aget(ns, "k")
    assert item is not None
    assert item.value == {"v": "by hand"}
    if setup.guarded:
        assert await token_column(setup, ns, "k") is None  # no token: written by no step


class SlowStore(BaseStore):
    """A foreign store whose writes take until ``release`` is set (a slow network)."""

    def __init__(self, inner: BaseStore) -> None:
        self.inner = inner
        self.entered = asyncio.Event()
        self.release = asyncio.Event()

    def batch(self, ops: Any) -> list[Result]:
        raise NotImplementedError

    async def abatch(self, ops: Any) -> list[Result]:
        listed: list[Op] = list(ops)
        if any(isinstance(op, PutOp) for op in listed):
            self.entered.set()
            await self.release.wait()
        return await self.inner.abatch(listed)


async def test_the_window_of_a_foreign_store_is_the_write_in_flight(
    make_engine: Callable[[str], AsyncEngine],
) -> None:
    """Documented limit: over a store that cannot check tokens, a take-over that commits
    after the check lets the write in flight land; the step's next write is refused."""
    engine = make_engine("sqlite")
    clock = ManualClock()
    repo = SqlLeaseRepository(engine, clock=clock)
    await repo.setup()
    slow = SlowStore(InMemoryStore())
    s = Setup(FencedStore(slow), repo, clock, engine, guarded=False)
    thread = unique("thread")
    ns = (unique("memories"),)
    lease_a = await repo.acquire(LeaseKey("t", thread), "A", TTL)
    assert lease_a is not None
    handle_a = RunHandle(repo, lease_a, TTL)
    step = asyncio.create_task(run_step(remember(s.store, ns), handle_a, thread))
    await slow.entered.wait()  # A was checked and is writing
    clock.advance(TTL + 1)
    assert await repo.acquire(LeaseKey("t", thread), "B", TTL) is not None
    slow.release.set()
    await step  # the write in flight lands: the window
    landed = await slow.inner.aget((tenant_label("t"), *ns), "summary")  # the tenant's
    assert landed is not None
    assert landed.value == {"by": 1}
    slow.release.clear()  # a write that got through now would hang: bounded below
    with pytest.raises(ExecutionFencedError):
        await asyncio.wait_for(run_step(remember(s.store, ns), handle_a, thread), 60.0)
    await engine.dispose()


# -- issue 32, item 10: items keyed by tenant over any store; namespaces and keys checked


def looks(store: BaseStore, ns: tuple[str, ...], seen: list[Any]) -> Callable[[Any], Any]:
    """A step that reads ``ns`` every way a node can and appends what it saw to ``seen``."""

    async def node(state: Any) -> dict[str, Any]:
        # Listed first: InMemoryStore lists a namespace a get only looked at.
        names = await store.alist_namespaces(prefix=ns[:1])
        item = await store.aget(ns, "summary")
        found = await store.asearch(ns[:1])
        seen.append((item, [(i.namespace, i.key) for i in found], names))
        return {}

    return node


async def test_a_tenant_never_sees_another_tenant_s_items(setup: Setup) -> None:
    ns = (unique("memories"), "user")
    handles = {}
    for tenant in ("tenant-a", "tenant-b"):
        lease = await setup.repo.acquire(LeaseKey(tenant, unique("thread")), "A", TTL)
        assert lease is not None
        handles[tenant] = RunHandle(setup.repo, lease, TTL)
    a, b = handles["tenant-a"], handles["tenant-b"]
    await run_step(remember(setup.store, ns), a, a.key.execution_id)
    seen: list[Any] = []
    await run_step(looks(setup.store, ns, seen), b, b.key.execution_id)
    await run_step(looks(setup.store, ns, seen), a, a.key.execution_id)
    (b_item, b_found, b_names), (a_item, a_found, a_names) = seen
    assert (b_item, b_found, b_names) == (None, [], [])  # tenant B sees nothing of A's
    assert a_item is not None
    assert (a_item.namespace, a_item.value) == (ns, {"by": 1})  # A's, as it wrote it
    assert a_found == [(ns, "summary")]
    assert a_names == [ns]


MB = "k" * (1 << 20)


@pytest.mark.parametrize(
    ("namespace", "key", "message"),
    [
        (("ok",), "nul\x00key", "key must not contain a NUL byte"),
        (("ok",), "lone\udc80", "key contains a lone surrogate"),
        (("ok",), MB, "key must be at most 1024 bytes"),
        (("nul\x00label",), "k", "NUL byte"),
        (("lone\udc80",), "k", "namespace contains a lone surrogate"),
        ((MB,), "k", "namespace must be at most 512 bytes"),
    ],
    ids=["nul-key", "surrogate-key", "1mb-key", "nul-label", "surrogate-label", "1mb-label"],
)
async def test_namespaces_and_keys_are_checked_before_any_store_sees_them(
    setup: Setup, namespace: tuple[str, ...], key: str, message: str
) -> None:
    lease = await setup.repo.acquire(LeaseKey("t", unique("thread")), "A", TTL)
    assert lease is not None
    handle = RunHandle(setup.repo, lease, TTL)
    errors: list[BaseException] = []

    async def node(state: Any) -> dict[str, Any]:
        for call in (
            setup.store.aput(namespace, key, {"v": 1}),
            setup.store.aget(namespace, key),
            setup.store.adelete(namespace, key),
        ):
            try:
                await call
            except Exception as exc:
                errors.append(exc)
        return {}

    await run_step(node, handle, handle.key.execution_id)
    assert len(errors) == 3
    for error in errors:
        assert isinstance(error, ValueError), repr(error)[:300]
        assert message in str(error)

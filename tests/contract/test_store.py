"""One store contract, run against LangGraph's ``InMemoryStore`` (the reference) and our
``SqlStore`` on SQLite and PostgreSQL: what LangGraph's own store tests check of put, get,
delete, search (filters, pagination), list_namespaces and TTL.

Each test works under a namespace root of its own, so stores sharing a database (the
session's PostgreSQL schema) never see each other's items.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable
from typing import Any

import pytest
from langgraph.store.base import BaseStore, GetOp, PutOp, SearchOp
from langgraph.store.memory import InMemoryStore
from sqlalchemy.ext.asyncio import AsyncEngine

from checkpointers import SqlStore
from langgraph_fence import FencedStore
from langgraph_fence.fence.tenancy import DEFAULT_TENANT
from langgraph_fence.saver.store import tenant_label
from tests.support.databases import unique

STORES = ["memory", "sqlite", "postgresql"]


class WallClock:
    """A wall clock that moves only when told (TTL without sleeping)."""

    def __init__(self) -> None:
        self.now = 1_800_000_000.0

    def __call__(self) -> float:
        return self.now


@pytest.fixture
def wall() -> WallClock:
    return WallClock()


@pytest.fixture(params=STORES)
async def store(
    request: pytest.FixtureRequest, make_engine: Callable[[str], AsyncEngine], wall: WallClock
) -> AsyncIterator[BaseStore]:
    if request.param == "memory":
        yield InMemoryStore()
        return
    engine = make_engine(request.param)
    sql = SqlStore(engine, clock=wall)
    await sql.setup()
    yield sql
    await engine.dispose()


@pytest.fixture
def root() -> str:
    return unique("root")


async def test_put_get_update_delete(store: BaseStore, root: str) -> None:
    ns = (root, "users", "u1")
    assert await store.aget(ns, "prefs") is None
    await store.aput(ns, "prefs", {"theme": "dark", "langs": ["en", "de"], "n": 1})
    item = await store.aget(ns, "prefs")
    assert item is not None
    assert (item.namespace, item.key) == (ns, "prefs")
    assert item.value == {"theme": "dark", "langs": ["en", "de"], "n": 1}
    assert item.created_at.tzinfo is not None
    assert item.updated_at >= item.created_at
    await store.aput(ns, "prefs", {"theme": "light"})
    updated = await store.aget(ns, "prefs")
    assert updated is not None
    assert updated.value == {"theme": "light"}
    assert updated.updated_at >= item.updated_at
    await store.adelete(ns, "prefs")
    assert await store.aget(ns, "prefs") is None
    await store.adelete(ns, "prefs")  # deleting nothing is no error


async def test_keys_and_namespaces_are_apart(store: BaseStore, root: str) -> None:
    await store.aput((root, "a"), "k", {"v": "a"})
    await store.aput((root, "a", "b"), "k", {"v": "ab"})
    await store.aput((root, "b"), "k", {"v": "b"})
    assert (await store.aget((root, "a"), "k")).value == {"v": "a"}  # type: ignore[union-attr]
    assert (await store.aget((root, "a", "b"), "k")).value == {"v": "ab"}  # type: ignore[union-attr]
    assert await store.aget((root,), "k") is None


async def test_batch_reads_and_writes(store: BaseStore, root: str) -> None:
    ns = (root, "batch")
    results = await store.abatch(
        [PutOp(ns, "a", {"x": 1}), PutOp(ns, "b", {"x": 2}), GetOp(ns, "a")]
    )
    assert results[:2] == [None, None]
    after = await store.abatch([GetOp(ns, "a"), GetOp(ns, "b"), GetOp(ns, "c")])
    assert [None if r is None else r.value for r in after] == [{"x": 1}, {"x": 2}, None]  # type: ignore[union-attr]


async def test_search_by_prefix_and_filter(store: BaseStore, root: str) -> None:
    docs = {
        ("docs", "a"): {"kind": "note", "score": 3, "meta": {"lang": "en"}, "tags": ["x"]},
        ("docs", "b"): {"kind": "note", "score": 7, "meta": {"lang": "de"}, "tags": ["y"]},
        ("docs", "c"): {"kind": "todo", "score": 5, "meta": {"lang": "en"}, "tags": ["x"]},
        ("other", "d"): {"kind": "note", "score": 9, "meta": {"lang": "en"}, "tags": []},
    }
    for (sub, key), value in docs.items():
        await store.aput((root, sub), key, value)

    def keys(items: list[Any]) -> set[str]:
        return {i.key for i in items}

    assert keys(await store.asearch((root,), limit=50)) == {"a", "b", "c", "d"}
    assert keys(await store.asearch((root, "docs"))) == {"a", "b", "c"}
    assert keys(await store.asearch((root, "doc"))) == set()  # a label, not a text prefix
    found = await store.asearch((root, "docs"), filter={"kind": "note"})
    assert keys(found) == {"a", "b"}
    assert all(i.namespace == (root, "docs") for i in found)
    assert keys(await store.asearch((root,), filter={"meta": {"lang": "en"}})) == {"a", "c", "d"}
    assert keys(await store.asearch((root,), filter={"tags": ["x"]})) == {"a", "c"}
    assert keys(await store.asearch((root,), filter={"score": {"$gt": 4}})) == {"b", "c", "d"}
    assert keys(await store.asearch((root,), filter={"score": {"$gte": 5, "$lt": 9}})) == {"b", "c"}
    assert keys(await store.asearch((root,), filter={"kind": {"$ne": "note"}})) == {"c"}
    assert keys(await store.asearch((root,), filter={"kind": "note", "score": 3})) == {"a"}


async def test_search_pages(store: BaseStore, root: str) -> None:
    for i in range(7):
        await store.aput((root, "p"), f"k{i}", {"i": i})
    pages = [await store.asearch((root, "p"), limit=3, offset=o) for o in (0, 3, 6)]
    assert [len(p) for p in pages] == [3, 3, 1]
    seen = [i.key for p in pages for i in p]
    assert sorted(seen) == [f"k{i}" for i in range(7)]  # every item once
    assert await store.asearch((root, "p"), limit=3, offset=7) == []


async def test_list_namespaces(store: BaseStore, root: str) -> None:
    for ns in [
        (root, "a", "x"),
        (root, "a", "y"),
        (root, "b", "x"),
        (root, "b", "y", "z"),
    ]:
        await store.aput(ns, "k", {"v": 1})
    mine = await store.alist_namespaces(prefix=(root,))
    assert mine == sorted(
        [(root, "a", "x"), (root, "a", "y"), (root, "b", "x"), (root, "b", "y", "z")]
    )
    assert await store.alist_namespaces(prefix=(root, "a")) == [(root, "a", "x"), (root, "a", "y")]
    assert await store.alist_namespaces(prefix=(root,), suffix=("x",)) == [
        (root, "a", "x"),
        (root, "b", "x"),
    ]
    assert await store.alist_namespaces(prefix=(root, "*", "y")) == [
        (root, "a", "y"),
        (root, "b", "y", "z"),
    ]
    assert await store.alist_namespaces(prefix=(root,), max_depth=2) == [(root, "a"), (root, "b")]
    assert await store.alist_namespaces(prefix=(root,), limit=2, offset=1) == [
        (root, "a", "y"),
        (root, "b", "x"),
    ]


async def test_invalid_namespaces_are_refused(store: BaseStore) -> None:
    for bad in [(), ("a.b",), ("langgraph", "x"), ("",)]:
        with pytest.raises(ValueError, match=r"[Nn]amespace"):
            await store.aput(bad, "k", {"v": 1})


async def test_ttl(store: BaseStore, root: str, wall: WallClock) -> None:
    ns = (root, "ttl")
    if not store.supports_ttl:
        # The reference store has no TTL, and says so rather than ignore it.
        with pytest.raises(NotImplementedError):
            await store.aput(ns, "k", {"v": 1}, ttl=1.0)
        return
    await store.aput(ns, "short", {"v": 1}, ttl=1.0)  # minutes
    await store.aput(ns, "kept", {"v": 2})
    wall.now += 50
    assert await store.aget(ns, "short") is not None  # read at 50 s: refreshed to 110 s
    wall.now += 50
    assert await store.aget(ns, "short", refresh_ttl=False) is not None  # 100 s < 110 s
    wall.now += 15
    assert await store.aget(ns, "short") is None  # 115 s: gone
    assert [i.key for i in await store.asearch(ns)] == ["kept"]
    assert await store.alist_namespaces(prefix=ns) == [ns]
    assert isinstance(store, SqlStore)
    assert await store.sweep_ttl() >= 1


async def test_sync_methods_from_a_worker_thread(store: BaseStore, root: str) -> None:
    ns = (root, "sync")

    def work() -> Any:
        store.put(ns, "k", {"v": 1})
        got = store.get(ns, "k")
        store.delete(ns, "k")
        return got, store.get(ns, "k"), store.search(ns)

    got, gone, found = await asyncio.to_thread(work)
    assert got is not None
    assert got.value == {"v": 1}
    assert gone is None
    assert found == []


async def test_fenced_store_passes_the_contract_unchanged_outside_a_step(
    store: BaseStore, root: str
) -> None:
    # Outside any fenced step (an admin script) the wrapper is the store itself, keyed by
    # the default tenant: under a label of its own in a store that does not key by tenant.
    fenced = FencedStore(store)
    assert fenced.supports_ttl == store.supports_ttl
    scoped = getattr(store, "scopes_tenants", False)
    inner = (root, "admin") if scoped else (tenant_label(DEFAULT_TENANT), root, "admin")
    await fenced.aput((root, "admin"), "k", {"v": 1})
    assert (await store.aget(inner, "k")).value == {"v": 1}  # type: ignore[union-attr]
    assert [(i.namespace, i.key) for i in await fenced.asearch((root,))] == [((root, "admin"), "k")]
    assert await fenced.alist_namespaces(prefix=(root,)) == [(root, "admin")]
    await fenced.adelete((root, "admin"), "k")
    assert await store.aget(inner, "k") is None


async def test_semantic_search_is_refused_clearly(store: BaseStore, root: str) -> None:
    if not isinstance(store, SqlStore):
        # The reference store ignores query= without an index: it answers by prefix alone.
        found = await store.abatch([SearchOp((root,), query="what do I like?")])
        assert found == [[]]
        return
    with pytest.raises(ValueError, match="no semantic search"):
        await store.abatch([SearchOp((root,), query="what do I like?")])

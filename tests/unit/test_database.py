"""Bad input gets a clear ValueError and changes nothing: URLs, TTLs, ids, foreign leases."""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path

import pytest
from sqlalchemy.ext.asyncio import AsyncEngine

from langgraph_fence import (
    Effect,
    ExecutionLeaseRepository,
    LeaseKey,
    LeaseStatus,
    MemoryLeaseRepository,
    PendingEffect,
    SqlLeaseRepository,
)
from langgraph_fence.database import create_engine, normalize_url
from langgraph_fence.fence import RunHandle
from langgraph_fence.lease import validate_ttl
from langgraph_fence.testing import ManualClock
from tests.support.databases import unique

BOTH = ("sqlite+aiosqlite", "postgresql+asyncpg")


@pytest.mark.parametrize(
    "url",
    [
        "mysql://user@host/db",
        "mysql+aiomysql://user@host/db",
        "postgresql+psycopg://user@host/db",
        "postgresql+psycopg2://user@host/db",
        "sqlite+pysqlite:///x.db",
        "oracle://scott@host/db",
        "not a url",
        "",
    ],
)
def test_unsupported_url_names_the_two_supported(url: str) -> None:
    with pytest.raises(ValueError, match=re.escape(BOTH[0])) as caught:
        normalize_url(url)
    for supported in BOTH:
        assert supported in str(caught.value)
    with pytest.raises(ValueError, match=re.escape(BOTH[1])):
        create_engine(url)


async def test_store_from_unsupported_url_is_refused() -> None:
    with pytest.raises(ValueError, match="postgresql\\+asyncpg"):
        async with SqlLeaseRepository.from_conn_string("mysql://u@h/db"):
            raise AssertionError("unreachable")


@pytest.mark.parametrize("url", [None, 5, b"sqlite://"])
def test_non_string_url_is_a_value_error(url: object) -> None:
    with pytest.raises(ValueError, match="url"):
        normalize_url(url)  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("url", "expected"),
    [
        ("postgres://u@h:5432/db", "postgresql+asyncpg://u@h:5432/db"),
        ("postgres+asyncpg://u@h/db", "postgresql+asyncpg://u@h/db"),
        ("postgresql://u@h/db", "postgresql+asyncpg://u@h/db"),
        ("postgresql+asyncpg://u:pw@h/db", "postgresql+asyncpg://u:pw@h/db"),
        ("sqlite:///rel.db", "sqlite+aiosqlite:///rel.db"),
        ("sqlite:////abs/path.db", "sqlite+aiosqlite:////abs/path.db"),
        ("sqlite://", "sqlite+aiosqlite://"),
        ("sqlite+aiosqlite:///x.db", "sqlite+aiosqlite:///x.db"),
    ],
)
def test_supported_urls_are_mapped(url: str, expected: str) -> None:
    assert normalize_url(url).render_as_string(hide_password=False) == expected
    assert normalize_url(normalize_url(url)).render_as_string(hide_password=False) == expected


@pytest.mark.parametrize("ttl", [0, 0.0, -1, -0.5, float("nan"), float("inf"), True, False, "5"])
def test_bad_ttl_is_refused_by_name(ttl: object) -> None:
    with pytest.raises(ValueError, match="ttl"):
        validate_ttl(ttl)  # type: ignore[arg-type]


async def test_bad_ttl_changes_nothing(lease_store: ExecutionLeaseRepository) -> None:
    lease = await lease_store.acquire(LeaseKey(unique("t"), unique("e")), "A", 10)
    assert lease is not None
    effect = PendingEffect(Effect.NON_IDEMPOTENT_WRITE, "n", "t", 1)
    for ttl in (0, -3, float("nan"), True):
        with pytest.raises(ValueError, match="ttl"):
            await lease_store.renew(lease, ttl)  # type: ignore[arg-type]
        with pytest.raises(ValueError, match="ttl"):
            await lease_store.mark_pending_effect(lease, effect, ttl)  # type: ignore[arg-type]
        with pytest.raises(ValueError, match="ttl"):
            RunHandle(lease_store, lease, ttl)  # type: ignore[arg-type]
    assert await lease_store.get(lease.key) == lease


@pytest.mark.parametrize(
    ("tenant", "execution", "name"),
    [
        ("", "e", "tenant_id"),
        ("t", "", "execution_id"),
        (None, "e", "tenant_id"),
        ("t", 42, "execution_id"),
        ("t\x00", "e", "tenant_id"),
        ("t", "e\x00", "execution_id"),
        ("t\ud800", "e", "tenant_id"),
    ],
)
def test_bad_ids_are_refused_by_name(tenant: object, execution: object, name: str) -> None:
    with pytest.raises(ValueError, match=name):
        LeaseKey(tenant, execution)  # type: ignore[arg-type]


async def test_a_lease_from_another_store_is_refused(
    lease_store: ExecutionLeaseRepository,
) -> None:
    key = LeaseKey(unique("t"), unique("e"))
    mine = await lease_store.acquire(key, "A", 10)
    assert mine is not None
    other_store = MemoryLeaseRepository(clock=ManualClock())
    foreign = await other_store.acquire(key, "A", 10)
    assert foreign is not None
    # Same key, holder and epoch: only the store id tells them apart.
    assert replace(foreign, store_id=mine.store_id, expires_at=mine.expires_at) == mine
    effect = PendingEffect(Effect.NON_IDEMPOTENT_WRITE, "n", "t", 1)
    calls = {
        "renew": lambda: lease_store.renew(foreign, 10),
        "release": lambda: lease_store.release(foreign, LeaseStatus.DONE),
        "mark": lambda: lease_store.mark_pending_effect(foreign, effect, 10),
        "clear": lambda: lease_store.clear_pending_effects(foreign),
    }
    for name, call in calls.items():
        with pytest.raises(ValueError, match="another store"):
            await call()
        assert await lease_store.get(key) == mine, name
    for not_a_lease in (None, ("t", "e"), key):
        with pytest.raises(ValueError, match="Lease"):
            await lease_store.renew(not_a_lease, 10)  # type: ignore[arg-type]
    assert await lease_store.get(key) == mine
    # And the other way round: the foreign store refuses ours and keeps its own row.
    with pytest.raises(ValueError, match="another store"):
        await other_store.renew(mine, 10)
    assert await other_store.get(key) == foreign


async def test_sql_stores_on_different_databases_refuse_each_others_leases(
    make_engine: Callable[[str], AsyncEngine],
) -> None:
    make = make_engine
    lite = SqlLeaseRepository(make("sqlite"), clock=ManualClock())
    await lite.setup()
    key = LeaseKey(unique("t"), unique("e"))
    lease = await lite.acquire(key, "A", 10)
    assert lease is not None
    twin = SqlLeaseRepository(lite.engine, clock=ManualClock())
    assert twin.store_id == lite.store_id  # one database, one store
    assert (await twin.renew(lease, 10)).epoch == 1
    pg = SqlLeaseRepository(make("postgresql"), clock=ManualClock())
    await pg.setup()
    with pytest.raises(ValueError, match="another store"):
        await pg.renew(lease, 10)
    assert await pg.get(key) is None


async def test_a_sqlite_file_in_a_missing_folder_is_refused_naming_the_path(
    tmp_path: Path,
) -> None:
    from langgraph_fence import Instance

    folder = tmp_path / "no" / "such"
    url = f"sqlite+aiosqlite:///{folder}/fence.db"
    refused = rf"^url: the folder {re.escape(str(folder))} of the SQLite file .*mkdir -p"
    with pytest.raises(ValueError, match=refused):
        async with Instance.open(url):
            pass  # pragma: no cover - refused before it opens
    with pytest.raises(ValueError, match=refused):
        create_engine(url)
    assert not (tmp_path / "no").exists()
    create_engine(f"sqlite+aiosqlite:///{tmp_path}/fence.db")  # the folder exists: no check


@pytest.mark.parametrize(
    ("url", "hosts", "attrs"),
    [
        # libpq's multi-host form: every host, in order, and sessions on the primary only.
        (
            "postgresql://app@db-1:5432,db-2:5433/shop",
            ("db-1:5432", "db-2:5433"),
            "read-write",
        ),
        (
            "postgres://app:pw@db-1,db-2,db-3/shop?connect_timeout=5",
            ("db-1", "db-2", "db-3"),
            "read-write",
        ),
        # Asked for explicitly: kept.
        (
            "postgresql://app@db-1:5432,db-2:5432/shop?target_session_attrs=primary",
            ("db-1:5432", "db-2:5432"),
            "primary",
        ),
    ],
)
def test_a_multi_host_url_lands_on_the_primary(
    url: str, hosts: tuple[str, ...], attrs: str
) -> None:
    parsed = normalize_url(url)
    assert parsed.drivername == "postgresql+asyncpg"
    assert parsed.database == "shop"
    assert parsed.query["host"] == hosts
    assert parsed.query["target_session_attrs"] == attrs
    assert normalize_url(parsed) == parsed


@pytest.mark.parametrize("attrs", ["read-only", "standby", "prefer-standby"])
def test_a_url_that_asks_for_a_standby_is_refused(attrs: str) -> None:
    with pytest.raises(ValueError, match=f"target_session_attrs={attrs}.*read-write"):
        normalize_url(f"postgresql://app@db-1,db-2/shop?target_session_attrs={attrs}")


def test_a_comma_in_a_password_is_not_a_host_list() -> None:
    parsed = normalize_url("postgresql://app:s3,cr%40t@db-1:5432/shop")
    assert parsed.password == "s3,cr@t"
    assert parsed.username == "app"
    assert parsed.host == "db-1"
    assert "host" not in parsed.query


def test_several_hosts_with_any_session_are_refused() -> None:
    with pytest.raises(ValueError, match=r"target_session_attrs=any.*read-write"):
        normalize_url("postgresql://app@db-1,db-2/shop?target_session_attrs=any")

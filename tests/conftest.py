"""Fixtures shared by every test: real SQLite files, a real PostgreSQL schema per session.

PostgreSQL is found at ``LANGGRAPH_FENCE_PG_URL`` (default
``postgresql://postgres@127.0.0.1:5432/test``); what the fixtures are built on, and test
modules import, is in ``tests/support/databases.py``. Where none is reachable the PostgreSQL tests
skip with the reason, unless ``LANGGRAPH_FENCE_REQUIRE_PG=1`` (CI) makes that a failure.
Each test session works in a schema of its own and drops it at the end: the database may
hold anything else.
"""

from __future__ import annotations

import uuid
from collections.abc import AsyncIterator, Callable, Iterator
from pathlib import Path

import pytest
import sqlalchemy as sa
from sqlalchemy.ext.asyncio import AsyncEngine

from langgraph_fence.database import create_engine
from langgraph_fence.lease import ExecutionLeaseRepository
from langgraph_fence.lease.stores import MemoryLeaseRepository, SqlLeaseRepository
from langgraph_fence.testing import Leases, ManualClock
from tests.support.databases import (
    BACKENDS,
    SQL_BACKENDS,
    Database,
    pg_admin,
    pg_drop_schema,
    pg_engine_options,
    pg_required,
    pg_url_from_env,
    sync_engine_for,
)
from tests.support.pg_cluster import PgCluster, find_bindir


def pytest_generate_tests(metafunc: pytest.Metafunc) -> None:
    """Every test that uses ``backend`` (itself or through a fixture) runs once per backend
    of its module's ``RUNS_ON`` (all three unless narrowed), named by it in the test id."""
    if "backend" not in metafunc.fixturenames:
        return
    for mark in metafunc.definition.iter_markers("parametrize"):
        names = mark.args[0]
        listed = names.split(",") if isinstance(names, str) else list(names)
        if "backend" in (name.strip() for name in listed):
            return  # the test names its backends itself
    metafunc.parametrize(
        "backend", getattr(metafunc.module, "RUNS_ON", BACKENDS), indirect=True, scope="function"
    )


@pytest.fixture(scope="session")
def pg_schema() -> Iterator[tuple[str, str]]:
    """``(url, schema)``: a schema of this test session's own on the reachable PostgreSQL."""
    url = pg_url_from_env()
    schema = f"lgf_test_{uuid.uuid4().hex[:12]}"
    try:
        pg_admin(url, f'CREATE SCHEMA "{schema}"')
    except Exception as exc:  # unreachable, refused, no such database...
        reason = f"PostgreSQL not reachable at {url} ({type(exc).__name__}: {exc})"
        if pg_required():
            pytest.fail(f"{reason}; LANGGRAPH_FENCE_REQUIRE_PG forbids skipping", pytrace=False)
        pytest.skip(f"{reason}; set LANGGRAPH_FENCE_PG_URL to run the PostgreSQL tests")
    yield url, schema
    pg_drop_schema(url, schema)


@pytest.fixture
def own_schema(pg_schema: tuple[str, str]) -> Iterator[tuple[str, str]]:
    """``(url, schema)``: a schema of this test's own, dropped after it.

    serve() looks at every execution in its schema: other tests' leftovers in the session's
    schema must not change what these workers see.
    """
    url, _ = pg_schema
    schema = f"lgf_chaos_{uuid.uuid4().hex[:12]}"
    pg_admin(url, f'CREATE SCHEMA "{schema}"')
    try:
        yield url, schema
    finally:
        pg_drop_schema(url, schema)


@pytest.fixture(scope="session")
def pg_cluster() -> Iterator[PgCluster]:
    """A private PostgreSQL cluster of this session's own (see ``tests/support/pg_cluster.py``):
    tests restart, stop and kill it, never the shared server. Started once per session;
    each test uses a schema of its own in it. Removed at the end, even after a failure.
    Without the server binaries it skips with the reason (fails under
    ``LANGGRAPH_FENCE_REQUIRE_PG=1``)."""
    bindir = find_bindir()
    reason = "no PostgreSQL server binaries under /usr/lib/postgresql/*/bin"
    cluster = None
    if bindir is not None:
        try:
            cluster = PgCluster.create(bindir)
        except Exception as exc:
            reason = f"a private PostgreSQL cluster could not start ({exc})"
    if cluster is None:
        if pg_required():
            pytest.fail(f"{reason}; LANGGRAPH_FENCE_REQUIRE_PG forbids skipping", pytrace=False)
        pytest.skip(f"{reason}: the database-fault tests need one")
    try:
        yield cluster
    finally:
        cluster.remove()


@pytest.fixture
def cluster_schema(pg_cluster: PgCluster) -> Iterator[tuple[PgCluster, str]]:
    """``(cluster, schema)``: a schema of this test's own on the private cluster, whose
    server is up again (and the schema dropped) after the test."""
    schema = f"lgf_blink_{uuid.uuid4().hex[:12]}"
    pg_admin(pg_cluster.url, f'CREATE SCHEMA "{schema}"')
    try:
        yield pg_cluster, schema
    finally:
        if not (pg_cluster.data / "postmaster.pid").exists():
            pg_cluster.start()
        pg_drop_schema(pg_cluster.url, schema)


@pytest.fixture
def backend(request: pytest.FixtureRequest) -> str:
    """The backend a test runs on: ``memory``, ``sqlite`` or ``postgresql`` (the test ids).

    The one parametrisation of the suite (``pytest_generate_tests``): fixtures build their
    stores on it (``make_engine`` for the SQL ones). PostgreSQL skips with the reason where none
    is reachable, and fails instead under ``LANGGRAPH_FENCE_REQUIRE_PG=1``.
    """
    if request.param == "postgresql":
        request.getfixturevalue("pg_schema")  # skips (or fails) saying why
    return str(request.param)


@pytest.fixture(params=SQL_BACKENDS)
def database(request: pytest.FixtureRequest, tmp_path: Path) -> Database:
    """Where the instances and worker processes of one test meet: a SQLite file, or a
    PostgreSQL schema of the test's own (``serve()`` there sees no other test's work)."""
    if request.param == "sqlite":
        return Database(f"sqlite+aiosqlite:///{tmp_path / 'fence.db'}", "")
    url, schema = request.getfixturevalue("own_schema")
    return Database(url, schema)


@pytest.fixture
def make_engine(
    request: pytest.FixtureRequest, tmp_path: Path
) -> Iterator[Callable[[str], AsyncEngine]]:
    """``make_engine(backend)``: a new engine on a real database ("sqlite" or "postgresql").

    SQLite engines of one test share one file (as two processes would); PostgreSQL engines
    share the session's schema.
    """
    engines: list[AsyncEngine] = []

    def make(backend: str) -> AsyncEngine:
        if backend == "sqlite":
            engine = create_engine(f"sqlite+aiosqlite:///{tmp_path / 'fence.db'}")
        elif backend == "postgresql":
            url, schema = request.getfixturevalue("pg_schema")
            engine = create_engine(url, **pg_engine_options(schema))
        else:
            raise ValueError(f"unknown backend {backend!r}")
        engines.append(engine)
        return engine

    yield make
    for engine in engines:
        # Engines are disposed by the loop that made them (pytest-asyncio closes it after);
        # dropping the pool here only releases file handles.
        engine.sync_engine.dispose(close=False)


@pytest.fixture
def make_sync_engine(
    request: pytest.FixtureRequest, tmp_path: Path
) -> Iterator[Callable[[str], sa.Engine]]:
    """``make_sync_engine(backend)``: a sync engine on the database ``make_engine`` gives."""
    engines: list[sa.Engine] = []

    def make(backend: str) -> sa.Engine:
        if backend == "sqlite":
            engine = sync_engine_for(backend, tmp_path / "fence.db")
        else:
            url, schema = request.getfixturevalue("pg_schema")
            engine = sync_engine_for(backend, url, schema)
        engines.append(engine)
        return engine

    yield make
    for engine in engines:
        engine.dispose()


@pytest.fixture
def clock() -> ManualClock:
    return ManualClock()


@pytest.fixture
async def lease_store(
    backend: str, make_engine: Callable[[str], AsyncEngine], clock: ManualClock
) -> AsyncIterator[ExecutionLeaseRepository]:
    """A lease store on every backend, all on the controlled ``clock``."""
    if backend == "memory":
        yield MemoryLeaseRepository(clock=clock)
        return
    engine = make_engine(backend)
    repo = SqlLeaseRepository(engine, clock=clock)
    await repo.setup()
    yield repo
    await engine.dispose()


@pytest.fixture
async def db(backend: str, make_engine: Callable[[str], AsyncEngine]) -> AsyncIterator[Leases]:
    """The ``leases`` fixture's instances (a controlled clock), on each backend of the
    module: SQLite and PostgreSQL."""
    engine = make_engine(backend)
    fixture = Leases(engine, ManualClock())
    await fixture.setup()
    try:
        yield fixture
    finally:
        await engine.dispose()


@pytest.fixture
async def own_leases(
    backend: str, request: pytest.FixtureRequest, tmp_path: Path
) -> AsyncIterator[Leases]:
    """The ``leases`` fixture's tools on a database of the test's own: a SQLite file, or a
    PostgreSQL schema nothing else writes (its listings and counts are the test's alone)."""
    from langgraph_fence.testing import open_leases

    if backend == "sqlite":
        url, options = f"sqlite+aiosqlite:///{tmp_path / 'own.db'}", {}
    else:
        url, schema = request.getfixturevalue("own_schema")
        options = pg_engine_options(schema)
    async with open_leases(url, **options) as tools:
        yield tools

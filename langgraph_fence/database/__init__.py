"""Engines for the two supported databases: SQLite (aiosqlite) and PostgreSQL (asyncpg).

PostgreSQL engines run in autocommit: every hot-path operation is one statement, which is
atomic on its own, so a BEGIN/COMMIT pair would only add two round trips. Code that needs a
multi-statement transaction opens one explicitly with :func:`transaction`.

SQLite connections leave transaction control to SQLAlchemy and begin every transaction with
``BEGIN IMMEDIATE``: a writer takes the write lock up front and waits for it (busy timeout)
instead of failing with "database is locked" when it upgrades a read lock. Connections that
only read (see :func:`read_only`) begin with a plain ``BEGIN``: in WAL mode a reader never
waits for the writer, and never makes the writers wait.
"""

from __future__ import annotations

import asyncio
import logging
import os
import re
import sqlite3
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any, Literal

from sqlalchemy import event
from sqlalchemy.engine import URL, make_url
from sqlalchemy.exc import ArgumentError
from sqlalchemy.ext.asyncio import AsyncConnection, AsyncEngine, create_async_engine
from sqlalchemy.pool import StaticPool

from langgraph_fence.redact import mask_password
from langgraph_fence.validate import text_id

__all__ = [
    "READ_ONLY",
    "SINGLE_STATEMENT",
    "Dialect",
    "autocommit",
    "check_engine",
    "check_sqlite_folder",
    "create_engine",
    "dialect_of",
    "discard",
    "in_memory",
    "normalize_url",
    "read_only",
    "schema_options",
    "single_statement",
    "transaction",
    "twin_engine",
]

logger = logging.getLogger("langgraph_fence.database")

Dialect = Literal["sqlite", "postgresql"]

SUPPORTED = "'sqlite+aiosqlite:///path.db' or 'postgresql+asyncpg://user@host/db'"
SQLITE_BUSY_TIMEOUT_MS = 30_000
#: Execution option of a connection that only reads: on SQLite it takes no write lock.
READ_ONLY = "langgraph_fence_read_only"
#: Execution option of a connection that runs one statement per transaction: no BEGIN is
#: sent, the statement commits on its own (it is atomic on its own).
SINGLE_STATEMENT = "langgraph_fence_single_statement"


def normalize_url(url: str | URL) -> URL:
    """Parse ``url`` and map it to one of the two supported async drivers.

    ``sqlite://`` becomes ``sqlite+aiosqlite://`` and ``postgresql://`` / ``postgres://``
    become ``postgresql+asyncpg://``. Any other driver or database is refused.

    Raises:
        ValueError: the URL cannot be parsed or names an unsupported driver (the message
            names the two supported ones).
    """
    if isinstance(url, URL):
        text = url.render_as_string(hide_password=False)
    elif isinstance(url, str):
        text = url
    else:
        raise ValueError(
            f"url must be a str or sqlalchemy URL, got {type(url).__name__}; use {SUPPORTED}"
        )
    if text.startswith(("postgres://", "postgres+")):
        # The scheme Heroku and libpq accept; SQLAlchemy knows only "postgresql".
        text = "postgresql" + text[len("postgres") :]
    text = _multi_host(text)
    try:
        parsed = make_url(text)
    except (ArgumentError, ValueError):
        # Never echo a password back, not even from a URL too mistyped to parse.
        raise ValueError(
            f"url {mask_password(repr(text))} is not a database URL; use {SUPPORTED}"
        ) from None
    backend, _, driver = parsed.drivername.partition("+")
    if backend == "sqlite" and driver in ("", "aiosqlite"):
        return parsed.set(drivername="sqlite+aiosqlite")
    if backend == "postgresql" and driver in ("", "asyncpg"):
        return _to_primary(parsed.set(drivername="postgresql+asyncpg"))
    raise ValueError(
        f"url uses the unsupported driver {parsed.drivername!r}; "
        f"langgraph-fence supports exactly two: {SUPPORTED}"
    )


#: libpq's multi-host form: ``postgresql[+driver]://[userinfo@]host[:port],host[:port][/rest]``.
_PG_SCHEME = re.compile(r"^postgresql(?:\+\w+)?://")
#: The ``target_session_attrs`` that would let a session land on a standby.
_STANDBY_ATTRS = frozenset({"read-only", "standby", "prefer-standby"})


def _multi_host(text: str) -> str:
    """libpq's multi-host URL (``postgresql://u@h1:5432,h2:5432/db``) in the form SQLAlchemy
    parses: one ``host=h:p`` query parameter per host, in order. Other URLs as they are (a
    comma in the user's name or password is not a host list)."""
    scheme = _PG_SCHEME.match(text)
    if scheme is None:
        return text
    after = text[scheme.end() :]
    cut = min((i for i in (after.find(c) for c in "/?#") if i >= 0), default=len(after))
    netloc, rest = after[:cut], after[cut:]
    userinfo, at, hosts = netloc.rpartition("@")
    if "," not in hosts:
        return text
    path, _, query = rest.partition("?")
    listed = "&".join(f"host={host}" for host in hosts.split(",") if host)
    query = f"{listed}&{query}" if query else listed
    return f"{scheme.group(0)}{userinfo}{at}{path or '/'}?{query}"


def _to_primary(url: URL) -> URL:
    """A PostgreSQL URL whose sessions land on the primary: a multi-host URL without
    ``target_session_attrs`` gets ``read-write`` (asyncpg's default, ``any``, may pick a
    standby, where every write fails); one that asks for a standby is refused."""
    hosts = url.query.get("host")
    attrs = url.query.get("target_session_attrs")
    if isinstance(attrs, tuple):
        attrs = attrs[-1]
    if attrs in _STANDBY_ATTRS:
        raise ValueError(
            f"url sets target_session_attrs={attrs}: every lease, checkpoint and record "
            "write must reach the primary; use target_session_attrs=read-write (or leave it "
            "out: a multi-host URL gets read-write)"
        )
    if isinstance(hosts, tuple) and len(hosts) > 1:
        if attrs is None:
            return url.update_query_dict({"target_session_attrs": "read-write"})
        if attrs == "any":
            raise ValueError(
                "url lists several hosts with target_session_attrs=any: a session may land "
                "on a standby, where every write fails; use target_session_attrs=read-write "
                "(or leave it out: a multi-host URL gets read-write)"
            )
    return url


def create_engine(
    url: str | URL, *, schema: str | None = None, **engine_options: Any
) -> AsyncEngine:
    """Create an engine for ``url`` set up the way every langgraph-fence store expects.

    Args:
        url: a SQLite or PostgreSQL URL (see :func:`normalize_url`).
        schema: PostgreSQL only: the schema every connection of the engine works in (its
            ``search_path``). The stores' ``setup()`` (and ``langgraph-fence migrate``)
            create it when it does not exist. ``None``: the role's own search_path.
        **engine_options: passed to :func:`sqlalchemy.ext.asyncio.create_async_engine`.

    Raises:
        ValueError: ``url`` is not a supported URL, or names a SQLite file in a folder that
            does not exist (naming the folder and the fix); ``schema`` is not a non-empty
            name, is given with a SQLite URL (SQLite has no schemas), or is given along
            with a ``search_path`` in ``connect_args``.
    """
    parsed = normalize_url(url)
    if schema is not None:
        text_id("schema", schema, what="the PostgreSQL schema every connection works in")
        if parsed.get_backend_name() != "postgresql":
            raise ValueError(
                f"schema: SQLite has no schemas (got schema={schema!r} with a SQLite URL): "
                "leave schema out, or use a PostgreSQL URL"
            )
        engine_options["connect_args"] = _in_schema(engine_options.get("connect_args"), schema)
    check_sqlite_folder(parsed)
    if parsed.get_backend_name() == "postgresql":
        engine_options.setdefault("isolation_level", "AUTOCOMMIT")
        engine_options.setdefault("pool_size", 8)
        engine_options.setdefault("max_overflow", 8)
        engine_options.setdefault("pool_pre_ping", False)
        engine = create_async_engine(parsed, **engine_options)
        configure_postgresql(engine)
        return engine
    if _memory_url(parsed):
        # One in-memory database exists per connection: share one connection.
        engine_options.setdefault("poolclass", StaticPool)
    connect_args = dict(engine_options.pop("connect_args", {}))
    connect_args.setdefault("timeout", SQLITE_BUSY_TIMEOUT_MS / 1000)
    engine = create_async_engine(parsed, connect_args=connect_args, **engine_options)
    configure_sqlite(engine)
    return engine


def check_sqlite_folder(url: URL, *, name: str = "url") -> None:
    """Refuse a SQLite ``url`` whose file is in a folder that does not exist.

    SQLite itself says only "unable to open database file", without the path, and only at
    the first connection. A PostgreSQL URL, an in-memory SQLite one and a ``file:`` URI
    filename (SQLite parses those) pass.

    Raises:
        ValueError: naming ``name`` (the argument the URL came in), the folder and the fix.
    """
    path = url.database or ""
    if url.get_backend_name() != "sqlite" or _memory_url(url) or path.startswith("file:"):
        return
    folder = os.path.dirname(os.path.abspath(path))
    if not os.path.isdir(folder):
        raise ValueError(
            f"{name}: the folder {folder} of the SQLite file {path} does not exist: create it "
            f"(mkdir -p {folder}) or fix the path in {name}"
        )


def configure_postgresql(engine: AsyncEngine) -> None:
    """Make a PostgreSQL engine drop a connection that landed on a standby: a write there
    fails as read-only (SQLSTATE 25006) and the server's timeline cannot be read ("recovery
    is in progress"). SQLAlchemy then invalidates the connection, as for a disconnect, and
    the retry's fresh one finds the primary (a multi-host URL asks for ``read-write``)."""
    if not event.contains(engine.sync_engine, "handle_error", _on_postgresql_error):
        event.listen(engine.sync_engine, "handle_error", _on_postgresql_error)


def _on_postgresql_error(context: Any) -> None:
    from langgraph_fence.database.retry import on_standby

    if context.original_exception is not None and on_standby(context.original_exception):
        context.is_disconnect = True


def configure_sqlite(engine: AsyncEngine) -> None:
    """Give a SQLite engine WAL, a busy timeout and ``BEGIN IMMEDIATE`` transactions."""
    event.listen(engine.sync_engine, "connect", _on_sqlite_connect)
    event.listen(engine.sync_engine, "begin", _on_sqlite_begin)


def _on_sqlite_connect(dbapi_connection: Any, _record: Any) -> None:
    # Let SQLAlchemy, not the driver, decide when a transaction begins.
    dbapi_connection.isolation_level = None
    cursor = dbapi_connection.cursor()
    cursor.execute(f"PRAGMA busy_timeout={SQLITE_BUSY_TIMEOUT_MS}")
    try:
        cursor.execute("PRAGMA journal_mode=WAL")
    except sqlite3.OperationalError as exc:
        # Several processes opening a new file at once: switching to WAL needs the file
        # to itself and SQLite fails it at once, without the busy handler. WAL is kept in
        # the file, so whichever connection switches it serves every later one; until
        # then this connection works in the file's rollback-journal mode.
        if "locked" not in str(exc) and "busy" not in str(exc):
            raise
        logger.debug("SQLite journal_mode=WAL deferred: %s", exc)
    cursor.execute("PRAGMA foreign_keys=ON")
    cursor.close()


def _on_sqlite_begin(conn: Any) -> None:
    options = conn.get_execution_options()
    if options.get(SINGLE_STATEMENT):
        return  # the driver runs the statement in autocommit: one step, no lock upgrade
    if options.get(READ_ONLY):
        conn.exec_driver_sql("BEGIN")
    else:
        conn.exec_driver_sql("BEGIN IMMEDIATE")


def check_engine(engine: object, *, name: str = "engine") -> Dialect:
    """The dialect of ``engine`` if every langgraph-fence guarantee holds on it, else refuse.

    Every store that takes an engine (the lease store, the checkpointer, the execution
    records, the admin's sink engine) calls this in its constructor, before anything is
    written. A PostgreSQL engine of any configuration is accepted: the stores run their
    single statements in autocommit and their transactions at READ COMMITTED on it
    themselves. A SQLite engine must come from :func:`create_engine`: on a plain
    ``create_async_engine("sqlite+aiosqlite:///f.db")`` the driver opens a deferred
    transaction before each write and the pool rolls it back when the connection goes
    home, so a lease would be granted that was never stored (and two writers would both
    get it); nothing on such an engine can be fixed from outside without changing the
    transactions of the user's own code on it.

    Raises:
        ValueError: ``engine`` is not an ``AsyncEngine``, is for another database or
            driver, or is a SQLite engine not made by :func:`create_engine` (the message
            names ``langgraph_fence.database.create_engine``).
    """
    if not isinstance(engine, AsyncEngine):
        raise ValueError(
            f"{name} must be a SQLAlchemy AsyncEngine from "
            f"langgraph_fence.database.create_engine(url), got {type(engine).__name__}"
        )
    dialect = dialect_of(engine)
    if dialect == "sqlite" and not _configured_sqlite(engine):
        raise ValueError(
            f"{name} is a SQLite engine not made by langgraph_fence.database.create_engine: "
            "its driver begins deferred transactions that the pool rolls back, so leases "
            "and records would be reported written and never stored; build it with "
            "langgraph_fence.database.create_engine('sqlite+aiosqlite:///path.db') (it "
            "takes create_async_engine's options) and use that engine for your own "
            "statements too"
        )
    return dialect


def _configured_sqlite(engine: AsyncEngine) -> bool:
    # Read through the dispatchers (not event.contains): a view of the engine
    # (read_only, single_statement) shares its pool and joins its listeners.
    sync = engine.sync_engine
    return _on_sqlite_connect in list(sync.pool.dispatch.connect) and _on_sqlite_begin in list(
        sync.dispatch.begin
    )


def autocommit(engine: AsyncEngine) -> AsyncEngine:
    """``engine`` if its connections are in autocommit (PostgreSQL from :func:`create_engine`,
    or any SQLite one), else a view of it (same pool) in autocommit.

    A statement sent without BEGIN/COMMIT on a connection not in autocommit would be rolled
    back when the connection goes home.
    """
    from langgraph_fence._compat import sqlalchemy_engine_autocommit

    if engine.dialect.name != "postgresql" or sqlalchemy_engine_autocommit(engine):
        return engine
    return engine.execution_options(isolation_level="AUTOCOMMIT")


def read_only(engine: AsyncEngine) -> AsyncEngine:
    """A view of ``engine`` (same pool) for reads: on SQLite its transactions take no write lock.

    Only for connections that never write: a write in such a transaction may fail with
    "database is locked" instead of waiting.
    """
    return engine.execution_options(**{READ_ONLY: True})


def single_statement(engine: AsyncEngine) -> AsyncEngine:
    """A view of ``engine`` (same pool) whose every statement commits on its own.

    PostgreSQL engines are in autocommit already; on SQLite no ``BEGIN`` is sent, so a
    statement takes the write lock only for its own run (not for the three round trips of
    BEGIN, statement, COMMIT). Only for connections that run one statement per use.
    """
    return engine.execution_options(**{SINGLE_STATEMENT: True})


def own_pool(engine: AsyncEngine) -> AsyncEngine:
    """An engine on ``engine``'s database with a pool of its own (:func:`twin_engine`),
    disposed with ``engine``. For work that must not wait behind a busy pool (the keeper's
    renewals). PostgreSQL only: on SQLite every connection shares the file's one write lock
    anyway.
    """
    from sqlalchemy import event

    if engine.dialect.name != "postgresql":
        raise ValueError("own_pool is for PostgreSQL engines")
    own = twin_engine(engine)
    event.listen(engine.sync_engine, "engine_disposed", lambda _engine: own.sync_engine.dispose())
    return own


def twin_engine(engine: AsyncEngine) -> AsyncEngine:
    """A new engine on ``engine``'s database, connecting as ``engine`` does, with a pool of
    its own; the caller disposes of it.

    The same URL (password included) and the same connection recipe: ``pool.recreate()``
    keeps the pool's creator, so the ``connect_args`` it was made with (e.g. a
    ``server_settings`` search path) and its connect listeners (SQLite's pragmas) carry
    over, and so do its size limits (connections are opened only as they are used). In
    autocommit on PostgreSQL; on SQLite with ``BEGIN IMMEDIATE`` transactions, as from
    :func:`create_engine`. Its connections belong to the event loop that opens them, so an
    engine for another thread's loop is used, and disposed of, on that loop only.
    """
    from sqlalchemy.ext.asyncio import create_async_engine

    pool = engine.sync_engine.pool.recreate()
    if engine.dialect.name == "postgresql":
        twin = create_async_engine(engine.url, pool=pool, isolation_level="AUTOCOMMIT")
        configure_postgresql(twin)
        return twin
    twin = create_async_engine(engine.url, pool=pool)
    # The pool's connect listener came with its dispatch; the begin listener is the engine's.
    event.listen(twin.sync_engine, "begin", _on_sqlite_begin)
    return twin


def in_memory(engine: AsyncEngine) -> bool:
    """Whether ``engine`` is on an in-memory SQLite database: one that exists only in the
    connection its pool shares, which no other engine (nor another event loop) can reach."""
    if engine.dialect.name != "sqlite":
        return False
    return (
        _memory_url(engine.url)
        or "mode=memory" in str(engine.url)
        or isinstance(engine.sync_engine.pool, StaticPool)
    )


def _memory_url(url: URL) -> bool:
    """Whether a SQLite URL names an in-memory database (none, ``:memory:``, ``file::memory:``)."""
    database = url.database or ""
    return database in ("", ":memory:") or database.startswith("file::memory:")


def dialect_of(engine: AsyncEngine | AsyncConnection) -> Dialect:
    """``"sqlite"`` or ``"postgresql"``; refuses an engine of any other database."""
    name = engine.dialect.name
    if name == "sqlite":
        return "sqlite"
    if name == "postgresql":
        if engine.dialect.driver != "asyncpg":
            raise ValueError(
                f"engine uses the driver {engine.dialect.driver!r}; "
                f"langgraph-fence supports exactly two: {SUPPORTED}"
            )
        return "postgresql"
    raise ValueError(f"engine is for {name!r}; langgraph-fence supports exactly two: {SUPPORTED}")


async def discard(conn: AsyncConnection, *, server_lost: bool = False) -> None:
    """Close ``conn`` at the driver and drop it from its pool: a connection whose state a
    raw driver call left unknown (SQLAlchemy invalidates its own on a cancel or a
    disconnect, but does not see the checkpointer's raw asyncpg calls).

    With ``server_lost`` (a connection error on a raw driver call, which SQLAlchemy does
    not see) every connection the pool made before this one is recycled at its next
    checkout, as SQLAlchemy does itself for a disconnect it detects: after a server
    restart they are all dead, and an asyncpg connection the server shut down while idle
    fails its next use with "another operation is in progress".
    """
    from langgraph_fence._compat import sqlalchemy_recycle_pool

    try:
        if server_lost:
            fairy = await conn.get_raw_connection()
            sqlalchemy_recycle_pool(conn.sync_engine, fairy)
        await asyncio.shield(conn.invalidate())
    except Exception:
        logger.debug("could not invalidate a connection", exc_info=True)


@asynccontextmanager
async def transaction(engine: AsyncEngine) -> AsyncIterator[AsyncConnection]:
    """One multi-statement transaction, committed on success and rolled back on error.

    On PostgreSQL it runs at READ COMMITTED on a connection taken out of autocommit; on
    SQLite it starts with ``BEGIN IMMEDIATE``.
    """
    async with engine.connect() as conn:
        if conn.dialect.name == "postgresql":
            conn = await conn.execution_options(isolation_level="READ COMMITTED")
        async with conn.begin():
            yield conn


def schema_options(schema: str | None) -> dict[str, Any]:
    """The :func:`create_engine` options that put every PostgreSQL connection in
    ``schema`` (none or empty: ``{}``): ``{"schema": schema}``, for code that passes engine
    options on (``Instance.open(url, engine_options=...)``)."""
    if not schema:
        return {}
    text_id("schema", schema, what="the PostgreSQL schema every connection works in")
    return {"schema": schema}


def _in_schema(connect_args: Any, schema: str) -> dict[str, Any]:
    """asyncpg's ``connect_args`` with ``schema`` as the search_path of every connection."""
    args = dict(connect_args or {})
    settings = dict(args.get("server_settings") or {})
    if settings.get("search_path", schema) != schema:
        raise ValueError(
            f"schema={schema!r} and connect_args['server_settings']['search_path']="
            f"{settings['search_path']!r} both choose the schema: pass it once, as schema="
        )
    settings["search_path"] = schema
    args["server_settings"] = settings
    return args

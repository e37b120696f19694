"""An exactly-once sink for SQL databases: a high-water mark per scope key and idempotency keys.

A step that writes to a SQL database it owns can make that write exactly-once: inside the
user's own transaction, :func:`fenced_write` first raises the highest fencing token seen for
the step's scope key (refusing the write when a newer token was already seen there), then
claims the write's idempotency key (reporting a key applied before, with its stored result,
so the caller skips its write). The mark, the key row, the result and the user's own
statements commit or roll back together, on the user's connection: no second connection.

Guarantee: among writes made through this sink, for one ``(scope_key, idempotency_key)``,
exactly one transaction that commits applies the write; every other one either sees it
applied (and its result) or is refused because its token is stale. A write under token ``n``
never commits after a write under a token above ``n`` of the same scope key committed.

Limits: it covers only statements made on the same connection in the same transaction as
the sink's own, in the database that holds the sink's tables. An e-mail, an HTTP call or a
write to another database is not covered (use an idempotency key the other system checks,
or :class:`~langgraph_fence.Effect` ``NON_IDEMPOTENT_WRITE`` for at-most-once). The caller
must let errors out of the transaction so it rolls back. See ``docs/exactly-once.md``.
"""

from __future__ import annotations

import json
import logging
from collections.abc import AsyncIterator, Iterator
from contextlib import asynccontextmanager, contextmanager
from typing import Any

from sqlalchemy import Connection, text
from sqlalchemy.ext.asyncio import AsyncConnection, AsyncEngine

from langgraph_fence._compat import sqlalchemy_told_autocommit
from langgraph_fence.database import Dialect, dialect_of, transaction
from langgraph_fence.database.migrations import Migration, migrate
from langgraph_fence.errors import ExecutionFencedError
from langgraph_fence.fence import ExecutionFence, held_as_is
from langgraph_fence.validate import text_id

__all__ = [
    "CHECK_AND_RAISE_MARK_SQL",
    "CLAIM_KEY_SQL",
    "SINK_COMPONENT",
    "SINK_MIGRATIONS",
    "FencedWrite",
    "erase_results",
    "fenced_write",
    "fenced_write_sync",
    "is_serialization_failure",
    "setup_sink",
]

logger = logging.getLogger(__name__)

#: The component name of the sink's tables in ``fence_schema_versions``.
SINK_COMPONENT = "sink"

_CREATE_HIGH_WATER = """
CREATE TABLE IF NOT EXISTS fence_high_water (
    scope_key TEXT PRIMARY KEY,
    token BIGINT NOT NULL CHECK (token >= 1)
)
"""
_CREATE_APPLIED = """
CREATE TABLE IF NOT EXISTS fence_applied (
    scope_key TEXT NOT NULL,
    idempotency_key TEXT NOT NULL,
    token BIGINT NOT NULL CHECK (token >= 1),
    result TEXT,
    applied_at {applied_at},
    PRIMARY KEY (scope_key, idempotency_key)
)
"""

SINK_MIGRATIONS = [
    Migration(
        version=1,
        description="the high-water mark and applied-key tables of the exactly-once sink",
        sqlite=[
            _CREATE_HIGH_WATER,
            _CREATE_APPLIED.format(
                applied_at="TEXT NOT NULL DEFAULT (strftime('%Y-%m-%dT%H:%M:%fZ', 'now'))"
            ),
        ],
        postgresql=[
            _CREATE_HIGH_WATER,
            _CREATE_APPLIED.format(applied_at="TIMESTAMPTZ NOT NULL DEFAULT now()"),
        ],
    ),
]

#: Checks the token against the mark and raises the mark, in one statement (both dialects).
#: A row back: the token is at or above the mark, which is now the token. No row back: the
#: mark is above the token; the write is stale. On PostgreSQL the conflicting row is locked
#: either way until the transaction ends, so no newer writer can slip in before the commit.
CHECK_AND_RAISE_MARK_SQL = (
    "INSERT INTO fence_high_water (scope_key, token) VALUES (:scope_key, :token) "
    "ON CONFLICT (scope_key) DO UPDATE SET token = excluded.token "
    "WHERE fence_high_water.token <= excluded.token "
    "RETURNING token"
)
#: Claims the idempotency key (both dialects). A row back: this transaction applies the
#: write. No row back: a committed transaction (or this one) applied it already.
CLAIM_KEY_SQL = (
    "INSERT INTO fence_applied (scope_key, idempotency_key, token) "
    "VALUES (:scope_key, :idempotency_key, :token) "
    "ON CONFLICT (scope_key, idempotency_key) DO NOTHING "
    "RETURNING token"
)
_READ_MARK_SQL = text("SELECT token FROM fence_high_water WHERE scope_key = :scope_key")
_READ_KEY_SQL = text(
    "SELECT token, result FROM fence_applied "
    "WHERE scope_key = :scope_key AND idempotency_key = :idempotency_key"
)
_RECORD_SQL = text(
    "UPDATE fence_applied SET result = :result "
    "WHERE scope_key = :scope_key AND idempotency_key = :idempotency_key AND token = :token"
)
_RELEASE_SQL = text(
    "DELETE FROM fence_applied "
    "WHERE scope_key = :scope_key AND idempotency_key = :idempotency_key AND token = :token"
)

# SQLSTATEs a PostgreSQL transaction may fail with under contention, to be retried whole:
# serialization_failure and deadlock_detected.
_PG_RETRYABLE = frozenset({"40001", "40P01"})
# SQLITE_BUSY and SQLITE_BUSY_SNAPSHOT (a deferred transaction whose snapshot went stale).
_SQLITE_RETRYABLE = frozenset({5, 517})


async def setup_sink(engine_or_conn: AsyncEngine | AsyncConnection) -> int:
    """Create or upgrade the sink's tables on the user's database; return the schema version.

    Runs the ``"sink"`` component's migrations through
    :func:`langgraph_fence.database.migrations.migrate`: safe from several processes at once and a
    no-op when up to date. SQLite and PostgreSQL (SQLAlchemy async) are supported.

    Args:
        engine_or_conn: an engine, or a connection whose engine is used. The migration
            commits on a connection of its own, so a connection must not be inside a
            transaction (on SQLite that transaction would hold the lock the migration needs).

    Raises:
        TypeError: ``engine_or_conn`` is neither an ``AsyncEngine`` nor an ``AsyncConnection``.
        ValueError: the connection is inside a transaction, or the database is neither
            SQLite nor PostgreSQL.
    """
    if isinstance(engine_or_conn, AsyncConnection):
        if engine_or_conn.in_transaction():
            raise ValueError(
                "engine_or_conn is a connection inside a transaction; setup_sink migrates on a "
                "connection of its own and commits: call it before your transaction, or pass "
                "the engine"
            )
        engine = engine_or_conn.engine
    elif isinstance(engine_or_conn, AsyncEngine):
        engine = engine_or_conn
    else:
        raise TypeError(
            "engine_or_conn must be a SQLAlchemy AsyncEngine or AsyncConnection, got "
            f"{type(engine_or_conn).__name__}"
        )
    return await migrate(engine, SINK_COMPONENT, SINK_MIGRATIONS)


class FencedWrite:
    """What :func:`fenced_write` found for one write, and where the caller records its result.

    Attributes:
        scope_key: the scope key the mark and the key are kept under (the fence's).
        idempotency_key: the write's idempotency key.
        token: the fencing token the write runs under (the fence's, when the block began).
        applied: ``True`` when the key was applied before (by another writer, or earlier in
            this transaction): skip the write and use :attr:`result`.
        applied_token: the token the key was applied under, when :attr:`applied`.
        result: the stored result when :attr:`applied`; the recorded one after :meth:`record`.
    """

    __slots__ = (
        "_open",
        "_result_json",
        "applied",
        "applied_token",
        "idempotency_key",
        "result",
        "scope_key",
        "token",
    )

    def __init__(
        self,
        scope_key: str,
        idempotency_key: str,
        token: int,
        *,
        applied: bool,
        applied_token: int | None = None,
        result: Any = None,
    ) -> None:
        self.scope_key = scope_key
        self.idempotency_key = idempotency_key
        self.token = token
        self.applied = applied
        self.applied_token = applied_token
        self.result = result
        self._result_json: str | None = None
        self._open = True

    @property
    def recorded(self) -> bool:
        """Whether :meth:`record` was called in this block."""
        return self._result_json is not None

    def record(self, result: Any = None) -> None:
        """Record that this transaction applied the write, with ``result`` (JSON-serialisable).

        Call it after your own statements on the connection, inside the block. The key row
        gets the result when the block ends normally, in your transaction: a later writer of
        the same key sees :attr:`applied` and this result once your transaction commits.

        Raises:
            RuntimeError: the key was applied already (:attr:`applied`), :meth:`record` was
                called before, or the block has ended.
            ValueError: ``result`` is not JSON-serialisable (NaN and infinities included).
        """
        if not self._open:
            raise RuntimeError(
                f"write.record() was called after the fenced_write block of idempotency key "
                f"{self.idempotency_key!r} ended: call it inside the block"
            )
        if self.applied:
            raise RuntimeError(
                f"idempotency key {self.idempotency_key!r} of {self.scope_key!r} was applied "
                f"already (under token {self.applied_token}): write.applied is True, so skip "
                "your write and use write.result instead of calling write.record()"
            )
        if self._result_json is not None:
            raise RuntimeError(
                f"write.record() was called twice for idempotency key {self.idempotency_key!r}: "
                "record each write's result once"
            )
        try:
            encoded = json.dumps(result, allow_nan=False, separators=(",", ":"))
        except (TypeError, ValueError) as exc:
            raise ValueError(
                f"result must be JSON-serialisable (None, bool, int, float, str, list, dict "
                f"with str keys; no NaN): {exc}"
            ) from None
        self._result_json = encoded
        self.result = result

    def __repr__(self) -> str:
        state = "applied" if self.applied else ("recorded" if self.recorded else "claimed")
        return (
            f"<FencedWrite {self.scope_key} key={self.idempotency_key!r} "
            f"token={self.token} {state}>"
        )


@asynccontextmanager
async def fenced_write(
    conn: AsyncConnection, fence: ExecutionFence, idempotency_key: str
) -> AsyncIterator[FencedWrite]:
    """Fence one write made on ``conn`` inside the caller's transaction; exactly-once per key.

    Usage (``engine.begin()`` on an engine of your own; on one made by
    :func:`langgraph_fence.database.create_engine`, use ``transaction(engine)``)::

        async with engine.begin() as conn:
            async with fenced_write(conn, fence, f"charge:{order_id}") as write:
                if write.applied:
                    receipt = write.result
                else:
                    receipt = await charge(conn, order_id)  # statements on conn
                    write.record(receipt)

    On entry, before the caller's statements: (1) the token is checked against the
    high-water mark of ``fence.scope_key`` and the mark raised to it, in one statement;
    a mark above the token refuses the write with the error ``fence.fenced(mark)`` returns,
    which also stops the run's whole tree; (2) the idempotency key is claimed; a key applied
    before is reported through ``write.applied`` and ``write.result``. When the block ends
    normally the recorded result is stored with the key (``write.record`` only keeps it until
    then), and an error leaving the block withdraws the claim. Everything commits or rolls
    back with the caller's transaction.

    Guarantee: exactly-once for writes made through this sink on ``conn`` in the same
    transaction; a token equal to the mark passes and the mark never goes down. Keyed by
    scope key: an ``ANY_INSTANCE`` child (own execution, own epochs) has a mark of its own.
    Limits: an effect outside this database is not covered; a caught error must still roll
    the transaction back. Under contention on PostgreSQL at REPEATABLE READ or SERIALIZABLE,
    and on SQLite without ``BEGIN IMMEDIATE``, the database may fail the transaction
    instead of waiting (see :func:`is_serialization_failure`): retry the whole transaction.
    On PostgreSQL the mark's row stays locked until the transaction ends, so writers of one
    scope key queue behind each other: keep the transaction short.

    Args:
        conn: the caller's connection, inside a transaction (``async with conn.begin()``),
            not in AUTOCOMMIT.
        fence: the step's fence (``get_execution_context().fence``).
        idempotency_key: names the write within the execution: the same key for every
            attempt of the same write, a different one for every different write.

    Raises:
        ExecutionFencedError: the mark is above the fence's token (the run was taken over).
        ExecutionLeaseLostError: the fence's run is known to be fenced, or its hold can no
            longer be proven (checked first, without I/O).
        ExecutionContextUnavailableError: the fence's step has ended, the write is made
            inside another step (an ancestor's fence in a child step), or the step's lease
            is yielded now by its wait for remote children (open the transaction inside
            ``async with get_execution_context().side_effect():``): nothing written.
        TypeError: an argument has the wrong type.
        ValueError: ``idempotency_key`` is empty or holds a NUL, or ``conn`` is not inside a
            transaction, is in AUTOCOMMIT, or is not SQLite or PostgreSQL.
        RuntimeError: the block ended normally without ``write.record(...)`` or a skip of an
            applied key.
    """
    await _check_arguments(conn, fence, idempotency_key)
    # Counted among the tree's running parts until the block ends: no yield of a wait of
    # this step for remote children (another task of it) lands while the write is made. A
    # lease yielded already is refused, not taken again: the caller's transaction is open,
    # and on SQLite a re-take would wait for its write lock.
    with held_as_is(fence, "fenced_write()"):
        async with _fenced_block(conn, fence, idempotency_key) as write:
            yield write


@asynccontextmanager
async def _fenced_block(
    conn: AsyncConnection, fence: ExecutionFence, idempotency_key: str
) -> AsyncIterator[FencedWrite]:
    """The sink's statements around the caller's block (see :func:`fenced_write`)."""
    fence.assert_held()
    scope = fence.scope_key
    # The token is read once: the mark, the key row and a refusal all speak of this one.
    token = fence.token
    params: dict[str, Any] = {
        "scope_key": scope,
        "idempotency_key": idempotency_key,
        "token": token,
    }
    raised = (await conn.execute(text(CHECK_AND_RAISE_MARK_SQL), params)).first()
    if raised is None:
        mark = (await conn.execute(_READ_MARK_SQL, params)).scalar_one()
        raise _refusal(fence, token, int(mark), idempotency_key)
    claimed = (await conn.execute(text(CLAIM_KEY_SQL), params)).first()
    if claimed is None:
        # A committed transaction (or this one, earlier) applied the key. At READ COMMITTED
        # this read sees the committed row: the claim above waited for any writer of the key
        # still in flight (and the mark's row lock queued writers of this scope before it).
        row = (await conn.execute(_READ_KEY_SQL, params)).one()
        stored = None if row.result is None else json.loads(row.result)
        logger.debug(
            "%s key %r applied already under token %s; skipping", scope, idempotency_key, row.token
        )
        write = FencedWrite(
            scope, idempotency_key, token, applied=True, applied_token=int(row.token), result=stored
        )
        try:
            yield write
        finally:
            write._open = False
        return
    write = FencedWrite(scope, idempotency_key, token, applied=False)
    try:
        yield write
    except BaseException:
        write._open = False
        await _release_claim(conn, params)
        raise
    write._open = False
    if write._result_json is None:
        await _release_claim(conn, params)
        raise RuntimeError(
            f"the fenced_write block of idempotency key {idempotency_key!r} ended without "
            "write.record(...): call write.record(result) after your statements "
            "(write.record(None) when there is no result), or raise to abandon the write"
        )
    updated = await conn.execute(_RECORD_SQL, {**params, "result": write._result_json})
    if updated.rowcount != 1:  # pragma: no cover - the row was inserted in this transaction
        raise RuntimeError(
            f"the claim of idempotency key {idempotency_key!r} of {scope!r} vanished inside "
            "its own transaction: something else on this connection deleted it"
        )


def _check_idempotency_key(idempotency_key: object) -> None:
    text_id(
        "idempotency_key",
        idempotency_key,
        what="names the write: the same for every attempt of it",
    )


async def _check_arguments(conn: object, fence: object, idempotency_key: object) -> None:
    if not isinstance(fence, ExecutionFence):
        raise TypeError(
            "fence must be an ExecutionFence (get_execution_context().fence inside a step), "
            f"got {type(fence).__name__}"
        )
    _check_idempotency_key(idempotency_key)
    if not isinstance(conn, AsyncConnection):
        raise TypeError(
            "conn must be a SQLAlchemy AsyncConnection inside your transaction, got "
            f"{type(conn).__name__}"
        )
    dialect = dialect_of(conn)
    if not conn.in_transaction():
        raise ValueError(
            "conn is not in a transaction: call fenced_write inside `async with conn.begin():` "
            "so the sink's rows commit or roll back with your own statements"
        )
    if await _is_autocommit(conn, dialect):
        raise ValueError(
            "conn is in AUTOCOMMIT: each statement would commit on its own and nothing would "
            "roll back together; take the connection out of it before conn.begin() "
            "(`conn = await conn.execution_options(isolation_level='READ COMMITTED')` on "
            "PostgreSQL), or use langgraph_fence.database.transaction(engine)"
        )


async def _is_autocommit(conn: AsyncConnection, dialect: Dialect) -> bool:
    # What SQLAlchemy was told (an execution option, or the engine's isolation_level).
    sync = conn.sync_connection
    if sync is not None and sqlalchemy_told_autocommit(sync):
        return True
    # What the driver does (an autocommit set on the raw connection behind SQLAlchemy's back).
    fairy = await conn.get_raw_connection()
    raw: Any = fairy.dbapi_connection
    if dialect == "postgresql":
        return bool(conn.dialect.detect_autocommit_setting(raw))
    # isolation_level None: the driver opens no transaction of its own, so one must be open
    # now (langgraph_fence's engines send BEGIN IMMEDIATE when SQLAlchemy begins).
    return raw.isolation_level is None and (
        getattr(fairy.driver_connection, "in_transaction", None) is False
    )


def _refusal(
    fence: ExecutionFence, token: int, mark: int, idempotency_key: str
) -> ExecutionFencedError:
    if mark > fence.token:
        return fence.fenced(mark)
    # The run itself moved to a newer token while this write was in flight (the
    # remote-children wait re-took the lease): this write is stale, the run is not.
    return ExecutionFencedError(
        f"the write of idempotency key {idempotency_key!r} of execution {fence.scope_key!r} was "
        f"made under token {token}, but the sink has seen token {mark}, which this run now "
        "holds: retry the write under the current token",
        scope_key=fence.scope_key,
        token_held=token,
        token_seen=mark,
    )


async def _release_claim(conn: AsyncConnection, params: dict[str, Any]) -> None:
    # The block did not apply the write: drop the claim so that a transaction committed
    # anyway (an error caught inside it) does not report the key applied. A failed
    # PostgreSQL transaction refuses the DELETE; it can only roll back then, claim and all.
    try:
        await conn.execute(_RELEASE_SQL, params)
    except Exception as exc:  # secondary to the error or refusal being raised
        logger.debug(
            "could not release the claim of %s key %r (the transaction will roll back): %s",
            params["scope_key"],
            params["idempotency_key"],
            exc,
        )


async def erase_results(engine: AsyncEngine, scope_key: str) -> int:
    """Delete every stored result (applied key) of ``scope_key``; return how many.

    For an erasure: the results may hold what the write was about. The high-water mark row
    of the scope key stays: it holds the scope key and a token, no result, and a write made
    later under a token below it must still be refused. A database without the sink's
    tables has nothing to erase (0).
    """
    async with engine.connect() as conn:
        versions = await conn.execute(
            text("SELECT 1 FROM fence_schema_versions WHERE component = :c"),
            {"c": SINK_COMPONENT},
        )
        if versions.first() is None:
            return 0
    async with transaction(engine) as conn:
        result = await conn.execute(
            text("DELETE FROM fence_applied WHERE scope_key = :scope_key"), {"scope_key": scope_key}
        )
    return int(result.rowcount)


def is_serialization_failure(exc: BaseException) -> bool:
    """Whether ``exc`` says the database failed the transaction under contention: retry it.

    True for PostgreSQL's ``serialization_failure`` (40001, e.g. at REPEATABLE READ or
    SERIALIZABLE when another writer of the same scope key committed first) and
    ``deadlock_detected`` (40P01), and for SQLite's ``SQLITE_BUSY`` / ``SQLITE_BUSY_SNAPSHOT``
    (a deferred transaction that could not take the write lock). Looks through ``__cause__``
    and SQLAlchemy's ``orig``.
    """
    seen: set[int] = set()
    current: BaseException | None = exc
    while current is not None and id(current) not in seen:
        seen.add(id(current))
        if getattr(current, "sqlstate", None) in _PG_RETRYABLE:
            return True
        if getattr(current, "sqlite_errorcode", None) in _SQLITE_RETRYABLE:
            return True
        orig = getattr(current, "orig", None)
        current = orig if isinstance(orig, BaseException) else current.__cause__
    return False


# -- the same sink on a sync connection (sync nodes and tools, in LangGraph's worker threads)


@contextmanager
def fenced_write_sync(
    conn: Connection, fence: ExecutionFence, idempotency_key: str
) -> Iterator[FencedWrite]:
    """:func:`fenced_write` on a sync SQLAlchemy ``Connection``: exactly-once per key.

    For sync nodes and sync tools writing with a sync engine (the stdlib ``sqlite3`` driver,
    or PostgreSQL through ``psycopg``), inside the user's own transaction::

        with engine.begin() as conn:
            with fenced_write_sync(conn, fence, f"charge:{order_id}") as write:
                if write.applied:
                    receipt = write.result
                else:
                    receipt = charge(conn, order_id)  # statements on conn
                    write.record(receipt)

    The same statements as :func:`fenced_write`, in the same order, with the same guarantee
    and limits: the token is checked against the high-water mark and the mark raised in one
    statement (a newer mark refuses the write and stops the run's tree), the key is claimed,
    the result stored when the block ends normally, the claim withdrawn when an error leaves
    it; everything commits or rolls back with the caller's transaction. The tables are the
    ones :func:`setup_sink` creates (run it once, from async code, on the same database).

    Args:
        conn: the caller's sync connection, inside a transaction (``engine.begin()`` or
            ``conn.begin()``), not in AUTOCOMMIT.
        fence: the step's fence (``get_execution_context().fence``).
        idempotency_key: names the write within the execution (see :func:`fenced_write`).

    Raises:
        What :func:`fenced_write` raises; ``TypeError`` when ``conn`` is not a sync
        ``Connection`` (use :func:`fenced_write` for an ``AsyncConnection``), and
        ``ValueError`` for a PostgreSQL driver other than ``psycopg``.
    """
    _check_sync_arguments(conn, fence, idempotency_key)
    with (
        held_as_is(fence, "fenced_write_sync()"),
        _fenced_block_sync(conn, fence, idempotency_key) as write,
    ):
        yield write


@contextmanager
def _fenced_block_sync(
    conn: Connection, fence: ExecutionFence, idempotency_key: str
) -> Iterator[FencedWrite]:
    """The sink's statements around the caller's block (see :func:`fenced_write_sync`)."""
    fence.assert_held()
    scope = fence.scope_key
    token = fence.token  # read once: the mark, the key row and a refusal speak of this one
    params: dict[str, Any] = {
        "scope_key": scope,
        "idempotency_key": idempotency_key,
        "token": token,
    }
    if conn.execute(text(CHECK_AND_RAISE_MARK_SQL), params).first() is None:
        mark = conn.execute(_READ_MARK_SQL, params).scalar_one()
        raise _refusal(fence, token, int(mark), idempotency_key)
    if conn.execute(text(CLAIM_KEY_SQL), params).first() is None:
        # Applied before, by a committed transaction or this one (see fenced_write).
        row = conn.execute(_READ_KEY_SQL, params).one()
        stored = None if row.result is None else json.loads(row.result)
        logger.debug(
            "%s key %r applied already under token %s; skipping", scope, idempotency_key, row.token
        )
        write = FencedWrite(
            scope, idempotency_key, token, applied=True, applied_token=int(row.token), result=stored
        )
        try:
            yield write
        finally:
            write._open = False
        return
    write = FencedWrite(scope, idempotency_key, token, applied=False)
    try:
        yield write
    except BaseException:
        write._open = False
        _release_claim_sync(conn, params)
        raise
    write._open = False
    if write._result_json is None:
        _release_claim_sync(conn, params)
        raise RuntimeError(
            f"the fenced_write_sync block of idempotency key {idempotency_key!r} ended without "
            "write.record(...): call write.record(result) after your statements "
            "(write.record(None) when there is no result), or raise to abandon the write"
        )
    updated = conn.execute(_RECORD_SQL, {**params, "result": write._result_json})
    if updated.rowcount != 1:  # pragma: no cover - the row was inserted in this transaction
        raise RuntimeError(
            f"the claim of idempotency key {idempotency_key!r} of {scope!r} vanished inside "
            "its own transaction: something else on this connection deleted it"
        )


#: The sync PostgreSQL driver the sync sink is tested with.
_SYNC_PG_DRIVERS = frozenset({"psycopg"})


def _check_sync_arguments(conn: object, fence: object, idempotency_key: object) -> None:
    if not isinstance(fence, ExecutionFence):
        raise TypeError(
            "fence must be an ExecutionFence (get_execution_context().fence inside a step), "
            f"got {type(fence).__name__}"
        )
    _check_idempotency_key(idempotency_key)
    if isinstance(conn, AsyncConnection):
        raise TypeError(
            "conn is an AsyncConnection: use `async with fenced_write(conn, ...)` in async "
            "code; fenced_write_sync takes a sync Connection"
        )
    if not isinstance(conn, Connection):
        raise TypeError(
            "conn must be a SQLAlchemy Connection inside your transaction, got "
            f"{type(conn).__name__}"
        )
    name, driver = conn.dialect.name, conn.dialect.driver
    if name == "postgresql" and driver not in _SYNC_PG_DRIVERS:
        raise ValueError(
            f"conn uses the PostgreSQL driver {driver!r}; the sync sink supports psycopg "
            "(postgresql+psycopg://...): install psycopg[binary] and use that URL"
        )
    if name not in ("sqlite", "postgresql"):
        raise ValueError(f"conn is for {name!r}; the sink supports SQLite and PostgreSQL")
    if not conn.in_transaction():
        raise ValueError(
            "conn is not in a transaction: call fenced_write_sync inside `with engine.begin() "
            "as conn:` (or `with conn.begin():`) so the sink's rows commit or roll back with "
            "your own statements"
        )
    if _is_autocommit_sync(conn, name):
        raise ValueError(
            "conn is in AUTOCOMMIT: each statement would commit on its own and nothing would "
            "roll back together; take the connection out of it before conn.begin() "
            "(`conn.execution_options(isolation_level='READ COMMITTED')` on PostgreSQL)"
        )


def _is_autocommit_sync(conn: Connection, dialect: str) -> bool:
    if sqlalchemy_told_autocommit(conn):
        return True
    fairy = conn.connection
    raw: Any = fairy.dbapi_connection
    if dialect == "postgresql":
        return bool(conn.dialect.detect_autocommit_setting(raw))
    # sqlite3 with isolation_level None opens no transaction of its own (see fenced_write).
    return raw.isolation_level is None and (
        getattr(fairy.driver_connection, "in_transaction", None) is False
    )


def _release_claim_sync(conn: Connection, params: dict[str, Any]) -> None:
    # As _release_claim: a failed PostgreSQL transaction refuses the DELETE and rolls back.
    try:
        conn.execute(_RELEASE_SQL, params)
    except Exception as exc:  # secondary to the error or refusal being raised
        logger.debug(
            "could not release the claim of %s key %r (the transaction will roll back): %s",
            params["scope_key"],
            params["idempotency_key"],
            exc,
        )

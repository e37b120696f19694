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

from collections.abc import AsyncIterator, Iterator
from contextlib import asynccontextmanager, contextmanager

from sqlalchemy import Connection
from sqlalchemy.ext.asyncio import AsyncConnection

from langgraph_fence.fence import ExecutionFence, held_as_is
from langgraph_fence.sinks._checks import check_arguments, check_sync_arguments
from langgraph_fence.sinks._tables import (
    CHECK_AND_RAISE_MARK_SQL,
    CLAIM_KEY_SQL,
    SINK_COMPONENT,
    SINK_MIGRATIONS,
    erase_results,
    setup_sink,
)
from langgraph_fence.sinks._write import FencedWrite, fenced_block, fenced_block_sync

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

# SQLSTATEs a PostgreSQL transaction may fail with under contention, to be retried whole:
# serialization_failure and deadlock_detected.
_PG_RETRYABLE = frozenset({"40001", "40P01"})
# SQLITE_BUSY and SQLITE_BUSY_SNAPSHOT (a deferred transaction whose snapshot went stale).
_SQLITE_RETRYABLE = frozenset({5, 517})


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
    await check_arguments(conn, fence, idempotency_key)
    # Counted among the tree's running parts until the block ends: no yield of a wait of
    # this step for remote children (another task of it) lands while the write is made. A
    # lease yielded already is refused, not taken again: the caller's transaction is open,
    # and on SQLite a re-take would wait for its write lock.
    with held_as_is(fence, "fenced_write()"):
        async with fenced_block(conn, fence, idempotency_key) as write:
            yield write


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
    check_sync_arguments(conn, fence, idempotency_key)
    with (
        held_as_is(fence, "fenced_write_sync()"),
        fenced_block_sync(conn, fence, idempotency_key) as write,
    ):
        yield write


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

"""The sink's statements around the caller's block, defined once for both faces.

Raise the mark and claim the key on entry, store the recorded result (or withdraw the claim)
on exit: functions of a sync SQLAlchemy ``Connection``. The sync face calls them on the
caller's connection; the async face runs the very same functions on its ``AsyncConnection``
through ``run_sync``, as SQLAlchemy runs every async statement: the same statements, in the
same order, on the same connection and transaction.
"""

from __future__ import annotations

import json
import logging
from collections.abc import AsyncIterator, Iterator
from contextlib import asynccontextmanager, contextmanager
from dataclasses import dataclass, field
from typing import Any

from sqlalchemy import Connection, text
from sqlalchemy.ext.asyncio import AsyncConnection

from langgraph_fence.errors import ExecutionFencedError
from langgraph_fence.fence import ExecutionFence
from langgraph_fence.sinks._tables import (
    CHECK_AND_RAISE_MARK_SQL,
    CLAIM_KEY_SQL,
    READ_KEY_SQL,
    READ_MARK_SQL,
    RECORD_SQL,
    RELEASE_SQL,
)

__all__ = ["FencedWrite", "fenced_block", "fenced_block_sync"]

logger = logging.getLogger("langgraph_fence.sinks")


@dataclass(slots=True, eq=False, repr=False)
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

    scope_key: str
    idempotency_key: str
    token: int
    applied: bool = field(kw_only=True)
    applied_token: int | None = field(default=None, kw_only=True)
    result: Any = field(default=None, kw_only=True)
    _result_json: str | None = field(default=None, init=False)
    _open: bool = field(default=True, init=False)

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

    def _params(self) -> dict[str, Any]:
        return {
            "scope_key": self.scope_key,
            "idempotency_key": self.idempotency_key,
            "token": self.token,
        }

    def _close(self) -> bool:
        """End the block; whether a claim of this block is left to settle (not applied)."""
        self._open = False
        return not self.applied


def _begin(conn: Connection, fence: ExecutionFence, idempotency_key: str) -> FencedWrite:
    """Check the token against the mark and raise the mark, then claim the key: the write,
    ``applied`` (with its result) when the key was applied before; a mark above the token
    refuses it, with nothing claimed."""
    fence.assert_held()
    # The token is read once: the mark, the key row and a refusal all speak of this one.
    write = FencedWrite(fence.scope_key, idempotency_key, fence.token, applied=False)
    params = write._params()
    if conn.execute(text(CHECK_AND_RAISE_MARK_SQL), params).first() is None:
        mark = conn.execute(READ_MARK_SQL, params).scalar_one()
        raise _refusal(fence, write, int(mark))
    if conn.execute(text(CLAIM_KEY_SQL), params).first() is None:
        # A committed transaction (or this one, earlier) applied the key. At READ COMMITTED
        # this read sees the committed row: the claim above waited for any writer of the key
        # still in flight (and the mark's row lock queued writers of this scope before it).
        row = conn.execute(READ_KEY_SQL, params).one()
        stored = None if row.result is None else json.loads(row.result)
        logger.debug(
            "%s key %r applied already under token %s; skipping",
            write.scope_key,
            write.idempotency_key,
            row.token,
        )
        write.applied, write.applied_token, write.result = True, int(row.token), stored
    return write


def _refusal(fence: ExecutionFence, write: FencedWrite, mark: int) -> ExecutionFencedError:
    if mark > fence.token:
        return fence.fenced(mark)
    # The run itself moved to a newer token while this write was in flight (the
    # remote-children wait re-took the lease): this write is stale, the run is not.
    return ExecutionFencedError(
        f"the write of idempotency key {write.idempotency_key!r} of execution "
        f"{fence.scope_key!r} was made under token {write.token}, but the sink has seen token "
        f"{mark}, which this run now holds: retry the write under the current token",
        scope_key=fence.scope_key,
        token_held=write.token,
        token_seen=mark,
    )


def _release(conn: Connection, write: FencedWrite) -> None:
    # The block did not apply the write: drop the claim so that a transaction committed
    # anyway (an error caught inside it) does not report the key applied. A failed
    # PostgreSQL transaction refuses the DELETE; it can only roll back then, claim and all.
    try:
        conn.execute(RELEASE_SQL, write._params())
    except Exception as exc:  # secondary to the error or refusal being raised
        logger.debug(
            "could not release the claim of %s key %r (the transaction will roll back): %s",
            write.scope_key,
            write.idempotency_key,
            exc,
        )


def _end(conn: Connection, write: FencedWrite, face: str, *, failed: bool) -> None:
    """The block of ``face`` ended (``failed``: by an error): withdraw the claim, or store
    the recorded result with the key (withdrawing it and raising when nothing was recorded).
    A key applied before has no claim of this block to settle."""
    if not write._close():
        return
    if failed:
        _release(conn, write)
        return
    if write._result_json is None:
        _release(conn, write)
        raise RuntimeError(
            f"the {face} block of idempotency key {write.idempotency_key!r} ended without "
            "write.record(...): call write.record(result) after your statements "
            "(write.record(None) when there is no result), or raise to abandon the write"
        )
    updated = conn.execute(RECORD_SQL, {**write._params(), "result": write._result_json})
    if updated.rowcount != 1:  # pragma: no cover - the row was inserted in this transaction
        raise RuntimeError(
            f"the claim of idempotency key {write.idempotency_key!r} of {write.scope_key!r} "
            "vanished inside its own transaction: something else on this connection deleted it"
        )


@asynccontextmanager
async def fenced_block(
    conn: AsyncConnection, fence: ExecutionFence, idempotency_key: str
) -> AsyncIterator[FencedWrite]:
    """The sink's statements around the caller's block (see :func:`fenced_write`)."""
    write = await conn.run_sync(_begin, fence, idempotency_key)
    try:
        yield write
    except BaseException:
        await conn.run_sync(_end, write, "fenced_write", failed=True)
        raise
    await conn.run_sync(_end, write, "fenced_write", failed=False)


@contextmanager
def fenced_block_sync(
    conn: Connection, fence: ExecutionFence, idempotency_key: str
) -> Iterator[FencedWrite]:
    """The same statements on a sync connection (see :func:`fenced_write_sync`)."""
    write = _begin(conn, fence, idempotency_key)
    try:
        yield write
    except BaseException:
        _end(conn, write, "fenced_write_sync", failed=True)
        raise
    _end(conn, write, "fenced_write_sync", failed=False)

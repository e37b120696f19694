"""The journal: what happened to each execution's lease, for the humans who ask later.

``fence_journal`` holds one row per turn an instance saw (a take at a token, a takeover, a
refused stale write, a lost hold, a dead letter, a hand-back, a yield and a re-take) and per
operator action (a dead letter retried or abandoned, with who and why). The operator's
console draws an execution's token timeline from it, beside the tokens its checkpoints
carry; ``/metrics`` counts takeovers and refused writes from it.

The journal is a record, not a fence: no decision reads it, and it is written after the
fact, in batches, off the run's path. A database out of reach delays it (it is kept, up to
:data:`PENDING_LIMIT` entries, then the oldest are dropped and counted); it never delays or
fails a run. Erasing an execution erases its entries.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from sqlalchemy import BigInteger, Column, Double, Index, Table, Text, insert, select

from langgraph_fence.events import EventKind, FenceEvent
from langgraph_fence.lease.schema import metadata
from langgraph_fence.lease.scope import parse_scope_key
from langgraph_fence.redact import bounded_reason, failure_reason

if TYPE_CHECKING:
    from sqlalchemy.ext.asyncio import AsyncConnection, AsyncEngine

    from langgraph_fence.lease import Lease, LeaseKey
    from langgraph_fence.lease.sql import SqlLeaseRepository

__all__ = [
    "JOURNAL",
    "JOURNALED",
    "PENDING_LIMIT",
    "Journal",
    "JournalEntry",
    "read_journal",
    "record_action",
    "resolve",
]

logger = logging.getLogger("langgraph_fence.journal")

#: ``fence_journal`` (created by lease migration 8).
JOURNAL = Table(
    "fence_journal",
    metadata,
    Column("tenant_id", Text, nullable=False),
    Column("execution_id", Text, nullable=False),
    Column("at", Double, nullable=False),
    Column("kind", Text, nullable=False),
    Column("epoch", BigInteger),
    Column("holder", Text),
    Column("detail", Text),
    Column("actor", Text),
    Index("fence_journal_execution", "tenant_id", "execution_id", "at"),
    Index("fence_journal_kind", "kind"),
)

#: The event kinds an instance journals: each turn of a lease's life but ``renewed_late``
#: (one per lease per late renewal: the instances page and ``/metrics`` show lateness per
#: instance instead).
JOURNALED = frozenset(EventKind) - {EventKind.RENEWED_LATE}
#: Entries kept while the database cannot be written; past it the oldest are dropped.
PENDING_LIMIT = 10_000
#: How long after a write the writer gathers entries before the next, in seconds.
GATHER = 1.0
#: How long closing waits for the last entries to be written, in seconds.
CLOSE_WAIT = 2.0
#: Entries written per statement.
_BATCH = 500
#: The longest detail kept, in characters.
_DETAIL_MAX = 1_000


@dataclass(frozen=True, slots=True)
class JournalEntry:
    """One row of the journal.

    Attributes:
        at: when, in seconds since the epoch, on the writer's clock.
        kind: an :class:`~langgraph_fence.EventKind` value, or ``retried`` / ``abandoned``
            for an operator's action.
        epoch: the token it is about (``None``: none applies).
        holder: the instance that saw it (for an action: ``None``).
        detail: why, in words, redacted as stored reasons are.
        actor: who acted (operator actions only).
    """

    at: float
    kind: str
    epoch: int | None
    holder: str | None
    detail: str | None
    actor: str | None = None


def _detail(text: str | None) -> str | None:
    return None if text is None else bounded_reason(text)[:_DETAIL_MAX]


class Journal:
    """An instance's listener that writes its events to ``fence_journal`` (see the module).

    Call it with events on the instance's event loop; :meth:`aclose` writes what is left.
    """

    def __init__(self, engine: AsyncEngine, *, own_pool: bool = False) -> None:
        """Journal to ``engine``'s database; with ``own_pool``, through a pool of its own
        (closed with the journal): the runs' connections never wait behind it, nor see its
        statements. An in-memory SQLite database is written through ``engine`` itself."""
        from langgraph_fence.database import autocommit, in_memory, single_statement, twin_engine

        self._engine = twin_engine(engine) if own_pool and not in_memory(engine) else engine
        self._owned = self._engine is not engine
        self._writer = single_statement(autocommit(self._engine))
        self._pending: deque[dict[str, Any]] = deque()
        self._wake = asyncio.Event()
        self._task: asyncio.Task[None] | None = None
        # One batch at a time: the background writer and flush() never write one twice.
        self._writing = asyncio.Lock()
        self._closing = False
        self._closed = asyncio.Event()
        #: Entries dropped because the database stayed out of reach (see the module).
        self.dropped = 0

    def __call__(self, event: FenceEvent) -> None:
        if event.kind not in JOURNALED:
            return
        try:
            tenant_id, execution_id = parse_scope_key(event.scope_key)[:2]
        except ValueError:
            return
        self._pending.append(
            {
                "tenant_id": tenant_id,
                "execution_id": execution_id,
                "at": event.at or time.time(),
                "kind": event.kind.value,
                "epoch": event.token,
                "holder": event.holder,
                "detail": _detail(event.reason),
                "actor": None,
            }
        )
        if len(self._pending) > PENDING_LIMIT:
            self._pending.popleft()
            self.dropped += 1
        if self._task is None:
            self._task = asyncio.get_running_loop().create_task(
                self._write_forever(), name="langgraph-fence journal"
            )
        self._wake.set()

    async def _write_forever(self) -> None:
        failures = 0
        written_at = -GATHER
        while not self._closing:
            await self._wake.wait()
            # The first entry after a quiet spell is written at once (a process killed a
            # moment later still leaves it); a burst after it is gathered and written in
            # one statement, at most one a GATHER: on SQLite every write takes the one
            # write lock the runs wait for.
            quiet_for = time.monotonic() - written_at
            if quiet_for < GATHER:
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(self._closed.wait(), GATHER - quiet_for)
            self._wake.clear()
            written_at = time.monotonic()
            while self._pending:
                try:
                    await self._write_batch()
                    failures = 0
                except Exception as exc:
                    failures += 1
                    logger.warning(
                        "the journal could not be written (%s); %d entries kept, trying again",
                        failure_reason(exc),
                        len(self._pending),
                    )
                    await asyncio.sleep(min(0.5 * 2**failures, 10.0))

    async def _write_batch(self) -> None:
        async with self._writing:
            batch = [self._pending[i] for i in range(min(_BATCH, len(self._pending)))]
            if not batch:
                return
            # One statement, committed on its own: on SQLite no transaction holds the write
            # lock across an await of this loop (a loop blocked then would block every
            # writer of the file, the renewer thread's renewals included).
            async with self._writer.begin() as conn:
                await conn.execute(insert(JOURNAL).values(batch))
            # Written: drop them (new ones were appended behind; some of these may have
            # been dropped meanwhile, over the limit).
            for entry in batch:
                if self._pending and self._pending[0] is entry:
                    self._pending.popleft()

    async def flush(self) -> None:
        """Write every entry kept so far (raises what the database raised)."""
        while self._pending:
            await self._write_batch()

    async def aclose(self) -> None:
        """Stop writing in the background once the batch in flight is written; write what
        is kept, for at most :data:`CLOSE_WAIT` seconds in all."""
        self._closing = True
        self._closed.set()
        self._wake.set()
        if self._task is not None:
            try:
                # Not cancelled mid-write: a batch cancelled during its COMMIT could be
                # written again by the flush below.
                await asyncio.wait_for(asyncio.shield(self._task), CLOSE_WAIT)
            except TimeoutError:
                self._task.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await self._task
            self._task = None
        try:
            await asyncio.wait_for(self.flush(), CLOSE_WAIT)
        except Exception as exc:
            if self._pending:
                logger.warning(
                    "the journal lost %d entries at close (%s)",
                    len(self._pending),
                    failure_reason(exc),
                )
        finally:
            if self._owned:
                await self._engine.dispose()


async def record_action(
    conn: AsyncConnection,
    tenant_id: str,
    execution_id: str,
    *,
    kind: str,
    epoch: int | None,
    actor: str,
    note: str | None,
) -> None:
    """Journal an operator's action on an execution, in ``conn``'s transaction."""
    await conn.execute(
        insert(JOURNAL),
        {
            "tenant_id": tenant_id,
            "execution_id": execution_id,
            "at": time.time(),
            "kind": kind,
            "epoch": epoch,
            "holder": None,
            "detail": _detail(note),
            "actor": actor[:200],
        },
    )


async def read_journal(
    conn: AsyncConnection, tenant_id: str, execution_id: str, *, limit: int = 500
) -> Sequence[JournalEntry]:
    """The newest ``limit`` entries of one execution, oldest first."""
    c = JOURNAL.c
    query = (
        select(c.at, c.kind, c.epoch, c.holder, c.detail, c.actor)
        .where(c.tenant_id == tenant_id, c.execution_id == execution_id)
        .order_by(c.at.desc())
        .limit(limit)
    )
    rows = (await conn.execute(query)).all()
    return [JournalEntry(*row) for row in reversed(rows)]


async def resolve(
    repository: SqlLeaseRepository,
    key: LeaseKey,
    *,
    abandon: bool,
    note: str | None,
    actor: str,
) -> Lease:
    """Resolve a dead-lettered (or cancelled) execution as an operator: retry it (pending
    again, its takeover budget reset) or, with ``abandon``, end it ``failed`` with ``note``
    as its reason; then journal the action with ``actor`` and ``note``.

    The rules are :meth:`~langgraph_fence.SqlLeaseRepository.retry` and
    :meth:`~langgraph_fence.SqlLeaseRepository.abandon`'s (``ValueError`` naming why it
    cannot be resolved; ``KeyError``: no such execution). The action is journaled after the
    lease changed: a journal that cannot be written is logged, and the resolve stands.
    """
    if abandon:
        if note is None or not note.strip():
            raise ValueError("abandoning needs a note: what was checked, and by whom")
        lease = await repository.abandon(key, note)
    else:
        lease = await repository.retry(key)
    try:
        async with repository.engine.begin() as conn:
            await record_action(
                conn,
                key.tenant_id,
                key.execution_id,
                kind="abandoned" if abandon else "retried",
                epoch=lease.epoch,
                actor=actor,
                note=note,
            )
    except Exception as exc:
        logger.warning(
            "%s %s, but the journal could not say so (%s)",
            "abandoned" if abandon else "retried",
            key.scope_key,
            failure_reason(exc),
        )
    return lease

"""Completion callbacks of submitted runs: a webhook URL, or a Python callback a serving
worker registered by name, each delivered at least once after the run ends.

A submit with ``webhook=`` or ``callback=`` writes one row per target in ``fence_callbacks``
in its own transaction, ``pending`` and held (due at :data:`~langgraph_fence.lease.schema.
HELD_BACK`): a look reads only the due rows, whatever the number of runs in flight with
callbacks. A run's end makes them due (:meth:`Callbacks.arm`): its worker's, at once; any
other end (a cancel, a dead letter by a take, a new input interrupting it, a worker lost
between the end and the arm) by a sweep each serving worker makes every
:data:`SWEEP_EVERY` seconds (:meth:`Callbacks.sweep`). Any serving worker's look finds the
due rows whose run has ended (:meth:`Callbacks.due`), of targets it can deliver (every
webhook; the callbacks it registered), and claims each in one compare-and-set statement
that moves its ``due`` a claim's length on and counts the attempt (:meth:`Callbacks.claim`):
one worker delivers it; a worker lost while delivering leaves it to be claimed again when
the claim has passed. A delivery that fails is due again after a backoff, and ``failed``
after its attempts; one that succeeds is ``delivered``. Every time is on the store's clock.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any
from urllib.parse import urlsplit

from sqlalchemy import bindparam, text

from langgraph_fence.database.retry import retry_connection_errors
from langgraph_fence.lease.schema import HELD_BACK, yielded_sql
from langgraph_fence.validate import text_id

if TYPE_CHECKING:
    from sqlalchemy.ext.asyncio import AsyncConnection

    from langgraph_fence.lease import LeaseKey
    from langgraph_fence.queue._database import QueueDatabase

__all__ = [
    "CALLBACK",
    "ENDED",
    "MAX_WEBHOOK_CHARS",
    "SWEEP_EVERY",
    "WEBHOOK",
    "CallbackState",
    "Callbacks",
    "DueCallback",
    "callback_targets",
    "shown_target",
]

#: The prefix of a webhook's target, and of a registered Python callback's.
WEBHOOK = "webhook:"
CALLBACK = "callback:"
#: How often each serving worker makes due the callbacks of runs that ended without their
#: worker saying so (seconds of its loop).
SWEEP_EVERY = 10.0
#: The statuses a submitted run ends in (a run's row keeps it once it left ``current``).
ENDED = ("done", "waiting", "failed", "dead_lettered", "cancelled")
_ENDED_SQL = ", ".join(f"'{s}'" for s in ENDED)
#: The longest webhook URL a submit takes (a URL is part of its row's key).
MAX_WEBHOOK_CHARS = 2048


@dataclass(frozen=True)
class CallbackState:
    """Where one completion callback of a run stands.

    Attributes:
        target: ``"webhook:<url>"`` or ``"callback:<name>"``.
        status: ``pending`` (the run goes on, or its delivery is due or being made),
            ``delivered``, or ``failed`` (its attempts ran out).
        attempts: deliveries begun.
        last_error: why the last failed delivery failed.
    """

    target: str
    status: str
    attempts: int
    last_error: str | None


@dataclass(frozen=True)
class DueCallback:
    """A pending callback whose run has ended, as a look finds it."""

    run_id: str
    target: str
    tenant_id: str
    execution_id: str
    attempts: int


def shown_target(target: str) -> str:
    """``target`` as logs and errors show it: a webhook without its query (it may carry a
    token)."""
    if target.startswith(WEBHOOK):
        parts = urlsplit(target.removeprefix(WEBHOOK))
        return WEBHOOK + parts._replace(query="…" if parts.query else "").geturl()
    return target


def callback_targets(webhook: object, callback: object) -> tuple[str, ...]:
    """The targets of a submit's ``webhook`` and ``callback`` (either may be ``None``).

    Raises:
        ValueError: a webhook that is not an absolute ``http(s)`` URL with a host, or a bad
            callback name; named with the fix.
    """
    targets: list[str] = []
    if webhook is not None:
        if not isinstance(webhook, str) or not webhook:
            raise ValueError(f"webhook must be an http(s) URL, got {webhook!r}")
        if len(webhook) > MAX_WEBHOOK_CHARS or any(c.isspace() or ord(c) < 32 for c in webhook):
            raise ValueError(
                f"webhook must be a URL of at most {MAX_WEBHOOK_CHARS} characters with no "
                f"spaces or control characters, got {webhook[:80]!r}..."
            )
        parts = urlsplit(webhook)
        if parts.scheme not in ("http", "https") or not parts.hostname:
            raise ValueError(
                f"webhook must be an absolute http:// or https:// URL with a host, got "
                f"{webhook!r}: the serving workers POST the run's end to it"
            )
        if parts.username or parts.password:
            raise ValueError(
                "webhook must not carry credentials in its URL (they would be stored with "
                "the run and shown in listings): authenticate the receiver another way"
            )
        targets.append(WEBHOOK + webhook)
    if callback is not None:
        name = text_id(
            "callback", callback, what="the name a serving worker registers its callback under"
        )
        targets.append(CALLBACK + name)
    return tuple(targets)


class Callbacks:
    """The completion callbacks' rows on the queue's database."""

    def __init__(self, db: QueueDatabase) -> None:
        self._db = db
        now = db.store.now_sql
        self._add = text(
            "INSERT INTO fence_callbacks (run_id, target, tenant_id, execution_id, status, "
            "attempts, due) VALUES (:run_id, :target, :tenant_id, :execution_id, 'pending', "
            f"0, {HELD_BACK}) ON CONFLICT (run_id, target) DO NOTHING"
        )
        # The run ended: its row left 'current' with its end, or it is the execution's
        # current run and the lease ended (not a yielded tree, which goes on).
        ended = (
            f"(r.status IN ({_ENDED_SQL}) OR (r.status = 'current' "
            f"AND l.status IN ({_ENDED_SQL}) AND NOT {yielded_sql('l')}))"
        )
        runs = (
            "FROM fence_callbacks c JOIN fence_runs r ON r.run_id = c.run_id "
            "LEFT JOIN fence_leases l ON l.tenant_id = c.tenant_id "
            "AND l.execution_id = c.execution_id "
        )
        self._due = text(
            "SELECT c.run_id, c.target, c.tenant_id, c.execution_id, c.attempts "
            + runs
            + f"WHERE c.status = 'pending' AND c.due <= {now} "
            "AND (c.target LIKE 'webhook:%' OR c.target IN :names) "
            f"AND {ended} ORDER BY c.due LIMIT :limit"
        ).bindparams(bindparam("names", expanding=True))
        held = f"c.status = 'pending' AND c.due >= {HELD_BACK} AND {ended}"
        self._arm = text(
            f"UPDATE fence_callbacks SET due = {now} WHERE run_id = :run_id "
            f"AND status = 'pending' AND due >= {HELD_BACK} AND run_id IN (SELECT c.run_id "
            + runs
            + f"WHERE c.run_id = :run_id AND {held})"
        )
        self._sweep = text(
            f"UPDATE fence_callbacks SET due = {now} WHERE status = 'pending' "
            f"AND due >= {HELD_BACK} AND run_id IN (SELECT c.run_id " + runs + f"WHERE {held})"
        )
        self._claim = text(
            f"UPDATE fence_callbacks SET due = {now} + :claim, attempts = attempts + 1 "
            "WHERE run_id = :run_id AND target = :target AND status = 'pending' "
            f"AND attempts = :attempts AND due <= {now}"
        )
        # A delivery made is made, whichever claim made it (a claim that outlived its time
        # and another's failure after it included).
        self._done = text(
            "UPDATE fence_callbacks SET status = 'delivered', last_error = NULL "
            "WHERE run_id = :run_id AND target = :target"
        )
        # A failure counts only for the claim that is still the row's last (its attempt):
        # a claim that outlived its time must not end or reschedule a newer one.
        self._again = text(
            f"UPDATE fence_callbacks SET due = {now} + :delay, last_error = :error, "
            "status = CASE WHEN attempts >= :attempts THEN 'failed' ELSE 'pending' END "
            "WHERE run_id = :run_id AND target = :target AND status = 'pending' "
            "AND attempts = :claimed"
        )
        self._of_run = text(
            "SELECT target, status, attempts, last_error FROM fence_callbacks "
            "WHERE run_id = :run_id ORDER BY target"
        )

    async def add(
        self, conn: AsyncConnection, run_id: str, *, key: LeaseKey, targets: Sequence[str]
    ) -> None:
        """Record ``targets`` for run ``run_id`` in ``conn``'s transaction (the submit's);
        a target recorded before is kept as it is."""
        rows = [
            {
                "run_id": run_id,
                "target": target,
                "tenant_id": key.tenant_id,
                "execution_id": key.execution_id,
                **self._db.now(),
            }
            for target in targets
        ]
        if rows:
            await conn.execute(self._add, rows)

    async def arm(self, run_id: str) -> None:
        """Make run ``run_id``'s held callbacks due now, if it ended (one that goes on, a
        sleep, a retry, a hand-back, keeps them held)."""
        await self._write(self._arm, {"run_id": run_id, **self._db.now()}, "callbacks")

    # A serving look's reads and claims are tried once: on a connection error the look
    # goes on to its takes (which say the store failed and back off), and the next look
    # tries again; retried here, they would hold the look through an outage.

    async def sweep(self) -> int:
        """Make due the held callbacks of every run that ended; how many (one try)."""
        return await self._write(self._sweep, dict(self._db.now()), "callback sweep", once=True)

    async def due(self, names: Sequence[str], limit: int) -> list[DueCallback]:
        """Up to ``limit`` pending callbacks whose run ended and whose time has come: every
        webhook, and the Python callbacks named ``names``; oldest due first (one try)."""
        # Never an empty list: PostgreSQL types an empty IN as integers. The bare prefix
        # names no callback (a name is never empty).
        targets = [CALLBACK + n for n in names] or [CALLBACK]
        params = {"names": targets, "limit": limit, **self._db.now()}
        async with self._db.engine.connect() as conn:
            rows = list(await conn.execute(self._due, params))
        return [
            DueCallback(r.run_id, r.target, r.tenant_id, r.execution_id, r.attempts) for r in rows
        ]

    async def claim(self, due: DueCallback, seconds: float) -> bool:
        """Claim ``due`` for one delivery, for ``seconds``; whether this claim won (one
        try)."""
        params = {
            "run_id": due.run_id,
            "target": due.target,
            "attempts": due.attempts,
            "claim": seconds,
            **self._db.now(),
        }
        return bool(await self._write(self._claim, params, "callback claim", once=True))

    async def delivered(self, due: DueCallback) -> None:
        """``due`` was delivered."""
        await self._write(self._done, {"run_id": due.run_id, "target": due.target}, "callback")

    async def failed(self, due: DueCallback, error: str, delay: float, attempts: int) -> None:
        """``due``'s delivery failed with ``error``: due again in ``delay`` seconds, or
        ``failed`` once ``attempts`` were made."""
        params = {
            "run_id": due.run_id,
            "target": due.target,
            "claimed": due.attempts + 1,
            "error": error[:2000],
            "delay": delay,
            "attempts": attempts,
            **self._db.now(),
        }
        await self._write(self._again, params, "callback")

    async def of_run(self, run_id: str) -> list[CallbackState]:
        """The callbacks of run ``run_id``, by target."""
        rows = await self._db.first_all(self._of_run, {"run_id": run_id}, what="run callbacks")
        return [CallbackState(r.target, r.status, int(r.attempts), r.last_error) for r in rows]

    async def _write(
        self, statement: Any, params: dict[str, Any], what: str, *, once: bool = False
    ) -> int:
        """``statement``'s row count; retried on a connection error unless ``once``."""

        async def attempt() -> int:
            async with self._db.writer.begin() as conn:
                return int((await conn.execute(statement, params)).rowcount)

        return await (attempt() if once else retry_connection_errors(attempt, what=what))

"""Tokens across a PostgreSQL failover: the timeline in every token, and the quarantine.

A standby promoted after the primary died may lack the primary's last commits: with
asynchronous replication the cluster "is allowed to lose some committed transactions"
(Patroni). If those held a takeover (a token issued, a stamp of a non-idempotent write), the
promoted primary would issue the same token again and, finding no stamp, repeat the write.

Two rules keep the fence sound across a promotion:

* **Tokens keep rising.** PostgreSQL's timeline goes up by one at every promotion (and at
  every point-in-time recovery). Every take reads it in the statement that moves the epoch
  and issues ``max(epoch + 1, base + (timeline - tl_base) * 2**32 + 1)``, ``base`` and
  ``tl_base`` from the ledger ``fence_timeline`` (made at the server's timeline, base 0):
  without a failover tokens are 1, 2, 3, ... as before; the first take after a promotion
  jumps above every token the old timeline could have issued, lost or not; a server
  behind its ledger (a lineage it cannot follow) gets a base above every epoch. One
  number, compared as one: a sink or an API that keeps the highest token needs no change.
* **Quarantine.** The ledger also keeps the timeline whose executions were last
  classified. While it differs from the server's, no take, stamp, submit, cancel, admin
  hold, spawn of children or operator retry lands (``on_failover="quarantine"``, the
  default): the first instance to see the change dead-letters every execution that was
  in flight (pending, running or yielded: a holder may have stamped and made a
  non-idempotent write on the lost timeline, and its stamp may be gone), names the
  failover in the reason, moves the ledger on, and the writes go ahead.
  ``on_failover="trust"`` (synchronous replication: no committed write is lost) moves the
  ledger on and classifies nothing.

SQLite has no replication and no timeline: its tokens are the plain epochs.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Literal, NamedTuple

from sqlalchemy import text
from sqlalchemy.ext.asyncio import AsyncConnection

from langgraph_fence.database import Dialect
from langgraph_fence.lease import LeaseKey

__all__ = [
    "FAILOVER_MODES",
    "ON_FAILOVER_ENV",
    "TIMELINE_SPAN",
    "FailoverReport",
    "FailoverUnclassified",
    "OnFailover",
    "Quarantined",
    "check_on_failover",
    "failover_mode",
    "first_token_sql",
    "floor_sql",
    "ledger_ok_sql",
    "next_token_sql",
    "timeline_sql",
    "token_floor",
    "token_parts",
]

#: How many tokens one timeline may issue per execution: the token of take ``n`` on
#: timeline ``t`` is at least ``(t - 1) * TIMELINE_SPAN + n``.
TIMELINE_SPAN = 2**32

OnFailover = Literal["quarantine", "trust"]
FAILOVER_MODES: tuple[OnFailover, ...] = ("quarantine", "trust")

#: The server's timeline, read in the statement that uses it: the first eight hex digits of
#: the WAL file name at the current write position (the timeline new WAL is written on,
#: the new one from the first statement after a promotion). Fails on a standby ("recovery
#: is in progress"), which the retry treats as a connection that landed on the wrong server.
_PG_TIMELINE = (
    "(SELECT CAST(CAST(('x' || substr(pg_walfile_name(pg_current_wal_lsn()), 1, 8)) "
    "AS bit(32)) AS bigint))"
)


def check_on_failover(on_failover: object) -> OnFailover:
    """``on_failover`` if it is one of :data:`FAILOVER_MODES`, else a ValueError naming them."""
    if on_failover not in FAILOVER_MODES:
        raise ValueError(
            f"on_failover must be 'quarantine' (the default: executions in flight when the "
            f"database failed over are dead-lettered, never repeated) or 'trust' (only for "
            f"synchronous replication or quorum storage, where a failover loses no commit), "
            f"got {on_failover!r}"
        )
    return on_failover


#: The environment variable that sets ``on_failover`` where the code passes none: one
#: setting for every process on a database (workers, the CLI, the Agent Server).
ON_FAILOVER_ENV = "LANGGRAPH_FENCE_ON_FAILOVER"


def failover_mode(on_failover: object = None) -> OnFailover:
    """``on_failover`` checked, or (``None``) ``$LANGGRAPH_FENCE_ON_FAILOVER`` checked, or
    ``"quarantine"``."""
    if on_failover is None:
        from_env = os.environ.get(ON_FAILOVER_ENV, "").strip()
        if not from_env:
            return "quarantine"
        if from_env not in FAILOVER_MODES:
            raise ValueError(
                f"{ON_FAILOVER_ENV}={from_env!r}: set it to 'quarantine' or 'trust' (see "
                "docs/replication.md), or unset it for 'quarantine'"
            )
        return from_env
    return check_on_failover(on_failover)


def timeline_sql(dialect: Dialect) -> str:
    """The server's timeline as SQL (``1`` on SQLite)."""
    return _PG_TIMELINE if dialect == "postgresql" else "1"


def floor_sql(dialect: Dialect) -> str:
    """The token before the first a take may issue now, as SQL (``0`` on SQLite).

    ``fence_timeline`` keeps a ``base`` and the timeline it holds for (``tl_base``): the
    floor is ``base + (timeline - tl_base) * 2**32``, one span higher for every promotion
    since. A lineage the ledger cannot follow (the server's timeline below the ledger's:
    a ``pg_upgrade``, a restore onto a lower timeline) moves ``base`` above every epoch of
    the table when it is classified, so tokens keep rising there too.
    """
    if dialect == "sqlite":
        return "0"
    # Never below the base: a server behind its ledger, not classified yet (a take under
    # "trust" may come first), issues base + 1, not a negative token.
    return (
        f"COALESCE((SELECT GREATEST(b.base, b.base + ({_PG_TIMELINE} - b.tl_base) * "
        f"{TIMELINE_SPAN}) FROM fence_timeline b WHERE b.id = 1), "
        f"({_PG_TIMELINE} - 1) * {TIMELINE_SPAN})"
    )


def first_token_sql(dialect: Dialect) -> str:
    """The token of an execution's first take, as SQL."""
    if dialect == "sqlite":
        return "1"
    return f"({floor_sql(dialect)} + 1)"


def next_token_sql(dialect: Dialect, epoch: str) -> str:
    """The token after ``epoch`` (a column or expression), as SQL: ``epoch + 1``, or the
    timeline's first when the server was promoted since ``epoch`` was issued."""
    if dialect == "sqlite":
        return f"({epoch} + 1)"
    return f"GREATEST({epoch} + 1, {first_token_sql(dialect)})"


def ledger_ok_sql(dialect: Dialect) -> str:
    """True while the executions were classified on the server's timeline (always on
    SQLite): the condition every take and stamp meets under ``on_failover="quarantine"``.
    Any other timeline than the ledger's, higher (a promotion) or lower (a lineage it
    cannot follow), is a failover to classify."""
    if dialect == "sqlite":
        return "1 = 1"
    return f"EXISTS (SELECT 1 FROM fence_timeline WHERE id = 1 AND timeline = {_PG_TIMELINE})"


def token_parts(token: int) -> tuple[int, int]:
    """``(era, n)`` of a token issued on PostgreSQL: ``era`` is 1 plus the number of
    failovers (promotions, or lineages the ledger could not follow) the database's tokens
    have jumped since its ledger was made; ``n`` the token's place within its era."""
    if not isinstance(token, int) or isinstance(token, bool) or token < 0:
        raise ValueError(f"token must be an int >= 0, got {token!r}")
    if token == 0:
        return (1, 0)
    era, n = divmod(token - 1, TIMELINE_SPAN)
    return (era + 1, n + 1)


class FailoverUnclassified(Exception):
    """A write that begins new work was refused: the database failed over and the
    executions in flight are not classified yet. Settle the failover
    (:meth:`~langgraph_fence.SqlLeaseRepository.settle_failover`), then write again."""


class Quarantined(NamedTuple):
    """An execution a failover's classification dead-lettered: at ``token`` (the new
    timeline's), with ``reason`` naming the failover."""

    key: LeaseKey
    token: int
    reason: str


@dataclass(frozen=True, slots=True)
class FailoverReport:
    """What an instance found and did when it saw the database's timeline change.

    Attributes:
        previous: the timeline the executions were last classified on (``None``: the ledger
            row was missing).
        timeline: the server's timeline now.
        on_failover: ``"quarantine"`` or ``"trust"``.
        quarantined: the executions dead-lettered (none under ``"trust"``).
        seconds: how long the classification held this instance's takes.
    """

    previous: int | None
    timeline: int
    on_failover: OnFailover
    quarantined: tuple[Quarantined, ...]
    seconds: float


async def token_floor(conn: AsyncConnection, dialect: Dialect) -> tuple[int, bool]:
    """For a take decided in Python inside a transaction on ``conn``: the floor (a token
    issued now must be above it: 0 on a server never promoted, and on SQLite), and whether
    the executions were classified on the server's timeline (always on SQLite)."""
    if dialect == "sqlite":
        return (0, True)
    row = (await conn.execute(_FLOOR)).one()
    return (int(row.floor), bool(row.ok))


_FLOOR = text(f"SELECT {floor_sql('postgresql')} AS floor, {ledger_ok_sql('postgresql')} AS ok")

"""Flow keys: limits on the submitted runs that share a key (a tenant, a user, a graph, or a
key the caller computes): at most ``max_running`` running at once, at most ``max_starts``
started in any window of ``per`` seconds.

A run submitted with ``flow=Flow(key, ...)`` is recorded as any submitted run, but its lease
waits pending and held back (its ``expires_at`` at :data:`HELD_BACK`, which no take passes):
no worker can take it. Each worker's look admits runs of each key that has some waiting,
oldest submit first, in one transaction per key that locks the key's row (so admissions of
one key never race) and counts, on the store's clock:

* the key's runs admitted and not ended (pending and no longer held back, running, or
  yielded): at most ``max_running``;
* the key's runs that started (pinned by their first claimer) in the last ``per`` seconds,
  plus those admitted and not started yet: at most ``max_starts``.

An admitted run is a pending run like any other (its delay, if it had one, kept). Since an
admitted run is counted until it ends, and a start until it leaves the window, no more than
``max_running`` runs of a key ever run at once and no window of ``per`` seconds holds more
than ``max_starts`` starts, however many workers admit. Each key is admitted on its own
limits, so a key with a backlog holds back no other key.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from functools import partial
from typing import Any

from sqlalchemy import text

from langgraph_fence.database import transaction
from langgraph_fence.database.retry import retry_connection_errors
from langgraph_fence.lease.schema import HELD_BACK, yielded_sql
from langgraph_fence.queue._database import QueueDatabase
from langgraph_fence.queue.notifications import NOTIFY_CHANNEL
from langgraph_fence.validate import MAX_COUNT, MAX_ID_BYTES, MAX_SECONDS, text_id

__all__ = ["HELD_BACK", "Flow", "Flows"]


_WAITING = (
    "r.status = 'current' AND l.status = 'pending' AND l.holder IS NULL AND "
    "l.expires_at >= :held_back"
)
_JOIN = (
    "FROM fence_runs r JOIN fence_leases l ON l.tenant_id = r.tenant_id AND "
    "l.execution_id = r.execution_id "
)
_OF_KEY = "r.tenant_id = :tenant_id AND r.flow_key = :flow_key"
_ADMITTED = (
    f"(l.status = 'running' OR {yielded_sql('l')} OR (l.status = 'pending' AND "
    "(l.expires_at IS NULL OR l.expires_at < :held_back)))"
)
UPSERT_FLOW = text(
    "INSERT INTO fence_flows (tenant_id, flow_key, max_running, max_starts, per) VALUES "
    "(:tenant_id, :flow_key, :max_running, :max_starts, :per) ON CONFLICT (tenant_id, flow_key) "
    "DO UPDATE SET max_running = excluded.max_running, max_starts = excluded.max_starts, "
    "per = excluded.per"
)
_KEYS_WAITING = text(
    f"SELECT DISTINCT r.tenant_id, r.flow_key {_JOIN}WHERE r.flow_key IS NOT NULL AND "
    f"{_WAITING} LIMIT :limit"
)
_RUNNING_SQL = f"SELECT count(*) {_JOIN}WHERE {_OF_KEY} AND r.status = 'current' AND {_ADMITTED}"
# Started in the window (each run's start is written on its own row by its first claimer's
# pin: an index answers it, and nothing another run of the thread writes clears it), and
# admitted but not started yet (pending, or taken and not pinned yet: a take is not a start
# until its run pins its input, a moment later). One statement, so one snapshot: read apart,
# a run pinned between the two reads would be counted in neither.
_STARTS_SQL = f"SELECT count(*) FROM fence_runs r WHERE {_OF_KEY} AND r.started_at > :since"
_UNSTARTED_SQL = (
    f"SELECT count(*) {_JOIN}WHERE {_OF_KEY} AND r.status = 'current' AND "
    f"r.started_at IS NULL AND {_ADMITTED}"
)
_COUNTS = text(
    f"SELECT ({_RUNNING_SQL}) AS running, ({_STARTS_SQL}) AS started, ({_UNSTARTED_SQL}) "
    "AS unstarted"
)
# The oldest waiting runs whose time has come (a delayed run waits for its time before it
# takes a slot of its key).
_NEXT = text(
    f"SELECT r.execution_id, r.not_before, r.graph {_JOIN}WHERE {_OF_KEY} AND {_WAITING} "
    "AND (r.not_before IS NULL OR r.not_before <= :now) ORDER BY r.submitted_at, r.seq LIMIT :n"
)
_ADMIT = text(
    "UPDATE fence_leases SET expires_at = :not_before WHERE tenant_id = :tenant_id AND "
    "execution_id = :execution_id AND status = 'pending' AND holder IS NULL AND "
    "expires_at >= :held_back"
)


@dataclass(frozen=True, slots=True)
class Flow:
    """The flow key a submitted run counts against, and the key's limits (the latest
    submit's limits are the key's).

    Attributes:
        key: the key (a tenant, a user, a graph, or one the caller computes).
        max_running: at most this many of the key's runs run at once (``None``: no limit).
        max_starts: at most this many of them start in any window of ``per`` seconds
            (``None``: no limit).
        per: the window of ``max_starts``, in seconds.

    Raises:
        ValueError: a bad key, a limit that is not a positive int, ``max_starts`` without a
            positive ``per``, or no limit at all; named with the fix.
    """

    key: str
    max_running: int | None = None
    max_starts: int | None = None
    per: float | None = None

    def __post_init__(self) -> None:
        text_id("flow.key", self.key, what="the key the run counts against", max_bytes=MAX_ID_BYTES)
        for name in ("max_running", "max_starts"):
            value = getattr(self, name)
            if value is not None and (
                isinstance(value, bool) or not isinstance(value, int) or not 0 < value <= MAX_COUNT
            ):
                raise ValueError(f"flow.{name} must be a positive int or None, got {value!r}")
        if self.max_running is None and self.max_starts is None:
            raise ValueError(
                "a Flow needs a limit: max_running=N (at most N running at once) and/or "
                "max_starts=M with per=SECONDS (at most M starts in any window of SECONDS)"
            )
        per = self.per
        if self.max_starts is not None and (
            per is None
            or isinstance(per, bool)
            or not isinstance(per, int | float)
            or not (math.isfinite(per) and 0 < per <= MAX_SECONDS)
        ):
            raise ValueError(
                f"flow.per must be the window of max_starts in seconds (e.g. per=1.0: at most "
                f"max_starts a second), got {per!r}"
            )

    def params(self, tenant_id: str) -> dict[str, Any]:
        """The key's row of ``fence_flows``."""
        return {
            "tenant_id": tenant_id,
            "flow_key": self.key,
            "max_running": self.max_running,
            "max_starts": self.max_starts,
            "per": None if self.per is None else float(self.per),
        }


class Flows:
    """The admission of the runs of flow keys, as each worker's look does it."""

    def __init__(self, db: QueueDatabase) -> None:
        self._db = db
        now = db.store.now_sql
        self._limits = text(
            f"SELECT max_running, max_starts, per, {now} AS now FROM fence_flows WHERE "
            "tenant_id = :tenant_id AND flow_key = :flow_key" + (" FOR UPDATE" if db.pg else "")
        )

    async def admit(self, limit: int = 100) -> int:
        """Admit what the limits allow of each key with runs waiting (up to ``limit`` keys),
        one transaction per key; how many runs were admitted."""

        async def keys() -> list[Any]:
            async with self._db.engine.connect() as conn:
                params = {"limit": limit, "held_back": HELD_BACK}
                return list(await conn.execute(_KEYS_WAITING, params))

        admitted = 0
        for row in await retry_connection_errors(keys, what="flow keys"):
            key = {"tenant_id": row.tenant_id, "flow_key": row.flow_key, "held_back": HELD_BACK}
            admit = partial(retry_connection_errors, partial(self._admit, key), what="admission")
            admitted += await self._db.settled_first(admit)
        return admitted

    async def _admit(self, key: dict[str, Any]) -> int:
        async with transaction(self._db.engine) as conn:
            await self._db.classified(conn)
            limits = (await conn.execute(self._limits, {**key, **self._db.now()})).first()
            if limits is None:
                return 0
            since = float(limits.now) - float(limits.per or 0.0)
            counts = (await conn.execute(_COUNTS, {**key, "since": since})).one()
            free = math.inf
            if limits.max_running is not None:
                free = limits.max_running - counts.running
            if limits.max_starts is not None:
                free = min(free, limits.max_starts - counts.started - counts.unstarted)
            if free <= 0:
                return 0
            n = min(int(free) if free != math.inf else 1000, 1000)
            waiting = list(await conn.execute(_NEXT, {**key, "n": n, "now": float(limits.now)}))
            for run in waiting:
                await conn.execute(
                    _ADMIT,
                    {
                        "tenant_id": key["tenant_id"],
                        "execution_id": run.execution_id,
                        "not_before": run.not_before,
                        "held_back": HELD_BACK,
                    },
                )
            if waiting:
                await self._db.notify(conn, NOTIFY_CHANNEL, waiting[0].graph)
            return len(waiting)

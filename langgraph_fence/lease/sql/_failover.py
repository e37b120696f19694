"""The classification of a failover's executions on PostgreSQL (see
:mod:`langgraph_fence.lease.timeline`): one check, and one statement that moves the ledger
and dead-letters what was in flight, decided once however many instances run it at once.
"""

from __future__ import annotations

from typing import Any

from sqlalchemy import text

from langgraph_fence.lease import LeaseStatus
from langgraph_fence.lease.schema import in_flight_sql
from langgraph_fence.lease.timeline import (
    TIMELINE_SPAN,
    ledger_ok_sql,
    timeline_sql,
)

__all__ = ["CLASSIFIED", "sweep_statement"]

#: True while the executions were classified on the server's timeline.
CLASSIFIED = text(f"SELECT {ledger_ok_sql('postgresql')} AS classified")

_DEAD = LeaseStatus.DEAD_LETTERED.value


def sweep_statement(now_sql: str) -> Any:
    """Move the ledger to the server's timeline and, with ``:quarantine``, dead-letter every
    execution in flight (pending, running, yielded) at a token of the new timeline. One
    statement: the ledger row's lock orders instances that run it at once, and the second
    finds the ledger moved (its ``ON CONFLICT ... WHERE`` sees the newest row) and changes
    nothing. Returns one row per execution dead-lettered, or one row of NULLs beside the
    timelines when there were none; no row when the ledger was already there."""
    reason = (
        "'quarantined at token ' || fence_leases.epoch_next || ' after a database failover "
        "(timeline ' || coalesce(CAST(m.previous AS text), '?') || ' to ' || m.timeline || "
        "'): it was in flight on the old primary (' || coalesce('held by ' || c.holder || ' ', "
        "'') || 'at token ' || c.epoch || '), whose last commits the promoted server may not "
        "have (a takeover, the stamp of a non-idempotent write), so it is not repeated; check "
        "its effects, then `langgraph-fence resolve --retry` (or --abandon)'"
    )
    next_token = f"GREATEST(c.epoch + 1, (m.timeline - 1) * {TIMELINE_SPAN} + 1)"
    reason = reason.replace("fence_leases.epoch_next", f"({next_token})")
    return text(
        f"""WITH m AS (
    INSERT INTO fence_timeline AS f (id, timeline, previous, changed_at)
    VALUES (1, {timeline_sql("postgresql")}, NULL, {now_sql})
    ON CONFLICT (id) DO UPDATE SET previous = f.timeline, timeline = excluded.timeline,
        changed_at = excluded.changed_at
    WHERE f.timeline < excluded.timeline
    RETURNING f.previous, f.timeline
), c AS (
    SELECT l.tenant_id, l.execution_id, l.holder, l.epoch FROM fence_leases l, m
    WHERE CAST(:quarantine AS boolean) AND {in_flight_sql("l")}
    FOR UPDATE OF l
), s AS (
    UPDATE fence_leases SET epoch = {next_token}, holder = NULL, expires_at = NULL,
        status = '{_DEAD}', reason = {reason}, updated_at = {now_sql}
    FROM c, m
    WHERE fence_leases.tenant_id = c.tenant_id AND fence_leases.execution_id = c.execution_id
    RETURNING fence_leases.tenant_id, fence_leases.execution_id, fence_leases.epoch,
        fence_leases.reason
)
SELECT m.previous, m.timeline, s.tenant_id, s.execution_id, s.epoch, s.reason
FROM m LEFT JOIN s ON true"""
    )

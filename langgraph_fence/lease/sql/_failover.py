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

#: Whether the executions were classified on the server's timeline, and when the ledger
#: last moved (a take refused just before another instance classified takes again).
CLASSIFIED = text(
    f"SELECT {ledger_ok_sql('postgresql')} AS classified, "
    "(SELECT changed_at FROM fence_timeline WHERE id = 1) AS changed_at"
)

_DEAD = LeaseStatus.DEAD_LETTERED.value


def sweep_statement(now_sql: str) -> Any:
    """Move the ledger to the server's timeline and, with ``:quarantine``, dead-letter every
    execution in flight (pending, running, yielded) at a token above the new floor.

    A promotion (a higher timeline) keeps the ledger's base: the floor rises one span per
    timeline. A lower timeline (a ``pg_upgrade``, a restore onto a lower timeline: a lineage
    the ledger cannot follow) puts the base above every epoch of the table. One statement:
    the ledger row's lock orders instances that run it at once, and the second finds the
    ledger moved (its ``ON CONFLICT ... WHERE`` sees the newest row) and changes nothing.
    The rows are locked in key order, as every statement that locks several of them does.
    Returns one row per execution dead-lettered, or one row of NULLs beside the timelines
    when there were none; no row when the ledger was already there."""
    tl = timeline_sql("postgresql")
    span = TIMELINE_SPAN
    # A base above every epoch of the table: read (a scan) only where the ledger is made
    # afresh or the server is behind it, not at every promotion.
    above_all = f"(SELECT (coalesce(max(epoch), 0) / {span} + 1) * {span} FROM fence_leases)"
    next_token = "GREATEST(c.epoch + 1, m.floor + 1)"
    reason = (
        f"'quarantined at token ' || {next_token} || ' after a database failover "
        "(timeline ' || coalesce(CAST(m.previous AS text), '?') || ' to ' || m.timeline || "
        "'): it was in flight on the old primary (' || coalesce('held by ' || c.holder || ' ', "
        "'') || 'at token ' || c.epoch || '), whose last commits the promoted server may not "
        "have (a takeover, the stamp of a non-idempotent write), so it is not repeated; check "
        "its effects, then `langgraph-fence resolve --retry` (or --abandon)'"
    )
    return text(
        f"""WITH m AS (
    INSERT INTO fence_timeline AS f (id, timeline, previous, changed_at, base, tl_base)
    VALUES (1, {tl}, NULL, {now_sql},
        CASE WHEN EXISTS (SELECT 1 FROM fence_timeline) THEN 0 ELSE {above_all} END, {tl})
    ON CONFLICT (id) DO UPDATE SET previous = f.timeline, timeline = excluded.timeline,
        changed_at = excluded.changed_at,
        base = CASE WHEN excluded.timeline > f.timeline THEN f.base ELSE {above_all} END,
        tl_base = CASE WHEN excluded.timeline > f.timeline THEN f.tl_base
            ELSE excluded.tl_base END
    WHERE f.timeline <> excluded.timeline
    RETURNING f.previous, f.timeline, f.base + (f.timeline - f.tl_base) * {span} AS floor
), c AS (
    SELECT l.tenant_id, l.execution_id, l.holder, l.epoch FROM fence_leases l, m
    WHERE CAST(:quarantine AS boolean) AND {in_flight_sql("l")}
    ORDER BY l.tenant_id, l.execution_id
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

"""The lease table and its migrations (shared with the fence-aware SQL checkpointer).

``fence_leases`` holds one row per execution key. ``epoch`` is the fencing token;
``expires_at`` is in the store's clock (seconds since the epoch, PostgreSQL's ``now()`` or the
injected clock). The pending-effect stamp lives in four columns so a single statement can
test it (``pending_effect = 'non_idempotent_write'``) on both dialects.
"""

from __future__ import annotations

from sqlalchemy import BigInteger, Column, Double, MetaData, PrimaryKeyConstraint, Table, Text

from .migrations import Migration

__all__ = ["LEASES", "LEASE_MIGRATIONS", "metadata"]

metadata = MetaData()

LEASES = Table(
    "fence_leases",
    metadata,
    Column("tenant_id", Text, nullable=False),
    Column("execution_id", Text, nullable=False),
    Column("scope_key", Text, nullable=False),
    Column("epoch", BigInteger, nullable=False),
    Column("holder", Text),
    Column("expires_at", Double),
    Column("status", Text, nullable=False),
    Column("pending_effect", Text),
    Column("pending_node", Text),
    Column("pending_task", Text),
    Column("pending_token", BigInteger),
    Column("reason", Text),
    Column("updated_at", Double, nullable=False),
    PrimaryKeyConstraint("tenant_id", "execution_id"),
)

_CREATE_LEASES = """
CREATE TABLE IF NOT EXISTS fence_leases (
    tenant_id TEXT NOT NULL,
    execution_id TEXT NOT NULL,
    scope_key TEXT NOT NULL UNIQUE,
    epoch BIGINT NOT NULL CHECK (epoch >= 0),
    holder TEXT,
    expires_at {double},
    status TEXT NOT NULL CHECK (status IN
        ('pending', 'running', 'waiting', 'done', 'failed', 'dead_lettered')),
    pending_effect TEXT,
    pending_node TEXT,
    pending_task TEXT,
    pending_token BIGINT,
    reason TEXT,
    updated_at {double} NOT NULL,
    PRIMARY KEY (tenant_id, execution_id)
)
"""
_CANDIDATES_INDEX = (
    "CREATE INDEX IF NOT EXISTS fence_leases_candidates ON fence_leases (status, expires_at)"
)

# Version 2: on PostgreSQL a unique index other than the upsert's conflict target turns a
# lost race of two first takes into a unique violation instead of "not taken" (ON CONFLICT
# arbitrates only its target). scope_key is a function of the primary key, so a plain index
# keeps it unique all the same. SQLite serialises writers: its upsert always meets the
# primary key first, and dropping a column constraint there would mean rebuilding the table.
_SCOPE_KEY_NOT_UNIQUE = [
    "ALTER TABLE fence_leases DROP CONSTRAINT IF EXISTS fence_leases_scope_key_key",
    "CREATE INDEX IF NOT EXISTS fence_leases_scope_key ON fence_leases (scope_key)",
]

LEASE_MIGRATIONS = [
    Migration(
        version=1,
        description="the lease table",
        sqlite=[_CREATE_LEASES.format(double="REAL"), _CANDIDATES_INDEX],
        postgresql=[_CREATE_LEASES.format(double="DOUBLE PRECISION"), _CANDIDATES_INDEX],
    ),
    Migration(
        version=2,
        description="scope_key indexed but not a second unique constraint (upsert races)",
        sqlite=[],
        postgresql=_SCOPE_KEY_NOT_UNIQUE,
    ),
]

"""The checkpoint and record tables as the migrations leave them are the tables the SQL is
written against, on both databases, whether created new or upgraded from version 1.

The lease table has its own (``test_lease_migrations.py``, against ``schema.LEASES``). These
tables have no ``Table`` of their own: their statements are text (``checkpointers/_postgres.py``,
``_sqlite.py``, ``records.py``), so their present shape is written down here, once, and a
migration that changes it (or that leaves SQLite and PostgreSQL different) fails this test.
"""

from __future__ import annotations

from typing import Any

from sqlalchemy import inspect, text
from sqlalchemy.ext.asyncio import AsyncEngine

from checkpointers.schema import CHECKPOINT_MIGRATIONS, COMPONENT
from langgraph_fence.database.migrations import migrate
from langgraph_fence.lease.records import EXECUTION_MIGRATIONS
from tests.support.databases import SQL_BACKENDS, setup_all

RUNS_ON = SQL_BACKENDS


#: table -> ({column: nullable}, primary key): what the statements read and write.
PRESENT: dict[str, tuple[dict[str, bool], list[str]]] = {
    "fence_checkpoints": (
        {
            "tenant_id": False,
            "thread_id": False,
            "checkpoint_ns": False,
            "checkpoint_id": False,
            "parent_checkpoint_id": True,
            "type": False,
            "checkpoint": False,
            "channel_versions": False,
            "metadata": False,
            "run_id": True,
            "fence_token": True,
        },
        ["tenant_id", "thread_id", "checkpoint_ns", "checkpoint_id"],
    ),
    "fence_checkpoint_blobs": (
        {
            "tenant_id": False,
            "thread_id": False,
            "checkpoint_ns": False,
            "channel": False,
            "version": False,
            "type": False,
            "blob": True,
        },
        ["tenant_id", "thread_id", "checkpoint_ns", "channel", "version"],
    ),
    "fence_checkpoint_writes": (
        {
            "tenant_id": False,
            "thread_id": False,
            "checkpoint_ns": False,
            "checkpoint_id": False,
            "task_id": False,
            "idx": False,
            "channel": False,
            "type": False,
            "blob": False,
            "task_path": False,
            "fence_token": True,
        },
        ["tenant_id", "thread_id", "checkpoint_ns", "checkpoint_id", "task_id", "idx"],
    ),
    "fence_executions": (
        {
            "tenant_id": False,
            "execution_id": False,
            "graph": False,
            "thread_id": False,
            "input_type": False,
            "input": False,
            "recorded_at": False,
            "run_type": True,
            "run": True,
            # A submitted run (records migration 4): when, the checkpoint its input
            # follows, and its output.
            "submitted_at": True,
            "input_after": True,
            "output_type": True,
            "output": True,
            # When the submitted run's first claimer pinned it (records migration 11).
            "started_at": True,
        },
        ["tenant_id", "execution_id"],
    ),
    "fence_thread_bindings": (
        {"tenant_id": False, "thread_id": False, "execution_id": False, "bound_at": False},
        ["tenant_id", "thread_id"],
    ),
    # Who serves what (records migration 5), and what it holds (records migration 7).
    "fence_workers": (
        {
            "instance_id": False,
            "graphs": False,
            "seen_at": False,
            "held": True,
            "max_held": True,
            "lease_ttl": True,
            "renewal_late": True,
        },
        ["instance_id"],
    ),
    # Each execution's token timeline, for the console (lease migration 8): no key, an index.
    "fence_journal": (
        {
            "tenant_id": False,
            "execution_id": False,
            "at": False,
            "kind": False,
            "epoch": True,
            "holder": True,
            "detail": True,
            "actor": True,
        },
        [],
    ),
    # Each submitted run, its identity and outcome (records migration 6).
    "fence_runs": (
        {
            "run_id": False,
            "tenant_id": False,
            "execution_id": False,
            "seq": False,
            "status": False,
            "graph": False,
            "thread_id": False,
            "input_type": False,
            "input": False,
            "run_type": False,
            "run": False,
            "submitted_at": False,
            "epoch": True,
            "reason": True,
            "output_type": True,
            "output": True,
            # Time and flow control (records migrations 8, 11, 12): the time it may start
            # from, its flow key, when it started, its attempts.
            "not_before": True,
            "flow_key": True,
            "started_at": True,
            "attempts": True,
            # Streams (records migration 13): the modes its holders record.
            "stream_modes": True,
        },
        ["run_id"],
    ),
    # Schedules (records migration 9).
    "fence_schedules": (
        {
            "tenant_id": False,
            "schedule_id": False,
            "graph": False,
            "thread_id": False,
            "execution_id": False,
            "input_type": False,
            "input": False,
            "run_type": False,
            "run": False,
            "cron": False,
            "timezone": False,
            "overlap": False,
            "missed": False,
            "grace": False,
            "paused": False,
            "end_at": True,
            "next_tick": True,
            "last_tick": True,
            "fired": False,
            "skipped": False,
            "created_at": False,
        },
        ["tenant_id", "schedule_id"],
    ),
    # Durable sleeps (records migration 10).
    "fence_sleeps": (
        {"tenant_id": False, "execution_id": False, "sleep_key": False, "wake_at": False},
        ["tenant_id", "execution_id", "sleep_key"],
    ),
    # Flow keys' limits (records migration 11).
    "fence_flows": (
        {
            "tenant_id": False,
            "flow_key": False,
            "max_running": True,
            "max_starts": True,
            "per": True,
        },
        ["tenant_id", "flow_key"],
    ),
    # Submitted runs' recorded streams (records migration 13).
    "fence_stream": (
        {
            "run_id": False,
            "epoch": False,
            "seq": False,
            "tenant_id": False,
            "execution_id": False,
            "after": False,
            "task": True,
            "node": True,
            "mode": False,
            "ns": False,
            "payload_type": False,
            "payload": False,
            "withdrawn": False,
        },
        ["run_id", "epoch", "seq"],
    ),
    # Completion callbacks (records migration 14).
    "fence_callbacks": (
        {
            "run_id": False,
            "target": False,
            "tenant_id": False,
            "execution_id": False,
            "status": False,
            "attempts": False,
            "due": False,
            "last_error": True,
        },
        ["run_id", "target"],
    ),
}


async def shapes(engine: AsyncEngine) -> dict[str, tuple[dict[str, bool], list[str]]]:
    def reflect(conn: Any) -> dict[str, tuple[dict[str, bool], list[str]]]:
        inspector = inspect(conn)
        return {
            table: (
                {c["name"]: c["nullable"] for c in inspector.get_columns(table)},
                inspector.get_pk_constraint(table)["constrained_columns"],
            )
            for table in PRESENT
        }

    async with engine.connect() as conn:
        return await conn.run_sync(reflect)


async def test_a_new_database_gets_the_present_tables(fresh_engine: AsyncEngine) -> None:
    await setup_all(fresh_engine)
    assert await shapes(fresh_engine) == PRESENT


async def test_a_database_of_version_1_with_rows_is_upgraded_to_the_present_tables(
    fresh_engine: AsyncEngine,
) -> None:
    # Version 1 of both, with a row each: the upgrades rebuild (checkpoints) and alter
    # (records) tables that hold data, as a user's database does.
    await migrate(fresh_engine, COMPONENT, CHECKPOINT_MIGRATIONS[:1])
    await migrate(fresh_engine, "executions", EXECUTION_MIGRATIONS[:1])
    async with fresh_engine.begin() as conn:
        await conn.execute(
            text(
                "INSERT INTO fence_checkpoints (thread_id, checkpoint_ns, checkpoint_id, type,"
                " checkpoint, channel_versions, metadata) VALUES ('t', '', 'c1', 'json', :b,"
                " '{}', '{}')"
            ),
            {"b": b"{}"},
        )
        await conn.execute(
            text(
                "INSERT INTO fence_executions (tenant_id, execution_id, graph, thread_id,"
                " input_type, input, recorded_at) VALUES ('acme', 'e', 'g', 't', 'json', :b, 0)"
            ),
            {"b": b"{}"},
        )
    await setup_all(fresh_engine)
    assert await shapes(fresh_engine) == PRESENT
    async with fresh_engine.connect() as conn:
        kept = await conn.execute(text("SELECT count(*) FROM fence_checkpoints"))
        assert kept.scalar_one() == 1, "the upgrade lost the checkpoint"
        records = await conn.execute(text("SELECT count(*) FROM fence_executions"))
        assert records.scalar_one() == 1, "the upgrade lost the record"

"""The tables an instance writes, and whether a thread's data is left in any of them."""

from __future__ import annotations

from sqlalchemy import text
from sqlalchemy.ext.asyncio import AsyncEngine

#: The tables of langgraph-fence that may hold what a run was given.
TABLES = (
    "fence_checkpoints",
    "fence_checkpoint_blobs",
    "fence_checkpoint_writes",
    "fence_executions",
    "fence_runs",
    "fence_schedules",
    "fence_thread_bindings",
    "fence_leases",
    "fence_applied",
    "fence_high_water",
)


async def stored_anywhere(
    engine: AsyncEngine, needle: str, tables: tuple[str, ...] = TABLES
) -> list[str]:
    """Every ``table.column`` of ``tables`` whose text holds ``needle``."""
    found = []
    async with engine.connect() as conn:
        for table in tables:
            result = await conn.execute(text(f"SELECT * FROM {table}"))
            for row in result.mappings():
                for column, value in row.items():
                    raw = value if isinstance(value, bytes | bytearray | memoryview) else None
                    shown = bytes(raw).decode("latin-1") if raw is not None else str(value)
                    if needle in shown:
                        found.append(f"{table}.{column}")
    return found

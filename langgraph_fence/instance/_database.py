"""The stores of one database an instance opens on (``Instance.open``): its lease table
with the execution records, its checkpoints and its LangGraph store, side by side on one
engine, their tables migrated before use.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Mapping
from contextlib import asynccontextmanager
from typing import TYPE_CHECKING, Any

from langgraph_fence.lease.records import SqlExecutionRecords
from langgraph_fence.lease.timeline import failover_mode

if TYPE_CHECKING:
    from langgraph.checkpoint.serde.base import SerializerProtocol
    from sqlalchemy.ext.asyncio import AsyncEngine

    from langgraph_fence.checkpointers.store import SqlStore
    from langgraph_fence.lease.timeline import OnFailover


class Database:
    """The stores on one engine, set up: the lease table, the execution records (set up
    with it) and the checkpoints."""

    def __init__(
        self,
        engine: AsyncEngine,
        serde: SerializerProtocol | None,
        on_failover: OnFailover | None = None,
    ) -> None:
        from langgraph_fence.checkpointers import SqlCheckpointer
        from langgraph_fence.lease.sql import SqlLeaseRepository

        self.engine = engine
        self.repository = SqlLeaseRepository(engine, on_failover=on_failover)
        self.saver = SqlCheckpointer(engine, serde=serde)
        self.records = SqlExecutionRecords(engine, serde=serde)  # set up with the repository

    async def setup(self) -> None:
        await self.repository.setup()
        await self.saver.setup()

    async def open_store(self, tenant_id: str) -> SqlStore:
        """The LangGraph store on this database, set up; ``tenant_id``: its tenant outside
        a step."""
        from langgraph_fence.checkpointers.store import SqlStore

        store = SqlStore(self.engine, tenant_id=tenant_id)
        await store.setup()
        return store

    async def aclose(self) -> None:
        """Close the checkpoints', the lease table's and the records' connections."""
        await self.saver.aclose()
        await self.repository.aclose()
        await self.records.aclose()


@asynccontextmanager
async def open_database(
    url: str,
    *,
    schema: str | None,
    engine_options: Mapping[str, Any] | None,
    serde: SerializerProtocol | None,
    on_failover: OnFailover | None = None,
) -> AsyncIterator[Database]:
    """The stores on a new engine for ``url``, set up; the engine disposed of at the end
    of the block (the block closes the stores it used). ``ValueError`` where ``schema`` and
    ``engine_options['schema']`` disagree, before the engine exists."""
    on_failover = failover_mode(on_failover)
    from langgraph_fence.database import create_engine

    engine_kwargs = dict(engine_options or {})
    if schema is not None:
        if engine_kwargs.get("schema", schema) != schema:
            raise ValueError(
                f"schema={schema!r} and engine_options['schema']="
                f"{engine_kwargs['schema']!r} disagree: pass the schema once, as schema="
            )
        engine_kwargs["schema"] = schema
    engine = create_engine(url, **engine_kwargs)
    try:
        database = Database(engine, serde, on_failover)
        await database.setup()
        yield database
    finally:
        await engine.dispose()

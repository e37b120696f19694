"""``SqlCheckpointer``: a LangGraph saver on SQLite and PostgreSQL that checks the fencing token
inside its own writes.

Layout (see :mod:`checkpointers.schema`): checkpoints, channel blobs (one row per channel
*version*, so unchanged channels are not rewritten) and pending writes, each checkpoint and
write row stamped with the token it was written under.

Fencing: when the config carries a run handle (``config["configurable"]["__fence"]``) whose
lease lives in this database's ``fence_leases`` table, ``aput`` and ``aput_writes`` check the
token (key + holder + epoch + ``running``) and write in ONE statement on PostgreSQL and ONE
transaction on SQLite. A refused write leaves no row and raises
:class:`~langgraph_fence.ExecutionFencedError` carrying the epoch found. The write that saves a
checkpoint also clears the stamp-set entries of the supersteps before it, and a task's
finished-step writes clear the task's own entries where their checkpoint is stored (an
error or interrupt write leaves them standing; see ``docs/stamps.md``).

Hot paths (writes, reads) run on the raw driver connection of the engine's pool (see
``_postgres.py`` and ``_sqlite.py`` for why); maintenance (delete, copy, prune) runs through
SQLAlchemy Core in one transaction each.
"""

from __future__ import annotations

import asyncio
import random
from collections.abc import AsyncIterator, Callable, Coroutine, Sequence
from contextlib import asynccontextmanager
from dataclasses import replace
from typing import Any, ClassVar, TypeVar

from langchain_core.runnables import RunnableConfig
from langgraph.checkpoint.base import (
    BaseCheckpointSaver,
    ChannelVersions,
    Checkpoint,
    CheckpointMetadata,
    CheckpointTuple,
    get_checkpoint_id,
)
from langgraph.checkpoint.serde.base import SerializerProtocol
from sqlalchemy import event
from sqlalchemy.ext.asyncio import AsyncEngine

from langgraph_fence.checkpointers._codec import (
    checkpoint_row,
    checkpoint_tuple,
    tenant_arg,
    tenant_of,
    text_arg,
    thread_config,
    thread_of,
    write_rows,
)
from langgraph_fence.checkpointers._guards import WriteGuards, refused
from langgraph_fence.checkpointers._lifecycle import Lifecycle
from langgraph_fence.checkpointers._maintenance import (
    PRUNE_STRATEGIES,
    copy_rows,
    delete_runs,
    delete_threads,
    keep_latest,
)
from langgraph_fence.checkpointers._postgres import PostgresDriver
from langgraph_fence.checkpointers._rows import CheckpointQuery, Driver, TaskWrites
from langgraph_fence.checkpointers._sqlite import SqliteDriver
from langgraph_fence.checkpointers._twins import sync_iter_twin, sync_twin
from langgraph_fence.checkpointers.schema import CHECKPOINT_MIGRATIONS, COMPONENT
from langgraph_fence.database import Dialect, check_engine, create_engine, transaction
from langgraph_fence.database.migrations import migrate
from langgraph_fence.database.retry import retry_window
from langgraph_fence.fence import RunHandle
from langgraph_fence.fence.admission import (
    checkpoint_clear_keys,
    fence_handle,
    writes_clear_keys,
    writes_proof,
)
from langgraph_fence.fence.tenancy import DEFAULT_TENANT
from langgraph_fence.lease.faults import fault_point
from langgraph_fence.lease.schema import LEASE_MIGRATIONS
from langgraph_fence.serde import safe_serializer

__all__ = ["SqlCheckpointer"]

T = TypeVar("T")


class SqlCheckpointer(BaseCheckpointSaver[str]):
    """A LangGraph checkpoint saver on SQLite (aiosqlite) or PostgreSQL (asyncpg), fence-aware.

    Build it as ``SqlCheckpointer(engine)`` then ``await saver.setup()`` (on the event loop
    that will use it), or as ``async with SqlCheckpointer.from_conn_string(url) as saver:``.

    Args:
        engine: from :func:`langgraph_fence.database.create_engine` (PostgreSQL in
            autocommit, SQLite with ``BEGIN IMMEDIATE``).
        serde: the serializer for checkpoints and writes (default: LangGraph's in strict
            msgpack mode, :func:`langgraph_fence.serde.safe_serializer`: a stored blob
            constructs only LangGraph's safe types and those the serializer allows; under
            ``LANGGRAPH_STRICT_MSGPACK`` ``compile()`` adds the graph's own schema types).

    Fencing: a write whose config carries a run handle is guarded when :meth:`guards` says
    this saver can check that handle's lease (its lease table is in this database); a handle
    it cannot guard is refused with ``ValueError`` (wrap the saver in
    :class:`langgraph_fence.FencedCheckpointer`, which checks it outside). Without a handle
    the write is unfenced and its ``fence_token`` is ``NULL``.

    Sync methods (``get_tuple``, ``put``...) are for LangGraph's ``invoke``/``stream``, which
    call them from worker threads: they run the async method on the saver's event loop and
    refuse to be called from that loop's own thread.

    ``delete_thread``, ``delete_for_runs``, ``copy_thread`` and ``prune`` are maintenance:
    not fenced here, and not meant to run on a thread while a run writes to it. Through an
    instance's checkpointer they hold the thread's execution lease instead, and
    ``delete_thread`` erases the execution's other rows too (:mod:`langgraph_fence.saver.admin`).
    """

    #: Every row is keyed by tenant: a wrapper passes tenant configs through as they are.
    scopes_tenants: ClassVar[bool] = True
    #: A fenced write is refused here, before anything else, when the run is known to be
    #: fenced or the thread is not the handle's execution: a wrapper need not check first.
    #: A subclass inherits the promise: one that overrides ``aput`` or ``aput_writes``
    #: keeps their checks first, or sets this to ``False``.
    admits_fenced_writes: ClassVar[bool] = True

    def __init__(self, engine: AsyncEngine, *, serde: SerializerProtocol | None = None) -> None:
        dialect = check_engine(engine)
        # Safe by default: strict msgpack, whatever LANGGRAPH_STRICT_MSGPACK says.
        super().__init__(serde=serde if serde is not None else safe_serializer())
        self._engine = engine
        self._dialect: Dialect = dialect
        self._driver: Driver = (
            PostgresDriver(engine) if self._dialect == "postgresql" else SqliteDriver(engine)
        )
        self._store_id = f"sql:{engine.url.render_as_string(hide_password=True)}"
        # Shared by the copies LangGraph makes (with_allowlist under strict msgpack): a copy
        # is set up, and closed, with the saver it was made from.
        self._lifecycle = Lifecycle()
        # Which guard each fenced write carries: answers of this one store, shared alike.
        self._guards = WriteGuards(self._store_id, self.guards)
        event.listen(engine.sync_engine, "engine_disposed", self._on_engine_disposed)

    @property
    def loop(self) -> asyncio.AbstractEventLoop | None:
        """The event loop :meth:`setup` ran on (its engine's connections belong to it)."""
        return self._lifecycle.loop

    @loop.setter
    def loop(self, loop: asyncio.AbstractEventLoop | None) -> None:
        self._lifecycle.loop = loop

    @classmethod
    @asynccontextmanager
    async def from_conn_string(
        cls,
        url: str,
        *,
        serde: SerializerProtocol | None = None,
        schema: str | None = None,
        **engine_options: Any,
    ) -> AsyncIterator[SqlCheckpointer]:
        """Open an engine on ``url``, set up, yield the saver, then dispose of the engine.

        ``schema`` (PostgreSQL only) is the schema its tables are in, created if missing
        (:func:`langgraph_fence.database.create_engine`, as ``Instance.open`` takes it);
        ``engine_options`` go to ``create_engine`` too.
        """
        engine = create_engine(url, schema=schema, **engine_options)
        saver = cls(engine, serde=serde)
        try:
            await saver.setup()
            yield saver
        finally:
            saver._lifecycle.closed_reason = (
                "its from_conn_string() block has ended and its engine was disposed; open a new one"
            )
            await engine.dispose()

    @property
    def engine(self) -> AsyncEngine:
        """The engine this saver writes through."""
        return self._engine

    @property
    def store_id(self) -> str:
        """Identifies this saver's database, as :attr:`SqlLeaseRepository.store_id` does."""
        return self._store_id

    def guards(self, handle: object) -> bool:
        """Whether this saver checks ``handle``'s token inside its own writes.

        True when ``handle`` is a :class:`~langgraph_fence.fence.RunHandle` whose lease
        repository is on this saver's database (the same ``store_id``): the write can join
        that database's ``fence_leases`` row in its own statement or transaction.
        """
        return isinstance(handle, RunHandle) and handle.repository.store_id == self._store_id

    async def setup(self) -> None:
        """Create or upgrade the checkpoint tables and the lease table the guard joins.

        Call it once, on the event loop that will use the saver; safe from several
        processes at once.
        """
        self._lifecycle.check_open()
        await migrate(self._engine, "leases", LEASE_MIGRATIONS)
        await migrate(self._engine, COMPONENT, CHECKPOINT_MIGRATIONS)
        self.loop = asyncio.get_running_loop()

    async def aclose(self) -> None:
        """Give the connections this saver keeps between calls back to the engine's pool.

        Call it before disposing of an engine you passed in (``from_conn_string`` does it).
        The saver stays usable: the next call checks a connection out again.
        """
        await self._driver.aclose()

    def _on_engine_disposed(self, _engine: Any) -> None:
        self._lifecycle.engine_disposed()

    def run_sync(self, make: Callable[[], Coroutine[Any, Any, T]]) -> T:
        return self._lifecycle.run_sync(make)

    # -- writes

    async def aput(
        self,
        config: RunnableConfig,
        checkpoint: Checkpoint,
        metadata: CheckpointMetadata,
        new_versions: ChannelVersions,
    ) -> RunnableConfig:
        """Save a checkpoint (and the blobs of its new channel versions); fenced with a handle.

        Raises:
            ExecutionFencedError: the run's token is no longer the lease's; nothing written.
            ValueError: no ``thread_id``, a NUL byte in an id, or a handle this saver cannot
                guard.
        """
        handle = fence_handle(config)
        guard = self._guards.of_write(
            handle, config, "aput", lambda h: checkpoint_clear_keys(h, config, checkpoint["id"])
        )
        self._lifecycle.ready()
        row = checkpoint_row(config, checkpoint, metadata, new_versions, self.serde.dumps_typed)
        await fault_point(
            "checkpoint.before", config=config, checkpoint=checkpoint, metadata=metadata
        )
        with retry_window(handle):  # connection errors retried while the run's hold lasts
            landed = await self._driver.put(row, guard)
        if not landed:
            assert handle is not None
            raise await refused(handle, config, "aput")
        if handle is not None:
            cleared = guard.clear_keys if guard is not None else ()
            if cleared:
                handle.forget_pending_effects(cleared)
            proven = handle.proofs.stored((row.checkpoint_ns, row.checkpoint_id), cleared)
            if proven:  # their writes landed while this checkpoint was in flight
                await handle.clear_pending_effects(proven)
        await fault_point(
            "checkpoint.after", config=config, checkpoint=checkpoint, metadata=metadata
        )
        return thread_config(row.tenant_id, row.thread_id, row.checkpoint_ns, row.checkpoint_id)

    async def aput_writes(
        self,
        config: RunnableConfig,
        writes: Sequence[tuple[str, Any]],
        task_id: str,
        task_path: str = "",
    ) -> None:
        """Save a task's writes for a checkpoint; fenced with a handle.

        With a handle, writes of a finished step (no error or interrupt write) clear the
        task's entries of the lease's stamp set in the same statement or transaction, when
        the checkpoint they belong to is stored (otherwise the checkpoint that follows
        clears them).

        Raises:
            ExecutionFencedError: the run's token is no longer the lease's; nothing written.
            ValueError: no ``thread_id`` or ``checkpoint_id``, a NUL byte in an id, or a
                handle this saver cannot guard.
        """
        handle = fence_handle(config)
        guard = self._guards.of_write(
            handle, config, "aput_writes", lambda h: writes_clear_keys(h, task_id, writes)
        )
        if guard is not None and guard.clear_keys:
            guard = replace(guard, proof=writes_proof(config))
        self._lifecycle.ready()
        thread_id, checkpoint_ns = thread_of(config, "aput_writes")
        checkpoint_id = config["configurable"].get("checkpoint_id")
        if not checkpoint_id:
            raise ValueError(
                'aput_writes needs config["configurable"]["checkpoint_id"]: pass the config '
                "aput returned for the checkpoint the writes belong to"
            )
        rows, upsert = write_rows(writes, self.serde.dumps_typed)
        await fault_point("writes.before", config=config, task_id=task_id, writes=writes)
        with retry_window(handle):
            landed, cleared = await self._driver.put_writes(
                TaskWrites(
                    tenant_id=tenant_of(config),
                    thread_id=thread_id,
                    checkpoint_ns=checkpoint_ns,
                    checkpoint_id=text_arg(checkpoint_id, "checkpoint_id"),
                    task_id=text_arg(task_id, "task_id"),
                    task_path=task_path,
                    writes=rows,
                    upsert=upsert,
                ),
                guard,
            )
        if not landed:
            assert handle is not None
            raise await refused(handle, config, "aput_writes")
        if guard is not None and guard.clear_keys:
            assert handle is not None
            if cleared:
                handle.forget_pending_effects(guard.clear_keys)
            else:
                # Stored before their proof: the run's checkpoint that completes it clears
                # (or, stored meanwhile, the statement after this one).
                proven = handle.proofs.landed_unproven(guard.clear_keys, guard.proof)
                if proven:
                    await handle.clear_pending_effects(proven)
        await fault_point("writes.after", config=config, task_id=task_id, writes=writes)

    def get_next_version(self, current: str | None, channel: None) -> str:
        """``<32-digit counter>.<random fraction>``: ordered, and unique across writers."""
        if current is None:
            current_v = 0
        elif isinstance(current, int):
            current_v = current
        else:
            current_v = int(current.split(".")[0])
        return f"{current_v + 1:032}.{random.random():016}"

    # -- reads (never fenced)

    async def aget_tuple(self, config: RunnableConfig) -> CheckpointTuple | None:
        """The checkpoint at ``checkpoint_id``, or the thread's latest in its namespace.

        Only the tenant's own thread is read (the tenant: see
        :func:`langgraph_fence.fence.tenancy.thread_tenant`).
        """
        self._lifecycle.ready()
        thread_id, checkpoint_ns = thread_of(config, "aget_tuple")
        checkpoint_id = get_checkpoint_id(config)
        rows = await self._driver.select(
            CheckpointQuery(
                tenant_id=tenant_of(config),
                thread_id=thread_id,
                checkpoint_ns=checkpoint_ns,
                checkpoint_id=None if checkpoint_id is None else str(checkpoint_id),
                limit=1,
            )
        )
        return checkpoint_tuple(rows[0], self.serde.loads_typed) if rows else None

    async def alist(
        self,
        config: RunnableConfig | None,
        *,
        filter: dict[str, Any] | None = None,
        before: RunnableConfig | None = None,
        limit: int | None = None,
    ) -> AsyncIterator[CheckpointTuple]:
        """Checkpoints newest first, by thread / namespace / id, metadata, ``before``, ``limit``.

        Only the tenant's own threads are listed, also with no thread given.
        """
        self._lifecycle.ready()
        thread_id = checkpoint_ns = checkpoint_id = None
        configurable = (config or {}).get("configurable") or {}
        if configurable.get("thread_id") is not None:
            thread_id = text_arg(configurable["thread_id"], "thread_id")
        if configurable.get("checkpoint_ns") is not None:
            checkpoint_ns = text_arg(configurable["checkpoint_ns"], "checkpoint_ns")
        if configurable.get("checkpoint_id") is not None:
            checkpoint_id = str(configurable["checkpoint_id"])
        before_id = get_checkpoint_id(before) if before is not None else None
        rows = await self._driver.select(
            CheckpointQuery(
                tenant_id=tenant_of(config),
                thread_id=thread_id,
                checkpoint_ns=checkpoint_ns,
                checkpoint_id=checkpoint_id,
                metadata_filter=filter or None,
                before_id=None if before_id is None else str(before_id),
                limit=limit,
            )
        )
        loads = self.serde.loads_typed
        for row in rows:
            yield checkpoint_tuple(row, loads)

    # -- maintenance: one transaction each, not fenced, each within one tenant

    async def adelete_thread(self, thread_id: str, *, tenant_id: str = DEFAULT_TENANT) -> None:
        """Delete every checkpoint, blob and write of the tenant's ``thread_id`` (all
        namespaces); another tenant's thread of the same id is another thread, left alone."""
        self._lifecycle.ready()
        tenant = tenant_arg(tenant_id)
        async with transaction(self._engine) as conn:
            await delete_threads(conn, tenant, [str(thread_id)])

    async def adelete_for_runs(
        self, run_ids: Sequence[str], *, tenant_id: str = DEFAULT_TENANT
    ) -> None:
        """Delete the tenant's checkpoints saved by the given runs (``metadata["run_id"]``),
        their pending writes, and the blobs no remaining checkpoint references."""
        self._lifecycle.ready()
        if isinstance(run_ids, str):
            raise TypeError("run_ids must be a sequence of run ids, not a str")
        tenant = tenant_arg(tenant_id)
        ids = [str(r) for r in run_ids]
        if not ids:
            return
        async with transaction(self._engine) as conn:
            await delete_runs(conn, self._dialect, tenant, ids)

    async def acopy_thread(
        self, source_thread_id: str, target_thread_id: str, *, tenant_id: str = DEFAULT_TENANT
    ) -> None:
        """Copy every checkpoint, blob and write of one of the tenant's threads to another of
        its threads, in one transaction. Never across tenants.

        Copies carry no ``fence_token``: no run wrote them under a token.
        """
        self._lifecycle.ready()
        tenant = tenant_arg(tenant_id)
        async with transaction(self._engine) as conn:
            await copy_rows(conn, tenant, str(source_thread_id), str(target_thread_id))

    async def aprune(
        self,
        thread_ids: Sequence[str],
        *,
        strategy: str = "keep_latest",
        tenant_id: str = DEFAULT_TENANT,
    ) -> None:
        """Prune checkpoints of the given threads of the tenant.

        ``"delete"`` removes everything of each thread. ``"keep_latest"`` keeps, per
        namespace, the latest checkpoint and its pending writes (and the blobs it
        references); a subgraph call's namespace goes with the root checkpoint it started
        from. Each thread is pruned in one transaction; checkpoints saved meanwhile (newer
        ids) are kept.

        Raises:
            TypeError: ``thread_ids`` is a single str.
            ValueError: unknown ``strategy``.
            NotImplementedError: ``keep_latest`` on a thread that uses a ``DeltaChannel``
                (its history lives in the checkpoints it would drop).
        """
        self._lifecycle.ready()
        if isinstance(thread_ids, str):
            raise TypeError("thread_ids must be a sequence of thread IDs, not a str")
        if strategy not in PRUNE_STRATEGIES:
            raise ValueError(
                f"Unknown prune strategy: {strategy!r}; use one of {', '.join(PRUNE_STRATEGIES)}"
            )
        tenant = tenant_arg(tenant_id)
        ids = [str(t) for t in thread_ids]
        if not ids:
            return
        if strategy == "delete":
            async with transaction(self._engine) as conn:
                await delete_threads(conn, tenant, ids)
            return
        for thread_id in ids:
            async with transaction(self._engine) as conn:
                await keep_latest(conn, self._dialect, tenant, thread_id)

    # -- sync twins, for LangGraph's invoke/stream (called from worker threads)

    get_tuple = sync_twin(aget_tuple)
    list = sync_iter_twin(alist)
    put = sync_twin(aput)
    put_writes = sync_twin(aput_writes)
    delete_thread = sync_twin(adelete_thread)
    delete_for_runs = sync_twin(adelete_for_runs)
    copy_thread = sync_twin(acopy_thread)
    prune = sync_twin(aprune)

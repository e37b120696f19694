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
import json
import random
from collections.abc import AsyncIterator, Callable, Coroutine, Iterator, Mapping, Sequence
from contextlib import asynccontextmanager
from dataclasses import dataclass, replace
from typing import Any, ClassVar, TypeVar

from langchain_core.runnables import RunnableConfig
from langgraph.checkpoint.base import (
    WRITES_IDX_MAP,
    BaseCheckpointSaver,
    ChannelVersions,
    Checkpoint,
    CheckpointMetadata,
    CheckpointTuple,
    get_checkpoint_id,
    get_serializable_checkpoint_metadata,
    writes_sort_key,
)
from langgraph.checkpoint.serde.base import SerializerProtocol
from sqlalchemy import event, text
from sqlalchemy.ext.asyncio import AsyncConnection, AsyncEngine

from langgraph_fence.checkpointers._postgres import PostgresDriver
from langgraph_fence.checkpointers._rows import (
    CheckpointQuery,
    CheckpointRow,
    Driver,
    Guard,
    StoredCheckpoint,
    TaskWrites,
)
from langgraph_fence.checkpointers._sqlite import SqliteDriver
from langgraph_fence.checkpointers.schema import CHECKPOINT_MIGRATIONS, COMPONENT
from langgraph_fence.database import Dialect, check_engine, create_engine, transaction
from langgraph_fence.database.migrations import migrate
from langgraph_fence.database.retry import retry_window
from langgraph_fence.errors import ExecutionLeaseLostError
from langgraph_fence.fence import RunHandle
from langgraph_fence.fence.admission import (
    admit_write,
    checkpoint_clear_keys,
    fence_handle,
    refuse_write,
    writes_clear_keys,
    writes_proof,
)
from langgraph_fence.fence.tenancy import DEFAULT_TENANT, thread_tenant
from langgraph_fence.from_thread import hop
from langgraph_fence.lease import Lease
from langgraph_fence.lease.faults import fault_point
from langgraph_fence.lease.schema import LEASE_MIGRATIONS
from langgraph_fence.lease.transitions import fenced_error
from langgraph_fence.serde import safe_serializer
from langgraph_fence.validate import storable_text

__all__ = ["SqlCheckpointer"]

T = TypeVar("T")

_TABLES = ("fence_checkpoint_writes", "fence_checkpoints", "fence_checkpoint_blobs")
PRUNE_STRATEGIES = ("keep_latest", "delete")
_DELTA_KEYS = ("counters_since_delta_snapshot", "delta_writes_versioned")


def _text_arg(value: Any, name: str) -> str:
    return storable_text(f'config["configurable"]["{name}"]', str(value))


def _thread_of(config: RunnableConfig | None, action: str) -> tuple[str, str]:
    """``(thread_id, checkpoint_ns)`` of ``config``, checked."""
    configurable = config.get("configurable") if isinstance(config, Mapping) else None
    if not isinstance(configurable, Mapping) or configurable.get("thread_id") is None:
        raise ValueError(
            f'{action} needs config["configurable"]["thread_id"]: pass '
            'config={"configurable": {"thread_id": "<your thread id>"}} (a checkpointer keys '
            "every checkpoint by its thread)"
        )
    thread_id = _text_arg(configurable["thread_id"], "thread_id")
    checkpoint_ns = _text_arg(configurable.get("checkpoint_ns") or "", "checkpoint_ns")
    return thread_id, checkpoint_ns


def _tenant_arg(tenant_id: object) -> str:
    if not isinstance(tenant_id, str):
        raise ValueError(
            f"tenant_id must be a str (the tenant whose threads to act on; '' for the "
            f"default tenant), got {tenant_id!r}"
        )
    return storable_text("tenant_id", tenant_id)


def _tenant_of(config: RunnableConfig | None) -> str:
    return _text_arg(thread_tenant(config), "tenant_id")


def _thread_config(
    tenant_id: str, thread_id: str, checkpoint_ns: str, checkpoint_id: str
) -> RunnableConfig:
    """The config naming one checkpoint; it names the tenant unless it is the default one
    (the plain LangGraph config, for plain LangGraph use)."""
    configurable: dict[str, Any] = {
        "thread_id": thread_id,
        "checkpoint_ns": checkpoint_ns,
        "checkpoint_id": checkpoint_id,
    }
    if tenant_id != DEFAULT_TENANT:
        configurable["tenant_id"] = tenant_id
    return {"configurable": configurable}


#: The longest text kept inline in a checkpoint row; a longer one is a channel blob, stored
#: once per version instead of once per checkpoint (a 100 MB input was in every one).
INLINE_MAX_CHARS = 1024


def _is_inline(value: Any) -> bool:
    if isinstance(value, str):
        return len(value) <= INLINE_MAX_CHARS
    return value is None or isinstance(value, int | float | bool)


def _prune_plan(
    heads: Mapping[str, tuple[str, str | None]], saved_roots: set[str]
) -> tuple[dict[str, str], set[str]]:
    """What ``keep_latest`` keeps: ``({namespace: head kept}, {namespaces dropped whole})``.

    ``heads`` maps each namespace to its latest checkpoint and the root checkpoint that
    checkpoint's run started from (``metadata["parents"][""]``). A subgraph *call*'s
    namespace (it has a task id after a ``:``) goes with the root checkpoint it started
    from: dropped whole once that root is saved and is not the root kept. A
    ``checkpointer=True`` subgraph's namespace (no ``:``) outlives each call and keeps its
    latest, like the root.
    """
    root_head = heads.get("", (None, None))[0]
    dropped = {
        ns
        for ns, (_, root) in heads.items()
        if ":" in ns and root is not None and root in saved_roots and root != root_head
    }
    kept = {ns: head for ns, (head, _) in heads.items() if ns not in dropped}
    return kept, dropped


@dataclass(slots=True)
class _Lifecycle:
    """A saver's set-up loop and why it is closed: one holder shared by its copies."""

    loop: asyncio.AbstractEventLoop | None = None
    closed_reason: str | None = None


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
        self._lifecycle = _Lifecycle()
        # The guard of the lease the last fenced write was made under (see _guard_for).
        self._guard_memo: tuple[Lease, Guard] | None = None
        self._guarded_handle: RunHandle | None = None  # the last handle guards() accepted
        event.listen(engine.sync_engine, "engine_disposed", self._on_engine_disposed)

    @property
    def loop(self) -> asyncio.AbstractEventLoop | None:
        """The event loop :meth:`setup` ran on (its engine's connections belong to it)."""
        return self._lifecycle.loop

    @loop.setter
    def loop(self, loop: asyncio.AbstractEventLoop | None) -> None:
        self._lifecycle.loop = loop

    @property
    def _closed_reason(self) -> str | None:
        return self._lifecycle.closed_reason

    @_closed_reason.setter
    def _closed_reason(self, reason: str | None) -> None:
        self._lifecycle.closed_reason = reason

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
            saver._closed_reason = (
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
        self._check_open()
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
        # SQLAlchemy would quietly open new connections on a disposed engine; a saver whose
        # engine its owner disposed is a saver someone meant to close.
        if self._closed_reason is None:
            self._closed_reason = (
                "its engine was disposed (engine.dispose()): create a new engine and a new "
                "SqlCheckpointer on it"
            )

    def _check_open(self) -> None:
        if self._closed_reason is not None:
            raise RuntimeError(f"this SqlCheckpointer is closed: {self._closed_reason}")

    def _ready(self) -> None:
        self._check_open()
        if self.loop is None:
            raise RuntimeError(
                "this SqlCheckpointer is not set up: await saver.setup() once (it creates or "
                "upgrades the tables) before using it, on the event loop that will use it"
            )
        if asyncio.get_running_loop() is not self.loop:
            raise RuntimeError(
                "this SqlCheckpointer was set up on another event loop, and its engine's "
                "connections belong to that loop: create the engine and the saver on the "
                "loop that runs the graph"
            )

    # -- fencing

    def _guard_for(
        self,
        handle: RunHandle | None,
        config: RunnableConfig,
        action: str,
        clear_keys: Callable[[RunHandle], tuple[str, ...]],
    ) -> Guard | None:
        """The guard of a fenced write (``None`` without a handle), after the local checks:
        a handle of another store, a run already fenced, a thread of another execution are
        refused here, before anything is read or written."""
        if handle is None:
            return None
        # Whether this saver guards a handle is a matter of the handle's store, which a
        # handle keeps for its life: asked once per run, not on each write.
        if handle is not self._guarded_handle and not self.guards(handle):
            raise ValueError(
                f'{action}: config["configurable"]["__fence"] holds a lease of store '
                f"{handle.repository.store_id!r}, and this saver's database is "
                f"{self._store_id!r}: it cannot check that token inside its writes. Keep the "
                "leases in the checkpoints' database, or wrap the saver: "
                "FencedCheckpointer(saver) checks the token before delegating"
            )
        admit_write(handle, config, action)
        # One guard per Lease object, which is immutable: a renewal or a re-take (a new
        # token) hands the handle a new one, so a guard is never of a superseded lease.
        self._guarded_handle = handle
        lease = handle.lease
        keys = clear_keys(handle)
        if keys:
            return Guard.of(lease, keys)
        memo = self._guard_memo
        if memo is not None and memo[0] is lease:
            return memo[1]
        guard = Guard.of(lease)
        self._guard_memo = (lease, guard)
        return guard

    async def _refused(
        self, handle: RunHandle, config: RunnableConfig, action: str
    ) -> ExecutionLeaseLostError:
        # The failure path only: one more read, to say which epoch the store has now.
        current = await handle.repository.get(handle.key)
        return refuse_write(handle, config, fenced_error(handle.lease, current, action=action))

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
        guard = self._guard_for(
            handle, config, "aput", lambda h: checkpoint_clear_keys(h, config, checkpoint["id"])
        )
        self._ready()
        thread_id, checkpoint_ns = _thread_of(config, "aput")
        inline: dict[str, Any] = {}
        blob_values: dict[str, Any] = {}
        for channel, value in checkpoint["channel_values"].items():
            (inline if _is_inline(value) else blob_values)[channel] = value
        stored = checkpoint.copy()
        stored["channel_values"] = inline
        dumps = self.serde.dumps_typed
        versions = {**checkpoint["channel_versions"], **new_versions}
        # A new version's blob, and a long text's at any version: a checkpoint written
        # before long texts left the row kept it inline, so its blob may not exist yet (it
        # is written once: an existing blob row is left as it is).
        blobs = [
            (channel, str(versions[channel]), *dumps(value))
            for channel, value in blob_values.items()
            if channel in new_versions or (isinstance(value, str) and channel in versions)
        ]
        type_, data = dumps(stored)
        meta = get_serializable_checkpoint_metadata(config, metadata)
        run_id = meta.get("run_id")
        tenant_id = _tenant_of(config)
        row = CheckpointRow(
            tenant_id=tenant_id,
            thread_id=thread_id,
            checkpoint_ns=checkpoint_ns,
            checkpoint_id=checkpoint["id"],
            parent_checkpoint_id=config["configurable"].get("checkpoint_id"),
            type=type_,
            checkpoint=data,
            channel_versions=json.dumps(
                {k: str(v) for k, v in checkpoint["channel_versions"].items()}
            ),
            metadata=json.dumps(meta),
            run_id=None if run_id is None else str(run_id),
            blobs=blobs,
        )
        await fault_point(
            "checkpoint.before", config=config, checkpoint=checkpoint, metadata=metadata
        )
        with retry_window(handle):  # connection errors retried while the run's hold lasts
            landed = await self._driver.put(row, guard)
        if not landed:
            assert handle is not None
            raise await self._refused(handle, config, "aput")
        if handle is not None:
            cleared = guard.clear_keys if guard is not None else ()
            if cleared:
                handle.forget_pending_effects(cleared)
            proven = handle.proofs.stored((checkpoint_ns, checkpoint["id"]), cleared)
            if proven:  # their writes landed while this checkpoint was in flight
                await handle.clear_pending_effects(proven)
        await fault_point(
            "checkpoint.after", config=config, checkpoint=checkpoint, metadata=metadata
        )
        return _thread_config(tenant_id, thread_id, checkpoint_ns, checkpoint["id"])

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
        guard = self._guard_for(
            handle, config, "aput_writes", lambda h: writes_clear_keys(h, task_id, writes)
        )
        if guard is not None and guard.clear_keys:
            guard = replace(guard, proof=writes_proof(config))
        self._ready()
        thread_id, checkpoint_ns = _thread_of(config, "aput_writes")
        checkpoint_id = config["configurable"].get("checkpoint_id")
        if not checkpoint_id:
            raise ValueError(
                'aput_writes needs config["configurable"]["checkpoint_id"]: pass the config '
                "aput returned for the checkpoint the writes belong to"
            )
        dumps = self.serde.dumps_typed
        rows = [
            (WRITES_IDX_MAP.get(channel, idx), channel, *dumps(value))
            for idx, (channel, value) in enumerate(writes)
        ]
        upsert = all(channel in WRITES_IDX_MAP for channel, _ in writes)
        await fault_point("writes.before", config=config, task_id=task_id, writes=writes)
        with retry_window(handle):
            landed, cleared = await self._driver.put_writes(
                TaskWrites(
                    tenant_id=_tenant_of(config),
                    thread_id=thread_id,
                    checkpoint_ns=checkpoint_ns,
                    checkpoint_id=_text_arg(checkpoint_id, "checkpoint_id"),
                    task_id=_text_arg(task_id, "task_id"),
                    task_path=task_path,
                    writes=rows,
                    upsert=upsert,
                ),
                guard,
            )
        if not landed:
            assert handle is not None
            raise await self._refused(handle, config, "aput_writes")
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

    def _tuple(self, row: StoredCheckpoint) -> CheckpointTuple:
        loads = self.serde.loads_typed
        checkpoint: Checkpoint = loads((row.type, row.checkpoint))
        values = checkpoint["channel_values"]
        for channel, type_, blob in row.blobs:
            if type_ != "empty" and blob is not None:
                values[channel] = loads((type_, blob))
        writes = sorted(row.writes, key=lambda w: writes_sort_key(w[4], w[0], w[5]))
        metadata = json.loads(row.metadata) if isinstance(row.metadata, str) else row.metadata
        parent = (
            _thread_config(
                row.tenant_id, row.thread_id, row.checkpoint_ns, row.parent_checkpoint_id
            )
            if row.parent_checkpoint_id
            else None
        )
        return CheckpointTuple(
            _thread_config(row.tenant_id, row.thread_id, row.checkpoint_ns, row.checkpoint_id),
            checkpoint,
            metadata,
            parent,
            [(w[0], w[1], loads((w[2], w[3]))) for w in writes],
        )

    async def aget_tuple(self, config: RunnableConfig) -> CheckpointTuple | None:
        """The checkpoint at ``checkpoint_id``, or the thread's latest in its namespace.

        Only the tenant's own thread is read (the tenant: see
        :func:`langgraph_fence.fence.tenancy.thread_tenant`).
        """
        self._ready()
        thread_id, checkpoint_ns = _thread_of(config, "aget_tuple")
        checkpoint_id = get_checkpoint_id(config)
        rows = await self._driver.select(
            CheckpointQuery(
                tenant_id=_tenant_of(config),
                thread_id=thread_id,
                checkpoint_ns=checkpoint_ns,
                checkpoint_id=None if checkpoint_id is None else str(checkpoint_id),
                limit=1,
            )
        )
        return self._tuple(rows[0]) if rows else None

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
        self._ready()
        thread_id = checkpoint_ns = checkpoint_id = None
        configurable = (config or {}).get("configurable") or {}
        if configurable.get("thread_id") is not None:
            thread_id = _text_arg(configurable["thread_id"], "thread_id")
        if configurable.get("checkpoint_ns") is not None:
            checkpoint_ns = _text_arg(configurable["checkpoint_ns"], "checkpoint_ns")
        if configurable.get("checkpoint_id") is not None:
            checkpoint_id = str(configurable["checkpoint_id"])
        before_id = get_checkpoint_id(before) if before is not None else None
        rows = await self._driver.select(
            CheckpointQuery(
                tenant_id=_tenant_of(config),
                thread_id=thread_id,
                checkpoint_ns=checkpoint_ns,
                checkpoint_id=checkpoint_id,
                metadata_filter=filter or None,
                before_id=None if before_id is None else str(before_id),
                limit=limit,
            )
        )
        for row in rows:
            yield self._tuple(row)

    # -- maintenance: one transaction each, not fenced, each within one tenant

    def _each(self) -> str:
        return "jsonb_each_text" if self._dialect == "postgresql" else "json_each"

    async def _collect_blobs(self, conn: AsyncConnection, tenant_id: str, thread_id: str) -> None:
        """Delete the thread's blobs that no checkpoint of it references any more."""
        await conn.execute(
            text(
                "DELETE FROM fence_checkpoint_blobs WHERE tenant_id = :tenant AND thread_id = :t"
                f" AND NOT EXISTS (SELECT 1 FROM fence_checkpoints c, {self._each()}"
                "(c.channel_versions) v WHERE c.tenant_id = fence_checkpoint_blobs.tenant_id"
                " AND c.thread_id = fence_checkpoint_blobs.thread_id"
                " AND c.checkpoint_ns = fence_checkpoint_blobs.checkpoint_ns"
                " AND v.key = fence_checkpoint_blobs.channel"
                " AND v.value = fence_checkpoint_blobs.version)"
            ),
            {"tenant": tenant_id, "t": thread_id},
        )

    async def _delete_threads(
        self, conn: AsyncConnection, tenant_id: str, thread_ids: Sequence[str]
    ) -> None:
        for thread_id in thread_ids:
            for table in _TABLES:
                await conn.execute(
                    text(f"DELETE FROM {table} WHERE tenant_id = :tenant AND thread_id = :t"),
                    {"tenant": tenant_id, "t": thread_id},
                )

    async def adelete_thread(self, thread_id: str, *, tenant_id: str = DEFAULT_TENANT) -> None:
        """Delete every checkpoint, blob and write of the tenant's ``thread_id`` (all
        namespaces); another tenant's thread of the same id is another thread, left alone."""
        self._ready()
        tenant = _tenant_arg(tenant_id)
        async with transaction(self._engine) as conn:
            await self._delete_threads(conn, tenant, [str(thread_id)])

    async def adelete_for_runs(
        self, run_ids: Sequence[str], *, tenant_id: str = DEFAULT_TENANT
    ) -> None:
        """Delete the tenant's checkpoints saved by the given runs (``metadata["run_id"]``),
        their pending writes, and the blobs no remaining checkpoint references."""
        self._ready()
        if isinstance(run_ids, str):
            raise TypeError("run_ids must be a sequence of run ids, not a str")
        tenant = _tenant_arg(tenant_id)
        ids = [str(r) for r in run_ids]
        if not ids:
            return
        async with transaction(self._engine) as conn:
            in_runs = "run_id IN (" + ", ".join(f":r{i}" for i in range(len(ids))) + ")"
            params: dict[str, str] = {f"r{i}": r for i, r in enumerate(ids)}
            params["tenant"] = tenant
            threads = (
                await conn.execute(
                    text(
                        "SELECT DISTINCT thread_id FROM fence_checkpoints"
                        f" WHERE tenant_id = :tenant AND {in_runs}"
                    ),
                    params,
                )
            ).scalars()
            affected = list(threads)
            await conn.execute(
                text(
                    "DELETE FROM fence_checkpoint_writes WHERE tenant_id = :tenant AND EXISTS"
                    " (SELECT 1 FROM fence_checkpoints c"
                    " WHERE c.tenant_id = fence_checkpoint_writes.tenant_id"
                    " AND c.thread_id = fence_checkpoint_writes.thread_id"
                    " AND c.checkpoint_ns = fence_checkpoint_writes.checkpoint_ns"
                    " AND c.checkpoint_id = fence_checkpoint_writes.checkpoint_id"
                    f" AND c.{in_runs})"
                ),
                params,
            )
            await conn.execute(
                text(f"DELETE FROM fence_checkpoints WHERE tenant_id = :tenant AND {in_runs}"),
                params,
            )
            for thread_id in affected:
                await self._collect_blobs(conn, tenant, thread_id)

    async def acopy_thread(
        self, source_thread_id: str, target_thread_id: str, *, tenant_id: str = DEFAULT_TENANT
    ) -> None:
        """Copy every checkpoint, blob and write of one of the tenant's threads to another of
        its threads, in one transaction. Never across tenants.

        Copies carry no ``fence_token``: no run wrote them under a token.
        """
        self._ready()
        params = {
            "tenant": _tenant_arg(tenant_id),
            "src": str(source_thread_id),
            "dst": str(target_thread_id),
        }
        statements = (
            "INSERT INTO fence_checkpoints (tenant_id, thread_id, checkpoint_ns, checkpoint_id,"
            " parent_checkpoint_id, type, checkpoint, channel_versions, metadata, run_id,"
            " fence_token) SELECT tenant_id, :dst, checkpoint_ns, checkpoint_id,"
            " parent_checkpoint_id, type, checkpoint, channel_versions, metadata, run_id, NULL"
            " FROM fence_checkpoints WHERE tenant_id = :tenant AND thread_id = :src"
            " ON CONFLICT DO NOTHING",
            "INSERT INTO fence_checkpoint_blobs (tenant_id, thread_id, checkpoint_ns, channel,"
            " version, type, blob) SELECT tenant_id, :dst, checkpoint_ns, channel, version, type,"
            " blob FROM fence_checkpoint_blobs WHERE tenant_id = :tenant AND thread_id = :src"
            " ON CONFLICT DO NOTHING",
            "INSERT INTO fence_checkpoint_writes (tenant_id, thread_id, checkpoint_ns,"
            " checkpoint_id, task_id, idx, channel, type, blob, task_path, fence_token)"
            " SELECT tenant_id, :dst, checkpoint_ns, checkpoint_id, task_id, idx, channel, type,"
            " blob, task_path, NULL FROM fence_checkpoint_writes"
            " WHERE tenant_id = :tenant AND thread_id = :src ON CONFLICT DO NOTHING",
        )
        async with transaction(self._engine) as conn:
            for statement in statements:
                await conn.execute(text(statement), params)

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
        self._ready()
        if isinstance(thread_ids, str):
            raise TypeError("thread_ids must be a sequence of thread IDs, not a str")
        if strategy not in PRUNE_STRATEGIES:
            raise ValueError(
                f"Unknown prune strategy: {strategy!r}; use one of {', '.join(PRUNE_STRATEGIES)}"
            )
        tenant = _tenant_arg(tenant_id)
        ids = [str(t) for t in thread_ids]
        if not ids:
            return
        if strategy == "delete":
            async with transaction(self._engine) as conn:
                await self._delete_threads(conn, tenant, ids)
            return
        for thread_id in ids:
            async with transaction(self._engine) as conn:
                await self._keep_latest(conn, tenant, thread_id)

    async def _keep_latest(self, conn: AsyncConnection, tenant_id: str, thread_id: str) -> None:
        rows = (
            await conn.execute(
                text(
                    "SELECT c.checkpoint_ns, c.checkpoint_id, c.metadata FROM fence_checkpoints c"
                    " JOIN (SELECT checkpoint_ns, max(checkpoint_id) AS head"
                    " FROM fence_checkpoints WHERE tenant_id = :tenant AND thread_id = :t"
                    " GROUP BY checkpoint_ns) h"
                    " ON c.checkpoint_ns = h.checkpoint_ns AND c.checkpoint_id = h.head"
                    " WHERE c.tenant_id = :tenant AND c.thread_id = :t"
                ),
                {"tenant": tenant_id, "t": thread_id},
            )
        ).all()
        if not rows:
            return
        heads: dict[str, tuple[str, str | None]] = {}
        for ns, head, raw_meta in rows:
            meta = json.loads(raw_meta) if isinstance(raw_meta, str) else raw_meta
            if any(key in meta for key in _DELTA_KEYS):
                raise NotImplementedError(
                    f"keep_latest can't prune threads that use a DeltaChannel: {thread_id}"
                )
            root = (meta.get("parents") or {}).get("")
            heads[ns] = (head, None if root is None else str(root))
        roots = {root for _, root in heads.values() if root is not None}
        saved: set[str] = set()
        if roots:
            names = [f":r{i}" for i in range(len(roots))]
            found = await conn.execute(
                text(
                    "SELECT checkpoint_id FROM fence_checkpoints WHERE tenant_id = :tenant"
                    " AND thread_id = :t AND checkpoint_ns = ''"
                    f" AND checkpoint_id IN ({', '.join(names)})"
                ),
                {
                    "tenant": tenant_id,
                    "t": thread_id,
                    **{n[1:]: r for n, r in zip(names, sorted(roots), strict=True)},
                },
            )
            saved = set(found.scalars())
        kept, dropped = _prune_plan(heads, saved)
        where = "tenant_id = :tenant AND thread_id = :t AND checkpoint_ns = :ns"
        for ns in dropped:
            for table in _TABLES:
                await conn.execute(
                    text(f"DELETE FROM {table} WHERE {where}"),
                    {"tenant": tenant_id, "t": thread_id, "ns": ns},
                )
        for ns, head in kept.items():
            params = {"tenant": tenant_id, "t": thread_id, "ns": ns, "head": head}
            # Older ids only: what a run saves meanwhile has a newer id and stays.
            for table in ("fence_checkpoint_writes", "fence_checkpoints"):
                await conn.execute(
                    text(f"DELETE FROM {table} WHERE {where} AND checkpoint_id < :head"),
                    params,
                )
            await conn.execute(
                text(
                    "UPDATE fence_checkpoints SET parent_checkpoint_id = NULL"
                    f" WHERE {where} AND checkpoint_id = :head"
                ),
                params,
            )
        await self._collect_blobs(conn, tenant_id, thread_id)

    # -- sync twins, for LangGraph's invoke/stream (called from worker threads)

    def _sync(self, make: Callable[[], Coroutine[Any, Any, T]]) -> T:
        self._check_open()
        loop = self.loop
        if loop is None:
            raise RuntimeError(
                "this SqlCheckpointer is not set up: await saver.setup() on the event loop "
                "that will serve it before calling its sync methods"
            )
        try:
            running: asyncio.AbstractEventLoop | None = asyncio.get_running_loop()
        except RuntimeError:
            running = None
        if running is loop:
            raise asyncio.InvalidStateError(
                "Synchronous calls to SqlCheckpointer are only allowed from a thread other "
                "than its event loop's (LangGraph's invoke/stream make them from worker "
                "threads). On the loop, use the async methods: await saver.aget_tuple(...), "
                "await graph.ainvoke(...)"
            )
        return hop(loop, make)

    async def _alist_all(
        self,
        config: RunnableConfig | None,
        filter: dict[str, Any] | None,
        before: RunnableConfig | None,
        limit: int | None,
    ) -> list[CheckpointTuple]:
        return [
            item async for item in self.alist(config, filter=filter, before=before, limit=limit)
        ]

    def get_tuple(self, config: RunnableConfig) -> CheckpointTuple | None:
        """Sync twin of :meth:`aget_tuple`."""
        return self._sync(lambda: self.aget_tuple(config))

    def list(
        self,
        config: RunnableConfig | None,
        *,
        filter: dict[str, Any] | None = None,
        before: RunnableConfig | None = None,
        limit: int | None = None,
    ) -> Iterator[CheckpointTuple]:
        """Sync twin of :meth:`alist`."""
        return iter(self._sync(lambda: self._alist_all(config, filter, before, limit)))

    def put(
        self,
        config: RunnableConfig,
        checkpoint: Checkpoint,
        metadata: CheckpointMetadata,
        new_versions: ChannelVersions,
    ) -> RunnableConfig:
        """Sync twin of :meth:`aput`."""
        return self._sync(lambda: self.aput(config, checkpoint, metadata, new_versions))

    def put_writes(
        self,
        config: RunnableConfig,
        writes: Sequence[tuple[str, Any]],
        task_id: str,
        task_path: str = "",
    ) -> None:
        """Sync twin of :meth:`aput_writes`."""
        self._sync(lambda: self.aput_writes(config, writes, task_id, task_path))

    def delete_thread(self, thread_id: str, *, tenant_id: str = DEFAULT_TENANT) -> None:
        """Sync twin of :meth:`adelete_thread`."""
        self._sync(lambda: self.adelete_thread(thread_id, tenant_id=tenant_id))

    def delete_for_runs(self, run_ids: Sequence[str], *, tenant_id: str = DEFAULT_TENANT) -> None:
        """Sync twin of :meth:`adelete_for_runs`."""
        self._sync(lambda: self.adelete_for_runs(run_ids, tenant_id=tenant_id))

    def copy_thread(
        self, source_thread_id: str, target_thread_id: str, *, tenant_id: str = DEFAULT_TENANT
    ) -> None:
        """Sync twin of :meth:`acopy_thread`."""
        self._sync(
            lambda: self.acopy_thread(source_thread_id, target_thread_id, tenant_id=tenant_id)
        )

    def prune(
        self,
        thread_ids: Sequence[str],
        *,
        strategy: str = "keep_latest",
        tenant_id: str = DEFAULT_TENANT,
    ) -> None:
        """Sync twin of :meth:`aprune`."""
        self._sync(lambda: self.aprune(thread_ids, strategy=strategy, tenant_id=tenant_id))

"""The checkpointer side of the fence: every checkpoint write is made under the run's token.

:class:`FencedCheckpointer` wraps any LangGraph saver. The run handle travels in
``config["configurable"]["__fence"]`` (the ``__`` prefix keeps it out of persisted metadata);
LangGraph hands that config, by reference, to every ``aput``/``aput_writes`` of the run and
of its subgraphs.

Two strengths of guarantee, depending on the inner saver:

* **Fence-aware inner saver** (one that answers ``guards(handle)`` with ``True``, such as
  :class:`checkpointers.SqlCheckpointer` on the lease table's database): the token is
  checked inside the inner saver's own write (one statement on PostgreSQL, one transaction
  on SQLite). A write made under a superseded token never lands: no window.
* **Any other saver**: the wrapper checks first (locally, then one read of the lease) and
  then delegates. Every write the run has in flight when a take-over commits was checked
  before it and lands (one per concurrent writer: more under ``durability="async"``), and a
  stale checkpoint can land beside the new holder's (a fork of the thread's history); the
  run is refused at its next write. Use a fence-aware saver where that matters.

A refusal is recorded on the handle (the runtime re-raises the recorded error whatever else
surfaces), the run is asked to drain at the next superstep boundary, and the error is raised.
Reads are never fenced.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import (
    AsyncIterator,
    Awaitable,
    Callable,
    Collection,
    Coroutine,
    Iterator,
    Sequence,
)
from contextlib import contextmanager
from contextvars import ContextVar
from typing import TYPE_CHECKING, Any, ClassVar, Protocol, TypeVar

from langchain_core.runnables import RunnableConfig
from langgraph.checkpoint.base import (
    BaseCheckpointSaver,
    ChannelVersions,
    Checkpoint,
    CheckpointMetadata,
    CheckpointTuple,
    get_checkpoint_id,
)

from langgraph_fence.errors import ExecutionContextUnavailableError, ExecutionLeaseLostError
from langgraph_fence.fence import RunHandle
from langgraph_fence.fence.admission import (
    admit_write,
    check_held,
    checkpoint_clear_keys,
    fence_handle,
    refuse_write,
    writes_clear_keys,
    writes_proof,
)
from langgraph_fence.fence.proofs import CheckpointAt
from langgraph_fence.fence.tenancy import DEFAULT_TENANT, LEGACY_TENANT, thread_tenant
from langgraph_fence.from_thread import hop, running_loop
from langgraph_fence.keys import FENCE_CONFIG_KEY
from langgraph_fence.lease.faults import fault_point
from langgraph_fence.saver._optional import OPTIONAL_IMPLEMENTATIONS
from langgraph_fence.saver._tenants import ThreadNames, without_handle
from langgraph_fence.serde import strict_serde

if TYPE_CHECKING:
    from langgraph_fence.saver.admin import ThreadAdmin

__all__ = ["FencedCheckpointer", "GraphRunner"]

logger = logging.getLogger("langgraph_fence.checkpoint")

T = TypeVar("T")


def _checkpoint_at(config: RunnableConfig, checkpoint_id: str) -> CheckpointAt:
    return (str((config.get("configurable") or {}).get("checkpoint_ns") or ""), checkpoint_id)


_LOOP_THREAD_ERROR = (
    "Synchronous calls to {name} are only allowed from a thread other than its event loop's; "
    "on the loop use the async methods (await checkpointer.aput(...), graph.ainvoke(...))"
)


class GraphRunner(Protocol):
    """What owns a :class:`FencedCheckpointer` and runs the graphs compiled with it the
    LangGraph way (the :class:`~langgraph_fence.Instance`): its id, its default tenant, its
    event loop, and its fenced calls."""

    instance_id: str
    tenant_id: str
    loop: asyncio.AbstractEventLoop | None

    def astream(self, *args: Any, **kwargs: Any) -> AsyncIterator[Any]:
        """Stream a graph under its execution's lease."""
        ...

    async def aupdate_state(self, *args: Any, **kwargs: Any) -> Any:
        """Update a thread's state under its execution's lease."""


#: A run's first read of its thread's latest checkpoint, answered from a read its taker
#: made already (:meth:`FencedCheckpointer.primed`): ``[(saver, tenant, thread,
#: namespace), the tuple]`` until that read, or a write, of the run's context empties it.
_PRIMED: ContextVar[list[tuple[tuple[int, str, str, str], CheckpointTuple | None]] | None] = (
    ContextVar("langgraph_fence_primed", default=None)
)


def _unprime() -> None:
    primed = _PRIMED.get()
    if primed:
        primed.clear()


class FencedCheckpointer(BaseCheckpointSaver[Any]):
    """Wraps any saver so that every checkpoint write is made under the run's fencing token.

    Args:
        inner: the saver that stores the checkpoints.
        require_fence: refuse writes that carry no run handle
            (:class:`~langgraph_fence.ExecutionContextUnavailableError`) instead of passing
            them through unfenced.

    With a handle at ``config["configurable"]["__fence"]``:

    * the handle must cover the thread's execution (``execution_id``, default the
      ``thread_id``), else the write is refused;
    * if ``inner.guards(handle)`` is true (a fence-aware saver on the lease table's
      database), the write is delegated and the inner saver checks the token inside its own
      statement or transaction: **no window**. An inner saver whose class sets
      ``admits_fenced_writes = True`` (:class:`checkpointers.SqlCheckpointer`) refuses a
      write of another execution, or of a run already fenced, itself, before it does
      anything else;
    * otherwise the wrapper checks ``handle.check()`` (no I/O), then reads the lease once
      and compares epoch, holder and status, then delegates with the handle removed from
      the config. **Remaining window:** a take-over committed after that read and before
      the inner write completes is not seen. Every write of the run in flight at that
      moment lands (the checkpoint and each task's writes; under ``durability="async"``
      the next superstep's too), a stale checkpoint may land as a sibling of the new
      holder's (a fork), and the run's next write is refused. Only a fence-aware saver
      closes this window.

    The stamp set (see ``docs/stamps.md``): an entry is cleared only once a resume would
    see the step's writes. A root checkpoint clears the entries of the supersteps before
    it; a task's finished-step writes (not an error or interrupt write) clear its own
    entries when the checkpoint they belong to is stored. A fence-aware saver does either in
    the same statement/transaction as the write; with any other saver the wrapper clears
    right after the inner write (``repository.clear_pending_effects``, after one read that
    finds the writes' checkpoint), so a crash between the two leaves the entry standing and
    the step is dead-lettered rather than repeated (safe, not exact).

    Safe loading holds through the wrapper: an inner saver whose serializer is LangGraph's
    ``JsonPlusSerializer`` (or an ``EncryptedSerializer`` over one) in its permissive default
    (any ``module.name`` a payload names is constructed) gets a strict one in its place
    (:func:`langgraph_fence.serde.strict_serde`; the saver object is changed, it reads what
    it wrote alike). A serializer of any other class, or with a custom ext hook, decodes as
    it always did: safe loading does not hold there.

    On refusal the error is recorded on the handle, the run is asked to drain
    (``runtime.control.request_drain``), and the recorded error is raised. Reads are never
    fenced. The wrapper overrides only the optional methods (``acopy_thread``,
    ``adelete_for_runs``, ``aprune``, the delta-channel history) that ``inner`` implements,
    so capability detection sees what the inner saver really does. Owned by an
    :class:`~langgraph_fence.Instance`, those admin operations and ``adelete_thread`` hold
    the thread's execution lease (refused while another instance runs it), and
    ``adelete_thread`` erases the thread (:mod:`langgraph_fence.saver.admin`).
    """

    #: The optional methods forwarded only when the inner saver's class overrides them.
    OPTIONAL_METHODS: ClassVar[tuple[str, ...]] = (
        "adelete_for_runs",
        "delete_for_runs",
        "acopy_thread",
        "copy_thread",
        "aprune",
        "prune",
        "aget_delta_channel_history",
        "get_delta_channel_history",
    )
    _classes: ClassVar[dict[frozenset[str], type[FencedCheckpointer]]] = {}

    inner: BaseCheckpointSaver[Any]
    #: Set by the :class:`~langgraph_fence.Instance` that owns the wrapper: its admin
    #: operations then take the execution's lease (:mod:`langgraph_fence.saver.admin`).
    admin: ThreadAdmin | None = None
    #: Set by the :class:`~langgraph_fence.Instance` that owns the wrapper: a graph compiled
    #: with this checkpointer and called the LangGraph way runs through it
    #: (:mod:`langgraph_fence.steps.graph_calls`), and a read that names no tenant reads the
    #: instance's default tenant (the one such a run wrote under).
    instance: GraphRunner | None = None
    #: Every read and write of this saver sees the tenant's own threads only.
    scopes_tenants: ClassVar[bool] = True

    def __new__(
        cls, inner: BaseCheckpointSaver[Any], *, require_fence: bool = False
    ) -> FencedCheckpointer:
        if cls is FencedCheckpointer:
            cls = _class_for(type(inner))
        return super().__new__(cls)

    def __init__(self, inner: BaseCheckpointSaver[Any], *, require_fence: bool = False) -> None:
        if not isinstance(inner, BaseCheckpointSaver):
            raise ValueError(
                f"inner must be a LangGraph BaseCheckpointSaver, got {type(inner).__name__}"
            )
        # Safe loading through a foreign saver too: its permissive decoding (LangGraph's
        # default) is replaced by strict mode, which reads what it wrote alike.
        safe = strict_serde(inner.serde)
        if safe is not inner.serde:
            inner.serde = safe
        super().__init__(serde=inner.serde)
        self.inner = inner
        self.require_fence = bool(require_fence)
        self._loop: asyncio.AbstractEventLoop | None = None
        # A saver that keys threads by tenant itself (SqlCheckpointer) gets configs as they
        # are; any other keeps a tenant's thread under an id of its own (inner_thread_id).
        self.thread_names = ThreadNames(bool(getattr(inner, "scopes_tenants", False)))
        # A fence-aware saver that makes the local checks of a fenced write itself (the
        # run's recorded error, the thread's execution: check_write_scope), before anything
        # else, gets its writes delegated as they are: the checks are not made twice.
        self._inner_admits = bool(getattr(inner, "admits_fenced_writes", False))
        # The run handle the inner saver last said it guards (see _delegates).
        self._guarded_handle: RunHandle | None = None

    def __repr__(self) -> str:
        return f"FencedCheckpointer({self.inner!r}, require_fence={self.require_fence})"

    def __getnewargs_ex__(self) -> tuple[tuple[Any, ...], dict[str, Any]]:
        # copy.copy() (LangGraph's with_allowlist) and pickle build the object through
        # __new__, which needs the inner saver to pick the class.
        return (self.inner,), {"require_fence": self.require_fence}

    def with_allowlist(self, extra_allowlist: Collection[tuple[str, ...]]) -> FencedCheckpointer:
        """A wrapper of ``inner.with_allowlist(extra_allowlist)`` (LangGraph's strict mode).

        ``compile()`` calls this with the types of the graph's schemas when
        ``LANGGRAPH_STRICT_MSGPACK`` is set. The inner saver decodes every checkpoint, so the
        allow-list must reach it; the wrapper's own ``serde`` is the inner one's.
        """
        inner = self.inner.with_allowlist(extra_allowlist)
        if inner is self.inner:
            return self
        copy = FencedCheckpointer(inner, require_fence=self.require_fence)
        copy.admin = self.admin
        copy.instance = self.instance
        return copy

    @property
    def config_specs(self) -> list[Any]:
        specs: list[Any] = self.inner.config_specs
        return specs

    def get_next_version(self, current: Any, channel: None) -> Any:
        return self.inner.get_next_version(current, channel)

    def tenant_of(self, tenant_id: str | None) -> str:
        """The tenant a call that names ``tenant_id`` (``None``: none) acts on: the one way
        every call of this saver resolves a missing tenant, reads, writes and admin calls
        alike. The owning instance's tenant (``Instance.open(url, tenant_id=...)``, default
        :data:`DEFAULT_TENANT`), or :data:`DEFAULT_TENANT` for a wrapper no instance owns."""
        if tenant_id is not None:
            return tenant_id
        return DEFAULT_TENANT if self.instance is None else self.instance.tenant_id

    # -- reads: never fenced; each sees the tenant's own threads only

    def _tenanted(self, config: Any) -> Any:
        return self.thread_names.tenanted(
            config, None if self.instance is None else self.instance.tenant_id
        )

    @contextmanager
    def primed(self, config: RunnableConfig, found: CheckpointTuple | None) -> Iterator[None]:
        """Within the block (and the tasks it starts), the first read of the latest
        checkpoint of ``config``'s thread (its root namespace, no ``checkpoint_id``)
        answers ``found`` without reading, once; a write first, and it reads as usual.

        For a caller that read it where nothing could have written since: a run just
        taken over, whose take fenced every other writer of its thread.
        """
        token = _PRIMED.set([(self._primed_key(self._tenanted(config)), found)])
        try:
            yield
        finally:
            _PRIMED.reset(token)

    def _primed_key(self, config: Any) -> tuple[int, str, str, str]:
        configurable = config.get("configurable") or {}
        return (
            id(self),  # this saver's read: another saver's store may hold another thread
            str(thread_tenant(config)),
            str(configurable.get("thread_id")),
            str(configurable.get("checkpoint_ns") or ""),
        )

    async def aget_tuple(self, config: RunnableConfig) -> CheckpointTuple | None:
        config = self._tenanted(config)
        primed = _PRIMED.get()
        if primed and get_checkpoint_id(config) is None:
            key, found = primed[0]
            if key == self._primed_key(config):
                primed.clear()
                return found
        found = await self.inner.aget_tuple(self.thread_names.inner_config(config))
        legacy = self.thread_names.legacy_config(config) if found is None else None
        if legacy is not None:
            found = await self.inner.aget_tuple(legacy)
        return self.thread_names.outer_tuple(found)

    async def alist(
        self,
        config: RunnableConfig | None,
        *,
        filter: dict[str, Any] | None = None,
        before: RunnableConfig | None = None,
        limit: int | None = None,
    ) -> AsyncIterator[CheckpointTuple]:
        config, before = self._tenanted(config), self._tenanted(before)
        own, inner_limit = self.thread_names.own_items(config, limit)
        listed = 0
        async for item in self.inner.alist(
            self.thread_names.inner_config(config),
            filter=filter,
            before=self.thread_names.inner_config(before),
            limit=inner_limit,
        ):
            outer = own(item)
            if outer is None:
                continue
            if limit is not None and listed >= limit:
                return
            listed += 1
            yield outer

    def get_tuple(self, config: RunnableConfig) -> CheckpointTuple | None:
        config = self._tenanted(config)
        found = self.inner.get_tuple(self.thread_names.inner_config(config))
        legacy = self.thread_names.legacy_config(config) if found is None else None
        if legacy is not None:
            found = self.inner.get_tuple(legacy)
        return self.thread_names.outer_tuple(found)

    def list(
        self,
        config: RunnableConfig | None,
        *,
        filter: dict[str, Any] | None = None,
        before: RunnableConfig | None = None,
        limit: int | None = None,
    ) -> Iterator[CheckpointTuple]:
        config, before = self._tenanted(config), self._tenanted(before)
        own, inner_limit = self.thread_names.own_items(config, limit)
        items = self.inner.list(
            self.thread_names.inner_config(config),
            filter=filter,
            before=self.thread_names.inner_config(before),
            limit=inner_limit,
        )
        mine = (outer for item in items if (outer := own(item)) is not None)
        if limit is None:
            return mine
        return (item for _, item in zip(range(limit), mine, strict=False))

    # -- writes

    def _handle(self, config: RunnableConfig, action: str) -> RunHandle | None:
        handle = fence_handle(config)
        if handle is None and self.require_fence:
            if self.instance is not None:
                raise ExecutionContextUnavailableError(
                    f"{action} refused: a write of the checkpointer of instance "
                    f"{self.instance.instance_id!r} outside any run of it (no run handle at "
                    f'config["configurable"]["{FENCE_CONFIG_KEY}"]) would be unfenced. Call '
                    "the graph compiled with checkpointer=instance.checkpointer the LangGraph "
                    "way (graph.ainvoke/astream/astream_events/aupdate_state, or graph.invoke/"
                    "stream/update_state with Instance.open_sync) or instance.ainvoke(graph, "
                    "...): each takes the execution's lease first"
                )
            raise ExecutionContextUnavailableError(
                f"{action} refused: this FencedCheckpointer requires a run handle at "
                f'config["configurable"]["{FENCE_CONFIG_KEY}"] and the config has none. Run '
                "the graph through the runtime (Instance.ainvoke), or build the wrapper with "
                "require_fence=False to let unfenced writes through"
            )
        return handle

    def _guards(self, handle: RunHandle) -> bool:
        guards = getattr(self.inner, "guards", None)
        return callable(guards) and bool(guards(handle))

    def _delegates(self, handle: RunHandle, config: RunnableConfig, action: str) -> bool:
        """True when the inner saver checks the token itself: the write is delegated,
        the local checks made first (by the inner saver, when it says it makes them)."""
        # Whether the inner saver guards a handle is a matter of the handle's store, which
        # a handle keeps for its life: asked once per run, not once per write.
        if handle is not self._guarded_handle:
            if not self._guards(handle):
                return False
            self._guarded_handle = handle
        if not self._inner_admits:
            admit_write(handle, config, action)
        return True

    async def aput(
        self,
        config: RunnableConfig,
        checkpoint: Checkpoint,
        metadata: CheckpointMetadata,
        new_versions: ChannelVersions,
    ) -> RunnableConfig:
        names = self.thread_names

        _unprime()

        async def delegated(config: RunnableConfig) -> RunnableConfig:
            saved = await self.inner.aput(
                names.inner_config(config), checkpoint, metadata, new_versions
            )
            return names.outer_config(saved)  # type: ignore[no-any-return]

        async def outside(handle: RunHandle, inner_config: RunnableConfig) -> RunnableConfig:
            await fault_point(
                "checkpoint.before", config=config, checkpoint=checkpoint, metadata=metadata
            )
            saved = await delegated(inner_config)
            keys = checkpoint_clear_keys(handle, config, checkpoint["id"])
            if keys:
                # Not in the inner write's transaction: a crash in between leaves the
                # entries standing, and their steps are dead-lettered instead of repeated.
                await handle.clear_pending_effects(keys)
            proven = handle.proofs.stored(_checkpoint_at(config, checkpoint["id"]), keys)
            if proven:  # their writes landed while this checkpoint was in flight
                await handle.clear_pending_effects(proven)
            await fault_point(
                "checkpoint.after", config=config, checkpoint=checkpoint, metadata=metadata
            )
            return saved

        return await self._write(config, "aput", delegated, outside)

    async def aput_writes(
        self,
        config: RunnableConfig,
        writes: Sequence[tuple[str, Any]],
        task_id: str,
        task_path: str = "",
    ) -> None:
        _unprime()

        async def delegated(config: RunnableConfig) -> None:
            await self.inner.aput_writes(
                self.thread_names.inner_config(config), writes, task_id, task_path
            )

        async def outside(handle: RunHandle, inner_config: RunnableConfig) -> None:
            await fault_point("writes.before", config=config, task_id=task_id, writes=writes)
            await delegated(inner_config)
            await fault_point("writes.after", config=config, task_id=task_id, writes=writes)
            keys = writes_clear_keys(handle, task_id, writes)
            # Writes whose checkpoint (or an ancestor's) is not stored are seen by no
            # resume: they prove nothing, and the run's checkpoint that completes their
            # proof clears the entries instead.
            if keys:
                proof = writes_proof(config)
                if await self._all_stored(self.thread_names.inner_config(inner_config), proof):
                    await handle.clear_pending_effects(keys)
                elif proven := handle.proofs.landed_unproven(keys, proof):
                    await handle.clear_pending_effects(proven)

        await self._write(config, "aput_writes", delegated, outside)

    async def _write(
        self,
        config: RunnableConfig,
        action: str,
        delegated: Callable[[RunnableConfig], Awaitable[T]],
        outside: Callable[[RunHandle, RunnableConfig], Awaitable[T]],
    ) -> T:
        """A checkpoint write: ``delegated(config)`` to the inner saver unfenced, or fenced
        when the inner saver checks the token itself; else ``outside(handle, config)``, the
        write after this wrapper's own check (by one read), with the config the inner saver
        may see. A refusal is recorded on the run."""
        handle = self._handle(config, action)
        if handle is None:
            return await delegated(config)
        # A checkpoint write of the tree keeps its lease held (re-taken first if yielded).
        activity = handle.activity
        if not activity.enter_held():
            await activity.enter()
        try:
            if self._delegates(handle, config, action):
                write = delegated(config)
            else:
                admit_write(handle, config, action)
                self._loop = asyncio.get_running_loop()
                await check_held(handle, config, action)
                write = outside(handle, without_handle(config))
            try:
                if handle.before_root_write is not None and not _namespace(config):
                    # What the run stores before a root write (its recorded stream's
                    # events), whichever saver makes the write; refused as the write is.
                    try:
                        await handle.before_root_write()
                    except BaseException:
                        if isinstance(write, Coroutine):
                            write.close()  # never begun
                        raise
                return await write
            except ExecutionLeaseLostError as exc:
                raise refuse_write(handle, config, exc) from None
        finally:
            activity.leave()

    async def _all_stored(self, inner_config: Any, proof: Sequence[CheckpointAt]) -> bool:
        """Whether the inner saver has every checkpoint of ``proof`` (one read each)."""
        configurable = inner_config["configurable"]
        for ns, checkpoint_id in proof:
            at = {**configurable, "checkpoint_ns": ns, "checkpoint_id": checkpoint_id}
            if await self.inner.aget_tuple({"configurable": at}) is None:
                return False
        return True

    # -- admin operations: under the execution's lease when the wrapper is an instance's

    def admin_for(self, tenant_id: str) -> ThreadAdmin | None:
        """The admin that holds leases for an operation on ``tenant_id``'s threads, or
        ``None``: no instance attached one, or the legacy tenant ``""``, which no lease (so
        no fenced run) can be of."""
        if self.admin is None or tenant_id == LEGACY_TENANT:
            return None
        return self.admin

    async def _adelete_inner(self, thread_id: str, tenant_id: str) -> None:
        """Delete the tenant's thread from the inner saver (and its legacy id, if any)."""
        inner_id, tenant = self.thread_names.thread_call(thread_id, tenant_id)
        await self.inner.adelete_thread(inner_id, **tenant)
        legacy = self.thread_names.legacy_thread(tenant_id, thread_id)
        if legacy is not None:
            await self.inner.adelete_thread(legacy)

    async def adelete_thread(self, thread_id: str, *, tenant_id: str | None = None) -> None:
        """Erase the tenant's ``thread_id``: with no ``tenant_id``, the thread a run with no
        tenant wrote (:meth:`tenant_of`: the instance's tenant, else the default tenant).

        Through an instance's checkpointer (``instance.checkpointer``), under the lease of
        the thread's execution (refused with ``ExecutionLeaseHeldError`` while another
        holder of it, or of any execution erased with it, runs it), everything derived from
        the thread is deleted: every checkpoint, blob and write of the thread, the
        execution's record, its submitted and queued runs (inputs, outputs, reasons), the
        thread's binding, the store items its runs wrote (``instance.store``), the sink's
        stored results of its scope key, and the lease's reason and stamps; and so, the same
        way, is every ``ANY_INSTANCE`` child execution it spawned, and theirs (the children
        hold what the parent passed them). Each lease row stays ``done`` (its epoch never
        goes back) and so does the sink's high-water mark (a scope key and a token). See
        :mod:`langgraph_fence.saver.admin`. Over a wrapper no instance owns, or for the legacy
        tenant ``""``, only the checkpoints, blobs and writes are deleted.
        """
        _unprime()
        tenant_id = self.tenant_of(tenant_id)
        admin = self.admin_for(tenant_id)
        if admin is None:
            await self._adelete_inner(thread_id, tenant_id)
            return
        await admin.erase(
            tenant_id, str(thread_id), lambda thread: self._adelete_inner(thread, tenant_id)
        )

    def delete_thread(self, thread_id: str, *, tenant_id: str | None = None) -> None:
        """Sync twin of :meth:`adelete_thread`."""
        tenant_id = self.tenant_of(tenant_id)
        if self.admin_for(tenant_id) is not None:
            self.run_sync(lambda: self.adelete_thread(thread_id, tenant_id=tenant_id))
            return
        inner_id, tenant = self.thread_names.thread_call(thread_id, tenant_id)
        self.inner.delete_thread(inner_id, **tenant)
        legacy = self.thread_names.legacy_thread(tenant_id, thread_id)
        if legacy is not None:
            self.inner.delete_thread(legacy)

    # -- sync twins of the writes

    def run_sync(self, coro_fn: Callable[[], Coroutine[Any, Any, T]]) -> T:
        """Run the async write on the loop the saver serves, from a worker thread."""
        loop = self._loop or getattr(self.inner, "loop", None)
        running = running_loop()
        if running is not None and (loop is None or running is loop):
            raise asyncio.InvalidStateError(_LOOP_THREAD_ERROR.format(name="FencedCheckpointer"))
        if isinstance(loop, asyncio.AbstractEventLoop) and loop.is_running():
            return hop(loop, coro_fn)
        # No loop serves this saver (a plain sync program): run the check on a loop of our own.
        return asyncio.run(coro_fn())

    def put(
        self,
        config: RunnableConfig,
        checkpoint: Checkpoint,
        metadata: CheckpointMetadata,
        new_versions: ChannelVersions,
    ) -> RunnableConfig:
        if self._handle(config, "put") is None:
            stored = self.inner.put(
                self.thread_names.inner_config(config), checkpoint, metadata, new_versions
            )
            return self.thread_names.outer_config(stored)  # type: ignore[no-any-return]
        return self.run_sync(lambda: self.aput(config, checkpoint, metadata, new_versions))

    def put_writes(
        self,
        config: RunnableConfig,
        writes: Sequence[tuple[str, Any]],
        task_id: str,
        task_path: str = "",
    ) -> None:
        if self._handle(config, "put_writes") is None:
            self.inner.put_writes(
                self.thread_names.inner_config(config), writes, task_id, task_path
            )
            return
        self.run_sync(lambda: self.aput_writes(config, writes, task_id, task_path))


def _class_for(inner_type: type) -> type[FencedCheckpointer]:
    """The FencedCheckpointer class that overrides exactly what ``inner_type`` overrides."""
    names = frozenset(
        name
        for name in FencedCheckpointer.OPTIONAL_METHODS
        if getattr(inner_type, name, None) is not getattr(BaseCheckpointSaver, name)
    )
    cls = FencedCheckpointer._classes.get(names)
    if cls is None:
        namespace: dict[str, Any] = {name: OPTIONAL_IMPLEMENTATIONS[name] for name in names}
        namespace["__module__"] = FencedCheckpointer.__module__
        namespace["__qualname__"] = FencedCheckpointer.__qualname__
        namespace["__doc__"] = FencedCheckpointer.__doc__
        cls = type("FencedCheckpointer", (FencedCheckpointer,), namespace)
        FencedCheckpointer._classes[names] = cls
    return cls


def _namespace(config: RunnableConfig) -> str:
    """The checkpoint namespace a write's config names (``""``: the root graph's)."""
    return str((config.get("configurable") or {}).get("checkpoint_ns") or "")

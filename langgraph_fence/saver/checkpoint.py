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
    Callable,
    Collection,
    Coroutine,
    Iterator,
    Mapping,
    Sequence,
)
from typing import TYPE_CHECKING, Any, ClassVar, Protocol, TypeVar

from langchain_core.runnables import RunnableConfig
from langgraph.checkpoint.base import (
    BaseCheckpointSaver,
    ChannelVersions,
    Checkpoint,
    CheckpointMetadata,
    CheckpointTuple,
    DeltaChannelHistory,
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
from langgraph_fence.fence.tenancy import (
    DEFAULT_TENANT,
    LEGACY_TENANT,
    inner_thread_id,
    legacy_thread_id,
    outer_thread_id,
    plain_tenant,
    thread_tenant,
)
from langgraph_fence.from_thread import hop
from langgraph_fence.keys import FENCE_CONFIG_KEY
from langgraph_fence.lease.faults import fault_point
from langgraph_fence.serde import strict_serde

if TYPE_CHECKING:
    from langgraph_fence.saver.admin import ThreadAdmin

__all__ = ["FencedCheckpointer", "GraphRunner"]

logger = logging.getLogger(__name__)

T = TypeVar("T")


def _checkpoint_at(config: RunnableConfig, checkpoint_id: str) -> CheckpointAt:
    return (str((config.get("configurable") or {}).get("checkpoint_ns") or ""), checkpoint_id)


def _without_handle(config: RunnableConfig) -> RunnableConfig:
    # The handle goes, its tenant stays: the inner saver writes the tenant's own thread.
    tenant_id = thread_tenant(config)
    configurable = {k: v for k, v in config["configurable"].items() if k != FENCE_CONFIG_KEY}
    if tenant_id != DEFAULT_TENANT:
        configurable["tenant_id"] = tenant_id
    return {**config, "configurable": configurable}


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
        self._scopes_tenants = bool(getattr(inner, "scopes_tenants", False))
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

    # -- tenants: a saver that keys threads by tenant itself gets the configs as they are

    def _inner_config(self, config: RunnableConfig | None) -> Any:
        """``config`` as the inner saver must see it to keep the tenant's thread apart."""
        if self._scopes_tenants or not isinstance(config, Mapping):
            return config
        configurable = config.get("configurable") or {}
        if configurable.get("thread_id") is None:
            # alist over all threads: the inner saver lists every thread, filtered here.
            rest = {k: v for k, v in configurable.items() if k != "tenant_id"}
            return {**config, "configurable": rest} if rest else None
        thread_id = str(configurable["thread_id"])
        inner_id = inner_thread_id(thread_tenant(config), thread_id)
        if inner_id == thread_id:
            return config
        return {**config, "configurable": {**configurable, "thread_id": inner_id}}

    def _outer_config(self, config: Any) -> Any:
        """A config the inner saver returned, as the caller names the thread."""
        if self._scopes_tenants or not isinstance(config, Mapping):
            return config
        configurable = config.get("configurable") or {}
        if configurable.get("thread_id") is None:
            return config
        inner_id = str(configurable["thread_id"])
        tenant_id, thread_id = outer_thread_id(inner_id)
        if plain_tenant(tenant_id) and thread_id == inner_id:
            return config
        outer = {**configurable, "thread_id": thread_id}
        if tenant_id != DEFAULT_TENANT:
            outer["tenant_id"] = tenant_id
        return {**config, "configurable": outer}

    def _outer_tuple(self, item: CheckpointTuple | None) -> CheckpointTuple | None:
        if self._scopes_tenants or item is None:
            return item
        return item._replace(
            config=self._outer_config(item.config),
            parent_config=self._outer_config(item.parent_config),
        )

    def _own_items(
        self, config: RunnableConfig | None, limit: int | None
    ) -> tuple[Callable[[CheckpointTuple], CheckpointTuple | None], int | None]:
        """For ``alist``: how to map each inner item (``None``: another tenant's), and the
        limit to ask the inner saver for (none when items must be filtered first)."""
        if self._scopes_tenants:
            return (lambda item: item), limit
        tenant_id = thread_tenant(config)
        named = (
            isinstance(config, Mapping)
            and (config.get("configurable") or {}).get("thread_id") is not None
        )

        def own(item: CheckpointTuple) -> CheckpointTuple | None:
            outer = self._outer_tuple(item)
            assert outer is not None
            return outer if thread_tenant(outer.config) == tenant_id else None

        return own, (limit if named else None)

    def _thread_call(self, thread_id: str, tenant_id: str) -> tuple[str, dict[str, str]]:
        """``(thread id, keyword arguments)`` for an inner admin call on the tenant's thread."""
        if self._scopes_tenants:
            return thread_id, {"tenant_id": tenant_id}
        return inner_thread_id(tenant_id, str(thread_id)), {}

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
        """``config`` with the owning instance's default tenant where it names none: a plain
        ``graph.aget_state(config)`` reads the thread a plain ``graph.ainvoke`` wrote."""
        if self.instance is None or not isinstance(config, Mapping):
            return config
        configurable = config.get("configurable")
        if (
            not isinstance(configurable, Mapping)
            or configurable.get("thread_id") is None
            or configurable.get("tenant_id") is not None
            or FENCE_CONFIG_KEY in configurable
        ):
            return config
        tenant = {**configurable, "tenant_id": self.instance.tenant_id}
        return {**config, "configurable": tenant}

    def _legacy_config(self, config: Any) -> Any:
        """``config`` naming the thread's legacy id (:func:`legacy_thread_id`), or
        ``None``: a saver keyed by tenant, or no legacy id for the thread's tenant."""
        if self._scopes_tenants or not isinstance(config, Mapping):
            return None
        configurable = config.get("configurable") or {}
        if configurable.get("thread_id") is None:
            return None
        tenant_id = thread_tenant(config)  # type: ignore[arg-type]
        legacy = legacy_thread_id(tenant_id, str(configurable["thread_id"]))
        if legacy is None:
            return None
        return {**config, "configurable": {**configurable, "thread_id": legacy}}

    async def aget_tuple(self, config: RunnableConfig) -> CheckpointTuple | None:
        config = self._tenanted(config)
        found = await self.inner.aget_tuple(self._inner_config(config))
        legacy = self._legacy_config(config) if found is None else None
        if legacy is not None:
            found = await self.inner.aget_tuple(legacy)
        return self._outer_tuple(found)

    async def alist(
        self,
        config: RunnableConfig | None,
        *,
        filter: dict[str, Any] | None = None,
        before: RunnableConfig | None = None,
        limit: int | None = None,
    ) -> AsyncIterator[CheckpointTuple]:
        config, before = self._tenanted(config), self._tenanted(before)
        own, inner_limit = self._own_items(config, limit)
        listed = 0
        async for item in self.inner.alist(
            self._inner_config(config),
            filter=filter,
            before=self._inner_config(before),
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
        found = self.inner.get_tuple(self._inner_config(config))
        legacy = self._legacy_config(config) if found is None else None
        if legacy is not None:
            found = self.inner.get_tuple(legacy)
        return self._outer_tuple(found)

    def list(
        self,
        config: RunnableConfig | None,
        *,
        filter: dict[str, Any] | None = None,
        before: RunnableConfig | None = None,
        limit: int | None = None,
    ) -> Iterator[CheckpointTuple]:
        config, before = self._tenanted(config), self._tenanted(before)
        own, inner_limit = self._own_items(config, limit)
        items = self.inner.list(
            self._inner_config(config),
            filter=filter,
            before=self._inner_config(before),
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

    async def _check_outside(
        self, handle: RunHandle, config: RunnableConfig, action: str
    ) -> RunnableConfig:
        """For an inner saver that cannot check the token: check it here, by one read."""
        admit_write(handle, config, action)
        self._loop = asyncio.get_running_loop()
        await check_held(handle, config, action)
        return _without_handle(config)

    async def aput(
        self,
        config: RunnableConfig,
        checkpoint: Checkpoint,
        metadata: CheckpointMetadata,
        new_versions: ChannelVersions,
    ) -> RunnableConfig:
        handle = self._handle(config, "aput")
        if handle is None:
            stored = await self.inner.aput(
                self._inner_config(config), checkpoint, metadata, new_versions
            )
            return self._outer_config(stored)  # type: ignore[no-any-return]
        # A checkpoint write of the tree keeps its lease held (re-taken first if yielded).
        activity = handle.activity
        if not activity.enter_held():
            await activity.enter()
        try:
            if not self._delegates(handle, config, "aput"):
                return await self._aput_outside(handle, config, checkpoint, metadata, new_versions)
            try:
                saved = await self.inner.aput(
                    self._inner_config(config), checkpoint, metadata, new_versions
                )
            except ExecutionLeaseLostError as exc:
                raise refuse_write(handle, config, exc) from None
            return self._outer_config(saved)  # type: ignore[no-any-return]
        finally:
            activity.leave()

    async def _aput_outside(
        self,
        handle: RunHandle,
        config: RunnableConfig,
        checkpoint: Checkpoint,
        metadata: CheckpointMetadata,
        new_versions: ChannelVersions,
    ) -> RunnableConfig:
        inner_config = await self._check_outside(handle, config, "aput")
        try:
            await fault_point(
                "checkpoint.before", config=config, checkpoint=checkpoint, metadata=metadata
            )
            saved = await self.inner.aput(
                self._inner_config(inner_config), checkpoint, metadata, new_versions
            )
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
            return self._outer_config(saved)  # type: ignore[no-any-return]
        except ExecutionLeaseLostError as exc:
            raise refuse_write(handle, config, exc) from None

    async def aput_writes(
        self,
        config: RunnableConfig,
        writes: Sequence[tuple[str, Any]],
        task_id: str,
        task_path: str = "",
    ) -> None:
        handle = self._handle(config, "aput_writes")
        if handle is None:
            await self.inner.aput_writes(self._inner_config(config), writes, task_id, task_path)
            return
        activity = handle.activity
        if not activity.enter_held():
            await activity.enter()
        try:
            if not self._delegates(handle, config, "aput_writes"):
                await self._aput_writes_outside(handle, config, writes, task_id, task_path)
                return
            try:
                await self.inner.aput_writes(self._inner_config(config), writes, task_id, task_path)
            except ExecutionLeaseLostError as exc:
                raise refuse_write(handle, config, exc) from None
        finally:
            activity.leave()

    async def _aput_writes_outside(
        self,
        handle: RunHandle,
        config: RunnableConfig,
        writes: Sequence[tuple[str, Any]],
        task_id: str,
        task_path: str,
    ) -> None:
        inner_config = await self._check_outside(handle, config, "aput_writes")
        try:
            await fault_point("writes.before", config=config, task_id=task_id, writes=writes)
            tenant_config = self._inner_config(inner_config)
            await self.inner.aput_writes(tenant_config, writes, task_id, task_path)
            await fault_point("writes.after", config=config, task_id=task_id, writes=writes)
            keys = writes_clear_keys(handle, task_id, writes)
            # Writes whose checkpoint (or an ancestor's) is not stored are seen by no
            # resume: they prove nothing, and the run's checkpoint that completes their
            # proof clears the entries instead.
            if keys:
                proof = writes_proof(config)
                if await self._all_stored(tenant_config, proof):
                    await handle.clear_pending_effects(keys)
                elif proven := handle.proofs.landed_unproven(keys, proof):
                    await handle.clear_pending_effects(proven)
        except ExecutionLeaseLostError as exc:
            raise refuse_write(handle, config, exc) from None

    async def _all_stored(self, inner_config: Any, proof: Sequence[CheckpointAt]) -> bool:
        """Whether the inner saver has every checkpoint of ``proof`` (one read each)."""
        configurable = inner_config["configurable"]
        for ns, checkpoint_id in proof:
            at = {**configurable, "checkpoint_ns": ns, "checkpoint_id": checkpoint_id}
            if await self.inner.aget_tuple({"configurable": at}) is None:
                return False
        return True

    # -- admin operations: under the execution's lease when the wrapper is an instance's

    def _admin_for(self, tenant_id: str) -> ThreadAdmin | None:
        """The admin that holds leases for an operation on ``tenant_id``'s threads, or
        ``None``: no instance attached one, or the legacy tenant ``""``, which no lease (so
        no fenced run) can be of."""
        if self.admin is None or tenant_id == LEGACY_TENANT:
            return None
        return self.admin

    async def _adelete_inner(self, thread_id: str, tenant_id: str) -> None:
        """Delete the tenant's thread from the inner saver (and its legacy id, if any)."""
        inner_id, tenant = self._thread_call(thread_id, tenant_id)
        await self.inner.adelete_thread(inner_id, **tenant)
        legacy = None if self._scopes_tenants else legacy_thread_id(tenant_id, str(thread_id))
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
        tenant_id = self.tenant_of(tenant_id)
        admin = self._admin_for(tenant_id)
        if admin is None:
            await self._adelete_inner(thread_id, tenant_id)
            return
        await admin.erase(
            tenant_id, str(thread_id), lambda thread: self._adelete_inner(thread, tenant_id)
        )

    def delete_thread(self, thread_id: str, *, tenant_id: str | None = None) -> None:
        """Sync twin of :meth:`adelete_thread`."""
        tenant_id = self.tenant_of(tenant_id)
        if self._admin_for(tenant_id) is not None:
            self._run_sync(lambda: self.adelete_thread(thread_id, tenant_id=tenant_id))
            return
        inner_id, tenant = self._thread_call(thread_id, tenant_id)
        self.inner.delete_thread(inner_id, **tenant)
        legacy = None if self._scopes_tenants else legacy_thread_id(tenant_id, str(thread_id))
        if legacy is not None:
            self.inner.delete_thread(legacy)

    # -- sync twins of the writes

    def _run_sync(self, coro_fn: Callable[[], Coroutine[Any, Any, T]]) -> T:
        """Run the async write on the loop the saver serves, from a worker thread."""
        loop = self._loop or getattr(self.inner, "loop", None)
        try:
            running = asyncio.get_running_loop()
        except RuntimeError:
            running = None
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
            stored = self.inner.put(self._inner_config(config), checkpoint, metadata, new_versions)
            return self._outer_config(stored)  # type: ignore[no-any-return]
        return self._run_sync(lambda: self.aput(config, checkpoint, metadata, new_versions))

    def put_writes(
        self,
        config: RunnableConfig,
        writes: Sequence[tuple[str, Any]],
        task_id: str,
        task_path: str = "",
    ) -> None:
        if self._handle(config, "put_writes") is None:
            self.inner.put_writes(self._inner_config(config), writes, task_id, task_path)
            return
        self._run_sync(lambda: self.aput_writes(config, writes, task_id, task_path))


# -- optional methods: forwarded only where the inner saver's class overrides them. Admin
# operations on whole threads and runs: under the executions' leases when an instance owns
# the wrapper (see _admin_for).


# Each within one tenant (FencedCheckpointer.tenant_of when none is given), as the reads
# are. Run ids are global: over a saver that does not key threads by tenant,
# delete_for_runs is not scoped to one tenant (a run id is one run's, of one tenant, anyway).


def _tenant_kw(self: FencedCheckpointer, tenant_id: str) -> dict[str, str]:
    return {"tenant_id": tenant_id} if self._scopes_tenants else {}


def _threads(self: FencedCheckpointer, thread_ids: Sequence[str], tenant_id: str) -> Any:
    if self._scopes_tenants or isinstance(thread_ids, str):
        return thread_ids  # a str: the inner saver refuses it with its own message
    return [inner_thread_id(tenant_id, str(t)) for t in thread_ids]


async def _run_threads(
    self: FencedCheckpointer, tenant_id: str, run_ids: Sequence[str]
) -> list[str]:
    """The tenant's threads holding a checkpoint of any of ``run_ids``."""
    threads: set[str] = set()
    for run_id in run_ids:
        async for item in self.alist(
            {"configurable": {"tenant_id": tenant_id}}, filter={"run_id": run_id}
        ):
            threads.add(str(item.config["configurable"]["thread_id"]))
    return sorted(threads)


async def _adelete_for_runs(
    self: FencedCheckpointer, run_ids: Sequence[str], *, tenant_id: str | None = None
) -> None:
    tenant_id = self.tenant_of(tenant_id)
    admin = self._admin_for(tenant_id)
    if admin is None or isinstance(run_ids, str):  # a str: the inner saver refuses it
        await self.inner.adelete_for_runs(run_ids, **_tenant_kw(self, tenant_id))
        return
    threads = await _run_threads(self, tenant_id, run_ids)
    while True:
        async with admin.hold(tenant_id, threads, action="delete_for_runs"):
            # Looked up again under the holds: a run whose first checkpoint landed after
            # the first look-up is on a thread not held yet. Remaining window: a first
            # checkpoint landing between this look-up and the delete.
            found = await _run_threads(self, tenant_id, run_ids)
            if set(found) <= set(threads):
                await self.inner.adelete_for_runs(run_ids, **_tenant_kw(self, tenant_id))
                return
        threads = sorted({*threads, *found})


def _delete_for_runs(
    self: FencedCheckpointer, run_ids: Sequence[str], *, tenant_id: str | None = None
) -> None:
    tenant_id = self.tenant_of(tenant_id)
    if self._admin_for(tenant_id) is not None:
        self._run_sync(lambda: _adelete_for_runs(self, run_ids, tenant_id=tenant_id))
        return
    self.inner.delete_for_runs(run_ids, **_tenant_kw(self, tenant_id))


async def _acopy_thread(
    self: FencedCheckpointer,
    source_thread_id: str,
    target_thread_id: str,
    *,
    tenant_id: str | None = None,
) -> None:
    tenant_id = self.tenant_of(tenant_id)
    source, target = _threads(self, [source_thread_id, target_thread_id], tenant_id)
    admin = self._admin_for(tenant_id)
    if admin is None:
        await self.inner.acopy_thread(source, target, **_tenant_kw(self, tenant_id))
        return
    # The target is held: the copy writes into it. The source is only read (reads are
    # never fenced).
    async with admin.hold(tenant_id, [str(target_thread_id)], action="copy_thread"):
        await self.inner.acopy_thread(source, target, **_tenant_kw(self, tenant_id))


def _copy_thread(
    self: FencedCheckpointer,
    source_thread_id: str,
    target_thread_id: str,
    *,
    tenant_id: str | None = None,
) -> None:
    tenant_id = self.tenant_of(tenant_id)
    if self._admin_for(tenant_id) is not None:
        self._run_sync(
            lambda: _acopy_thread(self, source_thread_id, target_thread_id, tenant_id=tenant_id)
        )
        return
    source, target = _threads(self, [source_thread_id, target_thread_id], tenant_id)
    self.inner.copy_thread(source, target, **_tenant_kw(self, tenant_id))


async def _aprune(
    self: FencedCheckpointer,
    thread_ids: Sequence[str],
    *,
    strategy: str = "keep_latest",
    tenant_id: str | None = None,
) -> None:
    tenant_id = self.tenant_of(tenant_id)
    admin = self._admin_for(tenant_id)
    inner_ids = _threads(self, thread_ids, tenant_id)
    if admin is None or isinstance(thread_ids, str):  # a str: the inner saver refuses it
        await self.inner.aprune(inner_ids, strategy=strategy, **_tenant_kw(self, tenant_id))
        return
    async with admin.hold(tenant_id, [str(t) for t in thread_ids], action="prune"):
        await self.inner.aprune(inner_ids, strategy=strategy, **_tenant_kw(self, tenant_id))


def _prune(
    self: FencedCheckpointer,
    thread_ids: Sequence[str],
    *,
    strategy: str = "keep_latest",
    tenant_id: str | None = None,
) -> None:
    tenant_id = self.tenant_of(tenant_id)
    if self._admin_for(tenant_id) is not None:
        self._run_sync(lambda: _aprune(self, thread_ids, strategy=strategy, tenant_id=tenant_id))
        return
    self.inner.prune(
        _threads(self, thread_ids, tenant_id), strategy=strategy, **_tenant_kw(self, tenant_id)
    )


async def _aget_delta_channel_history(
    self: FencedCheckpointer, *, config: RunnableConfig, channels: Sequence[str]
) -> Mapping[str, DeltaChannelHistory]:
    return await self.inner.aget_delta_channel_history(
        config=self._inner_config(config), channels=channels
    )


def _get_delta_channel_history(
    self: FencedCheckpointer, *, config: RunnableConfig, channels: Sequence[str]
) -> Mapping[str, DeltaChannelHistory]:
    return self.inner.get_delta_channel_history(
        config=self._inner_config(config), channels=channels
    )


_OPTIONAL_IMPLEMENTATIONS: dict[str, Callable[..., Any]] = {
    "adelete_for_runs": _adelete_for_runs,
    "delete_for_runs": _delete_for_runs,
    "acopy_thread": _acopy_thread,
    "copy_thread": _copy_thread,
    "aprune": _aprune,
    "prune": _prune,
    "aget_delta_channel_history": _aget_delta_channel_history,
    "get_delta_channel_history": _get_delta_channel_history,
}


def _class_for(inner_type: type) -> type[FencedCheckpointer]:
    """The FencedCheckpointer class that overrides exactly what ``inner_type`` overrides."""
    names = frozenset(
        name
        for name in FencedCheckpointer.OPTIONAL_METHODS
        if getattr(inner_type, name, None) is not getattr(BaseCheckpointSaver, name)
    )
    cls = FencedCheckpointer._classes.get(names)
    if cls is None:
        namespace: dict[str, Any] = {name: _OPTIONAL_IMPLEMENTATIONS[name] for name in names}
        namespace["__module__"] = FencedCheckpointer.__module__
        namespace["__qualname__"] = FencedCheckpointer.__qualname__
        namespace["__doc__"] = FencedCheckpointer.__doc__
        cls = type("FencedCheckpointer", (FencedCheckpointer,), namespace)
        FencedCheckpointer._classes[names] = cls
    return cls

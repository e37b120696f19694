"""The store side of the fence: LangGraph's long-term memory written under the step's token.

:class:`FencedStore` wraps any LangGraph ``BaseStore`` (``InMemoryStore``, the official
``PostgresStore``, :class:`checkpointers.store.SqlStore`). A node or tool finds the store
through LangGraph (``compile(store=...)``, then ``runtime.store`` / ``get_store()``); the step
making the call is found by its fence (:func:`~langgraph_fence.fence.running_handle`), so
no config has to travel with the op.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any
from urllib.parse import quote

from langgraph.store.base import (
    BaseStore,
    GetOp,
    Item,
    ListNamespacesOp,
    MatchCondition,
    Op,
    PutOp,
    Result,
    SearchItem,
    SearchOp,
)

from langgraph_fence.fence import RunHandle, running_handle
from langgraph_fence.fence.admission import check_held, checked_ops, step_config
from langgraph_fence.fence.tenancy import DEFAULT_TENANT
from langgraph_fence.from_thread import run_on_loop
from langgraph_fence.validate import storable_text

__all__ = ["FencedStore", "tenant_label"]


def tenant_label(tenant_id: str) -> str:
    """The namespace label a tenant's items sit under in a store that does not key items by
    tenant itself: never empty, no period, one per tenant (percent-encoded, '.' too)."""
    return "fence-tenant:" + quote(tenant_id, safe="").replace(".", "%2E")


def _action(ops: list[Op]) -> str:
    for op in ops:
        if isinstance(op, PutOp):
            kind = "delete" if op.value is None else "put"
            return f"store {kind} of {op.namespace!r}/{op.key!r}"
    return "store write"


class FencedStore(BaseStore):
    """Wraps any LangGraph store so that every write made inside a fenced step is made under
    the step's fencing token.

    Args:
        inner: the store that holds the items.
        tenant_id: whose items a call from outside any fenced step reads and writes
            (default: the default tenant). Inside a step, the lease's tenant.

    Items are keyed by tenant: a tenant never reads, searches, lists or overwrites another
    tenant's items. A store that keys them itself (``scopes_tenants``: :class:`checkpointers.
    store.SqlStore`) gets the ops as they are; any other keeps each tenant's items under a
    first namespace label of the tenant's own (:func:`tenant_label`), added to every op and
    taken off every result, so the items' namespaces read as written. Every namespace and
    key is checked first (:func:`checked_ops`): ``ValueError`` naming the argument and its
    limit, nothing delegated.

    Every ``PutOp`` of a ``batch``/``abatch`` (``put``, and ``delete``: a put of ``None``)
    made inside a fenced step is made under the step's token, with the step's lease held
    (beside a wait of the step for remote children, which may have yielded it, it is taken
    again first); under a superseded token it is refused with
    :class:`~langgraph_fence.ExecutionFencedError`, recorded on the run like a refused
    checkpoint write (the run is drained and ends with that error), and nothing of
    the batch is delegated. Reads, searches and ``list_namespaces`` are never fenced. A write
    from outside any fenced step (an admin script, a migration) is passed through unfenced.

    * **Fence-aware inner store** (``inner.guards(handle)`` is true: a
      :class:`checkpointers.store.SqlStore` on the lease table's database): the token is
      checked inside the inner store's own write statement. **No window.**
    * **Any other store**: the wrapper checks first (locally, then one read of the lease),
      then delegates. **Window:** a take-over committed after that read and before the inner
      write completes is not seen, and that write lands: at most the writes the stale step
      has in flight at that moment (one per concurrent ``abatch``), each over within one
      lease read plus one inner write (measured in ``benchmarks/README.md``). The step's
      next write is refused.
    """

    def __init__(self, inner: BaseStore, *, tenant_id: str = DEFAULT_TENANT) -> None:
        if not isinstance(inner, BaseStore):
            raise ValueError(
                f"inner must be a LangGraph BaseStore (InMemoryStore, PostgresStore, "
                f"SqlStore...), got {type(inner).__name__}"
            )
        if not isinstance(tenant_id, str):
            raise ValueError(f"tenant_id must be a str, got {type(tenant_id).__name__}")
        self.tenant_id = storable_text("tenant_id", tenant_id)
        self.inner = inner
        # A store that keys items by tenant itself (SqlStore) gets ops as they are; any
        # other keeps each tenant's items under a namespace label of the tenant's own.
        self._scopes_tenants = bool(getattr(inner, "scopes_tenants", False))
        # LangGraph asks these of the store it is given: the inner store's answer stands.
        self.supports_ttl = inner.supports_ttl
        self.ttl_config = inner.ttl_config

    def __repr__(self) -> str:
        return f"FencedStore({self.inner!r})"

    def _guards(self, handle: RunHandle) -> bool:
        guards = getattr(self.inner, "guards", None)
        return callable(guards) and bool(guards(handle))

    def _writer(self, ops: list[Op]) -> RunHandle | None:
        """The run handle of the fenced step writing in this batch, or ``None`` (no write,
        or no fenced step)."""
        handle = running_handle()
        if handle is None or not any(isinstance(op, PutOp) for op in ops):
            return None
        return handle

    def _tenant(self) -> str:
        handle = running_handle()
        return self.tenant_id if handle is None else handle.key.tenant_id

    def _scoped(self, ops: list[Op]) -> tuple[list[Op], str | None]:
        """``ops`` as the inner store gets them: under the tenant's label unless it keys
        items by tenant itself; with the label (``None`` when not added)."""
        if self._scopes_tenants:
            return ops, None
        label = tenant_label(self._tenant())
        return [_under(label, op) for op in ops], label

    async def abatch(self, ops: Iterable[Op]) -> list[Result]:
        """Run ``ops`` on the inner store, keyed by tenant; writes inside a fenced step
        under its token.

        Raises:
            ExecutionFencedError: a write under a superseded token (nothing delegated).
            ExecutionLeaseLostError: the step's hold can no longer be proven.
            ValueError: a namespace or key no store can keep (:func:`checked_ops`).
        """
        listed = checked_ops(ops)
        scoped, label = self._scoped(listed)
        handle = self._writer(listed)
        if handle is None:
            return _unscoped(await self.inner.abatch(scoped), label)
        # Counted among the tree's running parts until the inner write is over: a yield
        # (a wait of this step for remote children, in another task of it) never lands
        # between the check and the write, and a yielded lease is taken again first.
        async with handle.activity.held():
            if not self._guards(handle):  # a fence-aware store checks in its own write
                await check_held(handle, step_config(), _action(listed))
            return _unscoped(await self.inner.abatch(scoped), label)

    def batch(self, ops: Iterable[Op]) -> list[Result]:
        """Sync twin of :meth:`abatch` (a sync node in a worker thread): the check runs on
        the run's loop."""
        listed = checked_ops(ops)
        scoped, label = self._scoped(listed)
        handle = self._writer(listed)
        if handle is None:
            return _unscoped(self.inner.batch(scoped), label)
        on_loop = "use the async methods there (await store.aput(...))"
        with handle.activity.held_from_thread(what="a fenced store write", on_loop=on_loop):
            if not self._guards(handle):
                config = step_config()
                run_on_loop(
                    handle.loop,
                    lambda: check_held(handle, config, _action(listed)),
                    what="a fenced store write",
                    on_loop=on_loop,
                )
            return _unscoped(self.inner.batch(scoped), label)


def _under(label: str, op: Op) -> Op:
    """``op`` on the namespaces under ``label``."""
    if isinstance(op, PutOp | GetOp):
        return op._replace(namespace=(label, *op.namespace))
    if isinstance(op, SearchOp):
        return op._replace(namespace_prefix=(label, *op.namespace_prefix))
    if isinstance(op, ListNamespacesOp):
        conditions = list(op.match_conditions or ())
        prefixed = [
            MatchCondition("prefix", (label, *c.path)) if c.match_type == "prefix" else c
            for c in conditions
        ]
        if not any(c.match_type == "prefix" for c in conditions):
            prefixed.append(MatchCondition("prefix", (label,)))
        depth = None if op.max_depth is None else op.max_depth + 1
        return op._replace(match_conditions=tuple(prefixed), max_depth=depth)
    return op


def _unscoped(results: list[Result], label: str | None) -> list[Result]:
    """The inner store's ``results`` with ``label`` taken off every namespace."""
    if label is None:
        return results
    return [_without(label, result) for result in results]


def _without(label: str, result: Any) -> Any:
    # A copy: a store may hand back the very item objects it keeps (InMemoryStore does).
    if isinstance(result, Item):
        fields: dict[str, Any] = {
            "namespace": result.namespace[1:],
            "key": result.key,
            "value": result.value,
            "created_at": result.created_at,
            "updated_at": result.updated_at,
        }
        if isinstance(result, SearchItem):
            return SearchItem(**fields, score=result.score)
        return Item(**fields)
    if isinstance(result, list):
        return [item[1:] if isinstance(item, tuple) else _without(label, item) for item in result]
    return result

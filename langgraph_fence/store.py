"""The store side of the fence: LangGraph's long-term memory written under the step's token.

:class:`FencedStore` wraps any LangGraph ``BaseStore`` (``InMemoryStore``, the official
``PostgresStore``, :class:`checkpointers.store.SqlStore`). A node or tool finds the store
through LangGraph (``compile(store=...)``, then ``runtime.store`` / ``get_store()``); the step
making the call is found by its frame (:func:`~langgraph_fence.context.current_frame`), so
no config has to travel with the op.
"""

from __future__ import annotations

from collections.abc import Iterable

from langgraph.store.base import BaseStore, Op, PutOp, Result

from .checkpoint import check_held, step_config
from .context import current_frame
from .fence import RunHandle
from .from_thread import run_on_loop

__all__ = ["FencedStore"]


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

    def __init__(self, inner: BaseStore) -> None:
        if not isinstance(inner, BaseStore):
            raise ValueError(
                f"inner must be a LangGraph BaseStore (InMemoryStore, PostgresStore, "
                f"SqlStore...), got {type(inner).__name__}"
            )
        self.inner = inner
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
        frame = current_frame()
        if frame is None or not any(isinstance(op, PutOp) for op in ops):
            return None
        return frame._handle

    async def abatch(self, ops: Iterable[Op]) -> list[Result]:
        """Run ``ops`` on the inner store; writes inside a fenced step under its token.

        Raises:
            ExecutionFencedError: a write under a superseded token (nothing delegated).
            ExecutionLeaseLostError: the step's hold can no longer be proven.
        """
        listed = list(ops)
        handle = self._writer(listed)
        if handle is None:
            return await self.inner.abatch(listed)
        # Counted among the tree's running parts until the inner write is over: a yield
        # (a wait of this step for remote children, in another task of it) never lands
        # between the check and the write, and a yielded lease is taken again first.
        async with handle.activity.held():
            if not self._guards(handle):  # a fence-aware store checks in its own write
                await check_held(handle, step_config(), _action(listed))
            return await self.inner.abatch(listed)

    def batch(self, ops: Iterable[Op]) -> list[Result]:
        """Sync twin of :meth:`abatch` (a sync node in a worker thread): the check runs on
        the run's loop."""
        listed = list(ops)
        handle = self._writer(listed)
        if handle is None:
            return self.inner.batch(listed)
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
            return self.inner.batch(listed)

"""The optional saver methods a ``FencedCheckpointer`` forwards, each only where its inner
saver's class implements it (so capability detection sees what the inner saver really does):
deleting runs, copying and pruning threads, and the delta-channel history.

The admin operations act on whole threads and runs, each within one tenant
(``FencedCheckpointer.tenant_of`` when none is given), as the reads are: under the
executions' leases when an instance owns the wrapper (see ``admin_for``). Run ids are
global: over a saver that does not key threads by tenant, ``delete_for_runs`` is not scoped
to one tenant (a run id is one run's, of one tenant, anyway). Each operation is written once,
as the call its inner saver gets (:class:`InnerCall`); its async and sync methods are made
from that.
"""

from __future__ import annotations

import functools
import inspect
from collections.abc import AsyncIterator, Awaitable, Callable, Coroutine, Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Concatenate, ParamSpec, Protocol, TypeVar

from langchain_core.runnables import RunnableConfig
from langgraph.checkpoint.base import BaseCheckpointSaver, CheckpointTuple, DeltaChannelHistory

from langgraph_fence.saver._tenants import ThreadNames

if TYPE_CHECKING:
    from langgraph_fence.saver.admin import ThreadAdmin

__all__ = ["OPTIONAL_IMPLEMENTATIONS", "InnerCall", "Wrapper"]

P = ParamSpec("P")
T = TypeVar("T")


class Wrapper(Protocol):
    """What the optional methods use of the ``FencedCheckpointer`` they are methods of."""

    inner: BaseCheckpointSaver[Any]
    thread_names: ThreadNames

    def tenant_of(self, tenant_id: str | None) -> str:
        """The tenant a call naming ``tenant_id`` (``None``: none) acts on."""
        ...

    def admin_for(self, tenant_id: str) -> ThreadAdmin | None:
        """The admin that holds leases for an operation on the tenant's threads, if any."""
        ...

    def run_sync(self, make: Callable[[], Coroutine[Any, Any, T]]) -> T:
        """Run the async operation on the loop the saver serves, from a worker thread."""
        ...

    def alist(
        self, config: RunnableConfig | None, *, filter: dict[str, Any] | None = None
    ) -> AsyncIterator[CheckpointTuple]:
        """The tenant's checkpoints, newest first."""
        ...


@dataclass(frozen=True, slots=True)
class InnerCall:
    """An admin operation as its inner saver gets it."""

    tenant_id: str
    #: The inner saver's sync method (its async twin is ``"a" + name``), and the action
    #: the execution leases are held for.
    name: str
    args: tuple[Any, ...]
    kwargs: dict[str, Any]
    #: The caller's threads the operation writes, to hold; ``None``: none held (the inner
    #: saver refuses the arguments itself).
    threads: Callable[[], Awaitable[list[str]]] | None
    #: Whether a thread's lease another holder holds is waited for (up to one admin TTL)
    #: rather than refused at once.
    waits: bool = False


async def _listed(thread_ids: Sequence[str]) -> list[str]:
    return [str(t) for t in thread_ids]


async def _run_threads(self: Wrapper, tenant_id: str, run_ids: Sequence[str]) -> list[str]:
    """The tenant's threads holding a checkpoint of any of ``run_ids``."""
    threads: set[str] = set()
    for run_id in run_ids:
        async for item in self.alist(
            {"configurable": {"tenant_id": tenant_id}}, filter={"run_id": run_id}
        ):
            threads.add(str(item.config["configurable"]["thread_id"]))
    return sorted(threads)


def _delete_for_runs(
    self: Wrapper, run_ids: Sequence[str], *, tenant_id: str | None = None
) -> InnerCall:
    tenant_id = self.tenant_of(tenant_id)
    runs = (
        None
        if isinstance(run_ids, str)
        else functools.partial(_run_threads, self, tenant_id, run_ids)
    )
    kw = self.thread_names.tenant_kw(tenant_id)
    # The Agent Server's rollback deletes a run's checkpoints right after it cancelled the
    # run (twice, at once): the cancelled run lets its lease go as its cancel lands, so the
    # delete waits for it rather than fail the rollback.
    return InnerCall(tenant_id, "delete_for_runs", (run_ids,), kw, runs, waits=True)


def _copy_thread(
    self: Wrapper, source_thread_id: str, target_thread_id: str, *, tenant_id: str | None = None
) -> InnerCall:
    tenant_id = self.tenant_of(tenant_id)
    source, target = self.thread_names.threads([source_thread_id, target_thread_id], tenant_id)
    # The target is held: the copy writes into it. The source is only read (reads are
    # never fenced).
    held = functools.partial(_listed, [target_thread_id])
    kw = self.thread_names.tenant_kw(tenant_id)
    return InnerCall(tenant_id, "copy_thread", (source, target), kw, held)


def _prune(
    self: Wrapper,
    thread_ids: Sequence[str],
    *,
    strategy: str = "keep_latest",
    tenant_id: str | None = None,
) -> InnerCall:
    tenant_id = self.tenant_of(tenant_id)
    inner_ids = self.thread_names.threads(thread_ids, tenant_id)
    held = None if isinstance(thread_ids, str) else functools.partial(_listed, thread_ids)
    kw = {"strategy": strategy, **self.thread_names.tenant_kw(tenant_id)}
    return InnerCall(tenant_id, "prune", (inner_ids,), kw, held)


async def _under_holds(
    admin: ThreadAdmin, call: InnerCall, run: Callable[[], Awaitable[Any]]
) -> None:
    assert call.threads is not None
    threads = await call.threads()
    wait = admin.ttl if call.waits else 0.0
    while True:
        async with admin.hold(call.tenant_id, threads, action=call.name, wait=wait):
            # Looked up again under the holds: a run to delete whose first checkpoint
            # landed after the first look-up is on a thread not held yet. Remaining window:
            # a first checkpoint landing between this look-up and the delete.
            found = await call.threads()
            if set(found) <= set(threads):
                await run()
                return
        threads = sorted({*threads, *found})


def _methods(
    plan: Callable[Concatenate[Wrapper, P], InnerCall],
) -> tuple[Callable[..., Coroutine[Any, Any, None]], Callable[..., None]]:
    """The async and the sync method of the admin operation ``plan`` describes (named as
    its sync method, with a leading ``_``)."""
    name = plan.__name__.removeprefix("_")

    async def operation(self: Wrapper, /, *args: P.args, **kwargs: P.kwargs) -> None:
        call = plan(self, *args, **kwargs)
        method = getattr(self.inner, f"a{call.name}")
        admin = self.admin_for(call.tenant_id)
        if admin is None or call.threads is None:
            await method(*call.args, **call.kwargs)
            return
        await _under_holds(admin, call, lambda: method(*call.args, **call.kwargs))

    def sync_operation(self: Wrapper, /, *args: P.args, **kwargs: P.kwargs) -> None:
        call = plan(self, *args, **kwargs)
        if self.admin_for(call.tenant_id) is not None:
            self.run_sync(lambda: operation(self, *args, **kwargs))
            return
        getattr(self.inner, call.name)(*call.args, **call.kwargs)

    signature = inspect.signature(plan).replace(return_annotation="None")
    _name(operation, f"a{name}", signature)
    _name(sync_operation, name, signature)
    return operation, sync_operation


def _name(method: Callable[..., Any], name: str, signature: inspect.Signature) -> None:
    method.__name__ = method.__qualname__ = name
    method.__signature__ = signature  # type: ignore[attr-defined]


async def _aget_delta_channel_history(
    self: Wrapper, *, config: RunnableConfig, channels: Sequence[str]
) -> Mapping[str, DeltaChannelHistory]:
    return await self.inner.aget_delta_channel_history(
        config=self.thread_names.inner_config(config), channels=channels
    )


def _get_delta_channel_history(
    self: Wrapper, *, config: RunnableConfig, channels: Sequence[str]
) -> Mapping[str, DeltaChannelHistory]:
    return self.inner.get_delta_channel_history(
        config=self.thread_names.inner_config(config), channels=channels
    )


_adelete_for_runs, _delete_for_runs_sync = _methods(_delete_for_runs)
_acopy_thread, _copy_thread_sync = _methods(_copy_thread)
_aprune, _prune_sync = _methods(_prune)

#: Each optional method's implementation, by name.
OPTIONAL_IMPLEMENTATIONS: dict[str, Callable[..., Any]] = {
    "adelete_for_runs": _adelete_for_runs,
    "delete_for_runs": _delete_for_runs_sync,
    "acopy_thread": _acopy_thread,
    "copy_thread": _copy_thread_sync,
    "aprune": _aprune,
    "prune": _prune_sync,
    "aget_delta_channel_history": _aget_delta_channel_history,
    "get_delta_channel_history": _get_delta_channel_history,
}

"""How the wrapper names a tenant's thread to its inner saver, and back; no I/O.

A saver that keys threads by tenant itself (``scopes_tenants``, as ``SqlCheckpointer``
does) gets every config as it is. Any other keeps a tenant's thread under an id of its own
(:func:`~langgraph_fence.fence.tenancy.inner_thread_id`), which the wrapper maps back on the
way out, so each tenant sees its own threads only.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any

from langchain_core.runnables import RunnableConfig
from langgraph.checkpoint.base import CheckpointTuple

from langgraph_fence.fence import tenancy
from langgraph_fence.keys import FENCE_CONFIG_KEY

__all__ = ["ThreadNames", "without_handle"]


def without_handle(config: RunnableConfig) -> RunnableConfig:
    """``config`` without its run handle, for an inner saver that cannot guard."""
    # The handle goes, its tenant stays: the inner saver writes the tenant's own thread.
    tenant_id = tenancy.thread_tenant(config)
    configurable = {k: v for k, v in config["configurable"].items() if k != FENCE_CONFIG_KEY}
    if tenant_id != tenancy.DEFAULT_TENANT:
        configurable["tenant_id"] = tenant_id
    return {**config, "configurable": configurable}


class ThreadNames:
    """The thread names of one inner saver.

    Args:
        scopes_tenants: the inner saver keys threads by tenant itself.
    """

    def __init__(self, scopes_tenants: bool) -> None:
        self.scopes_tenants = scopes_tenants

    @staticmethod
    def tenanted(config: Any, tenant_id: str | None) -> Any:
        """``config`` naming ``tenant_id`` (the owning instance's, ``None``: no instance)
        where it names none: a plain ``graph.aget_state(config)`` reads the thread a plain
        ``graph.ainvoke`` wrote."""
        if tenant_id is None or not isinstance(config, Mapping):
            return config
        configurable = config.get("configurable")
        if (
            not isinstance(configurable, Mapping)
            or configurable.get("thread_id") is None
            or configurable.get("tenant_id") is not None
            or FENCE_CONFIG_KEY in configurable
        ):
            return config
        return {**config, "configurable": {**configurable, "tenant_id": tenant_id}}

    def inner_config(self, config: RunnableConfig | None) -> Any:
        """``config`` as the inner saver must see it to keep the tenant's thread apart."""
        if self.scopes_tenants or not isinstance(config, Mapping):
            return config
        configurable = config.get("configurable") or {}
        if configurable.get("thread_id") is None:
            # alist over all threads: the inner saver lists every thread, filtered here.
            rest = {k: v for k, v in configurable.items() if k != "tenant_id"}
            return {**config, "configurable": rest} if rest else None
        thread_id = str(configurable["thread_id"])
        inner_id = tenancy.inner_thread_id(tenancy.thread_tenant(config), thread_id)
        if inner_id == thread_id:
            return config
        return {**config, "configurable": {**configurable, "thread_id": inner_id}}

    def outer_config(self, config: Any) -> Any:
        """A config the inner saver returned, as the caller names the thread."""
        if self.scopes_tenants or not isinstance(config, Mapping):
            return config
        configurable = config.get("configurable") or {}
        if configurable.get("thread_id") is None:
            return config
        inner_id = str(configurable["thread_id"])
        tenant_id, thread_id = tenancy.outer_thread_id(inner_id)
        if tenancy.plain_tenant(tenant_id) and thread_id == inner_id:
            return config
        outer = {**configurable, "thread_id": thread_id}
        if tenant_id != tenancy.DEFAULT_TENANT:
            outer["tenant_id"] = tenant_id
        return {**config, "configurable": outer}

    def outer_tuple(self, item: CheckpointTuple | None) -> CheckpointTuple | None:
        """A checkpoint the inner saver returned, as the caller names its thread."""
        if self.scopes_tenants or item is None:
            return item
        return item._replace(
            config=self.outer_config(item.config),
            parent_config=self.outer_config(item.parent_config),
        )

    def own_items(
        self, config: RunnableConfig | None, limit: int | None
    ) -> tuple[Callable[[CheckpointTuple], CheckpointTuple | None], int | None]:
        """For a listing: how to map each inner item (``None``: another tenant's), and the
        limit to ask the inner saver for (none when items must be filtered first)."""
        if self.scopes_tenants:
            return (lambda item: item), limit
        tenant_id = tenancy.thread_tenant(config)
        named = (
            isinstance(config, Mapping)
            and (config.get("configurable") or {}).get("thread_id") is not None
        )

        def own(item: CheckpointTuple) -> CheckpointTuple | None:
            outer = self.outer_tuple(item)
            assert outer is not None
            return outer if tenancy.thread_tenant(outer.config) == tenant_id else None

        return own, (limit if named else None)

    def legacy_config(self, config: Any) -> Any:
        """``config`` naming the thread's legacy id (:func:`legacy_thread_id`), or
        ``None``: a saver keyed by tenant, or no legacy id for the thread's tenant."""
        if self.scopes_tenants or not isinstance(config, Mapping):
            return None
        configurable = config.get("configurable") or {}
        if configurable.get("thread_id") is None:
            return None
        tenant_id = tenancy.thread_tenant(config)  # type: ignore[arg-type]
        legacy = tenancy.legacy_thread_id(tenant_id, str(configurable["thread_id"]))
        if legacy is None:
            return None
        return {**config, "configurable": {**configurable, "thread_id": legacy}}

    def legacy_thread(self, tenant_id: str, thread_id: str) -> str | None:
        """The legacy id of the tenant's thread in the inner saver, if it has one."""
        return None if self.scopes_tenants else tenancy.legacy_thread_id(tenant_id, str(thread_id))

    def thread_call(self, thread_id: str, tenant_id: str) -> tuple[str, dict[str, str]]:
        """``(thread id, keyword arguments)`` for an inner admin call on the tenant's thread."""
        if self.scopes_tenants:
            return thread_id, {"tenant_id": tenant_id}
        return tenancy.inner_thread_id(tenant_id, str(thread_id)), {}

    def threads(self, thread_ids: Sequence[str], tenant_id: str) -> Any:
        """The tenant's threads as the inner saver names them, for an admin call."""
        if self.scopes_tenants or isinstance(thread_ids, str):
            return thread_ids  # a str: the inner saver refuses it with its own message
        return [tenancy.inner_thread_id(tenant_id, str(t)) for t in thread_ids]

    def tenant_kw(self, tenant_id: str) -> dict[str, str]:
        """The keyword arguments naming the tenant to an inner admin call."""
        return {"tenant_id": tenant_id} if self.scopes_tenants else {}

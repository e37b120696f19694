"""Which tenant a thread belongs to, and how a saver that knows no tenants keeps it.

A thread's key is ``(tenant, thread_id)``: a tenant's ``chat-1`` and another tenant's
``chat-1`` never meet. Savers that key threads by tenant (``SqlCheckpointer``) store the
pair; any other saver keeps a tenant's thread under an id of its own
(:func:`inner_thread_id`).
"""

from __future__ import annotations

from collections.abc import Mapping
from urllib.parse import unquote

from langchain_core.runnables import RunnableConfig

from langgraph_fence.fence import RunHandle
from langgraph_fence.keys import FENCE_CONFIG_KEY
from langgraph_fence.lease.scope import encode_part

__all__ = [
    "DEFAULT_TENANT",
    "LEGACY_TENANT",
    "TENANT_THREAD",
    "inner_thread_id",
    "legacy_thread_id",
    "outer_thread_id",
    "plain_tenant",
    "thread_tenant",
]


#: The one default tenant: of a thread read, written or erased with no tenant given (plain
#: LangGraph use), through a bare saver and through an instance that was given no
#: ``tenant_id`` alike. A tenant like any other: a run the LangGraph way with no tenant holds
#: a lease of it, and ``adelete_thread(thread_id)`` erases that run's thread.
DEFAULT_TENANT = "default"

#: The tenant that rows written with no tenant while the default tenant was the empty string
#: keep where they could not be moved to :data:`DEFAULT_TENANT` (version 3 of the
#: ``checkpoints`` component: the thread had rows of that tenant too, or a lease of another
#: tenant names it): read them with ``configurable["tenant_id"] = ""``. No lease can be of
#: it, so nothing fences its threads.
LEGACY_TENANT = ""


def thread_tenant(config: RunnableConfig | None) -> str:
    """The tenant a thread read or write belongs to: part of the thread's key.

    ``config["configurable"]["tenant_id"]`` when given, else the tenant of the run handle at
    ``config["configurable"]["__fence"]``, else :data:`DEFAULT_TENANT`. A tenant's
    ``chat-1`` and another tenant's ``chat-1`` are two threads that never meet.

    Raises:
        ValueError: ``tenant_id`` is not a str.
    """
    configurable = config.get("configurable") if isinstance(config, Mapping) else None
    if not isinstance(configurable, Mapping):
        return DEFAULT_TENANT
    tenant_id = configurable.get("tenant_id")
    if tenant_id is None:
        handle = configurable.get(FENCE_CONFIG_KEY)
        return handle.key.tenant_id if isinstance(handle, RunHandle) else DEFAULT_TENANT
    if not isinstance(tenant_id, str):
        raise ValueError(
            f'config["configurable"]["tenant_id"] must be a str (the tenant the thread belongs '
            f"to), got {type(tenant_id).__name__}: pass the tenant's id as text, or leave the "
            "key out for the default tenant"
        )
    return tenant_id


#: How a saver that does not key threads by tenant stores a tenant's thread (see below).
TENANT_THREAD = "lgf-tenant:"


def plain_tenant(tenant_id: str) -> bool:
    """Whether a saver that knows no tenants keeps ``tenant_id``'s thread ids as they are."""
    return tenant_id in (DEFAULT_TENANT, LEGACY_TENANT)


def inner_thread_id(tenant_id: str, thread_id: str) -> str:
    """The thread id under which a saver that knows no tenants keeps the tenant's thread.

    The default tenant's ids are kept as they are (plain LangGraph use sees its own ids);
    any other tenant's become ``lgf-tenant:<tenant>:<thread>``, each part encoded as in a
    scope key, so no two ``(tenant, thread)`` pairs share one: a default-tenant id that
    itself starts with the prefix is encoded too, with an empty tenant part.
    """
    if plain_tenant(tenant_id) and not thread_id.startswith(TENANT_THREAD):
        return thread_id
    tenant_part = "" if plain_tenant(tenant_id) else encode_part(tenant_id, name="tenant_id")
    return f"{TENANT_THREAD}{tenant_part}:{encode_part(thread_id, name='thread_id')}"


def legacy_thread_id(tenant_id: str, thread_id: str) -> str | None:
    """Where an instance kept the default tenant's thread over a saver that knows no tenants
    while a bare saver's default was the empty string (``lgf-tenant:default:<thread>``): read
    when the thread has no checkpoint under its own id, erased with it."""
    if tenant_id != DEFAULT_TENANT:
        return None
    tenant_part = encode_part(tenant_id, name="tenant_id")
    return f"{TENANT_THREAD}{tenant_part}:{encode_part(thread_id, name='thread_id')}"


def outer_thread_id(inner_id: str) -> tuple[str, str]:
    """``(tenant_id, thread_id)`` of an id made by :func:`inner_thread_id`."""
    if not inner_id.startswith(TENANT_THREAD):
        return DEFAULT_TENANT, inner_id
    tenant_part, _, thread_part = inner_id[len(TENANT_THREAD) :].partition(":")
    return unquote(tenant_part) or DEFAULT_TENANT, unquote(thread_part)

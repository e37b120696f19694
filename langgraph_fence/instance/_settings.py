"""An instance's settings, checked before anything exists: its holder id, lease TTL, renew
interval, takeover budget, ``max_held``, where its renewals run and its default tenant; and
the records it finds executions in unless given its own.

Every check raises ``ValueError`` naming the argument and the fix.
"""

from __future__ import annotations

import inspect
import os
import socket
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from langgraph_fence.execution.keeper import Renewer
from langgraph_fence.execution.serve import check_budget
from langgraph_fence.fence import safety_margin
from langgraph_fence.fence.tenancy import DEFAULT_TENANT
from langgraph_fence.lease import ExecutionLeaseRepository
from langgraph_fence.lease.records import (
    ExecutionRecords,
    MemoryExecutionRecords,
    SqlExecutionRecords,
)
from langgraph_fence.lease.stores import base_store
from langgraph_fence.lease.transitions import DEFAULT_MAX_TAKEOVERS
from langgraph_fence.validate import positive_int, positive_seconds, text_id

#: The tenant of a graph called the LangGraph way whose config names none (``tenant_id=``):
#: the one default tenant, :data:`langgraph_fence.fence.tenancy.DEFAULT_TENANT`.
DEFAULT_TENANT_ID = DEFAULT_TENANT


@dataclass(frozen=True, slots=True)
class Settings:
    """An instance's id, lease TTL, renew interval and takeover budget, checked."""

    instance_id: str
    lease_ttl: float
    renew_interval: float
    max_takeovers: int
    max_held: int | None
    renewer: Renewer
    manage_gc: bool = True


def check_tenant(tenant_id: object) -> str:
    """The default tenant, checked (``ValueError`` naming it and the fix)."""
    return text_id(
        "tenant_id", tenant_id, what="the default tenant of graphs called the LangGraph way"
    )


def default_instance_id() -> str:
    return f"{socket.gethostname()}:{os.getpid()}:{uuid.uuid4().hex[:8]}"


def check_settings(
    instance_id: object,
    lease_ttl: object,
    renew_interval: object,
    max_takeovers: object,
    max_held: object,
    renewer: object = "auto",
    manage_gc: object = True,
) -> Settings:
    """The instance's id, TTL, renew interval and takeover budget, checked; else
    ``ValueError`` naming the argument and the fix."""
    ttl = positive_seconds("lease_ttl", lease_ttl, what="how long a hold lasts unrenewed")
    renew = positive_seconds(
        "renew_interval", ttl / 3 if renew_interval is None else renew_interval
    )
    if renew >= ttl - safety_margin(ttl):
        raise ValueError(
            f"renew_interval ({renew_interval}) must be below lease_ttl ({lease_ttl}) minus "
            f"its safety margin ({safety_margin(ttl):g} s), or the lease "
            "lapses between renewals: use lease_ttl / 3 (the default)"
        )
    if instance_id is None:
        instance_id = default_instance_id()
    else:
        text_id("instance_id", instance_id, what="this instance's holder id in the lease table")
    held = None
    if max_held is not None:
        held = positive_int(
            "max_held", max_held, what="how many executions this instance holds (renews) at once"
        )
    if renewer not in ("auto", "thread", "loop"):
        raise ValueError(
            f"renewer must be 'auto', 'thread' or 'loop', got {renewer!r}: 'auto' (the "
            "default) renews in a thread of its own wherever the store and the clock allow"
        )
    if not isinstance(manage_gc, bool):
        raise ValueError(
            f"manage_gc must be True or False, got {manage_gc!r}: True (the default) keeps "
            "the garbage collector's full passes shorter than the held leases can wait"
        )
    return Settings(
        str(instance_id), ttl, renew, check_budget(max_takeovers), held, renewer, manage_gc
    )


def check_open_options(init: Callable[..., None], options: dict[str, Any]) -> tuple[Settings, str]:
    """The settings and the default tenant ``Instance.open``'s ``options`` give (taken out
    of ``options``), checked: the options are those of ``init`` (``Instance.__init__``) but
    the stores, which ``open`` makes. ``ValueError`` for an unknown option or a bad value."""
    accepted = set(inspect.signature(init).parameters) - {
        "self",
        "repository",
        "saver",
        "records",
    }
    unknown = sorted(set(options) - accepted)
    if unknown:
        raise ValueError(
            f"Instance.open got unknown options {unknown}: it takes url, schema, "
            f"engine_options, serde and the Instance options {sorted(accepted)}"
        )
    settings = check_settings(
        options.pop("instance_id", None),
        options.pop("lease_ttl", 30.0),
        options.pop("renew_interval", None),
        options.pop("max_takeovers", DEFAULT_MAX_TAKEOVERS),
        options.pop("max_held", None),
        options.pop("renewer", "auto"),
        options.pop("manage_gc", True),
    )
    return settings, check_tenant(options.pop("tenant_id", DEFAULT_TENANT_ID))


def default_records(repository: ExecutionLeaseRepository) -> ExecutionRecords:
    """The records every instance on ``repository``'s store finds: in its database, or in
    memory for the memory store; refused for a store of another kind."""
    from langgraph_fence.lease.sql import SqlLeaseRepository

    try:
        store = base_store(repository)
    except ValueError:
        raise ValueError(
            f"records is required with a repository of type {type(repository).__name__}: "
            "pass records=SqlExecutionRecords(engine) on the lease table's database, so an "
            "instance that takes an execution over finds how to resume it"
        ) from None
    if isinstance(store, SqlLeaseRepository):
        return SqlExecutionRecords(store.engine)
    return MemoryExecutionRecords()

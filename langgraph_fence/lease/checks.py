"""Input checks every lease store makes before it touches its data."""

from __future__ import annotations

from typing import TYPE_CHECKING

from langgraph_fence.lease import Lease, LeaseKey

if TYPE_CHECKING:
    from langgraph_fence.lease import ExecutionLeaseRepository


def check_key(key: LeaseKey) -> None:
    """Refuse anything but a :class:`LeaseKey`."""
    if not isinstance(key, LeaseKey):
        raise ValueError(
            f"key must be a LeaseKey(tenant_id, execution_id), got {type(key).__name__}"
        )


def check_lease(store: ExecutionLeaseRepository, lease: Lease) -> None:
    """Refuse anything but a lease this store returned."""
    if not isinstance(lease, Lease):
        raise ValueError(f"lease must be a Lease returned by acquire(), got {type(lease).__name__}")
    if lease.store_id != store.store_id:
        raise ValueError(
            f"lease of {lease.scope_key!r} comes from another store ({lease.store_id!r}); "
            f"this store is {store.store_id!r}: use the lease this repository returned"
        )


def check_leases(store: ExecutionLeaseRepository, leases: object) -> list[Lease]:
    """Refuse anything but a sequence of leases this store returned, each key once."""
    if isinstance(leases, (str, bytes, Lease)) or not isinstance(leases, (list, tuple)):
        raise ValueError(
            f"leases must be a list of Lease returned by acquire(), got {type(leases).__name__}"
        )
    seen: set[LeaseKey] = set()
    for lease in leases:
        check_lease(store, lease)
        if lease.key in seen:
            raise ValueError(
                f"leases holds execution {lease.scope_key!r} twice: renew each lease once"
            )
        seen.add(lease.key)
    return list(leases)


def check_limit(limit: int) -> int:
    """Refuse anything but a positive int as a query's row limit."""
    if isinstance(limit, bool) or not isinstance(limit, int) or limit < 1:
        raise ValueError(f"limit must be a positive int, got {limit!r}")
    return limit

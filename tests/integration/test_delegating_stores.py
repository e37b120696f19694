"""What a valid lease store (and records store) is, the same on Python 3.11, 3.12 and 3.13.

A store is valid when every member of its contract is found with ``getattr``: a user's own
instrumenting or retrying wrapper that delegates through ``__getattr__`` is as good as the
store it wraps (``isinstance`` against the Protocol refuses it from 3.12 on), and a store
missing a method is refused before anything runs, with the missing method named.
"""

from __future__ import annotations

from typing import Any, TypedDict

import pytest
from langgraph.checkpoint.memory import InMemorySaver

from langgraph_fence import ExecutionLeaseRepository, LeaseKey, LeaseStatus
from langgraph_fence.contracts import missing_members
from langgraph_fence.instance import Instance
from langgraph_fence.lease.records import ExecutionRecords, MemoryExecutionRecords
from langgraph_fence.steps.context import get_execution_context
from tests.support.databases import unique
from tests.support.graphs import one_step


class State(TypedDict, total=False):
    token: int


class Delegating:
    """A user's wrapper: counts the calls and forwards every attribute to the store."""

    def __init__(self, inner: Any, hide: frozenset[str] = frozenset()) -> None:
        self.inner = inner
        self.hide = hide
        self.calls: list[str] = []

    def __getattr__(self, name: str) -> Any:
        if name in self.hide:
            raise AttributeError(name)
        found = getattr(self.inner, name)
        if not callable(found):
            return found

        def call(*args: Any, **kwargs: Any) -> Any:
            self.calls.append(name)
            return found(*args, **kwargs)

        return call


def _graph(instance: Instance) -> Any:
    async def step(state: State) -> State:
        frame = get_execution_context()
        await frame.fence.confirm_now()
        return {"token": frame.fence.token}

    return one_step(instance, State, "step", step, name="graph")


async def test_a_getattr_wrapper_around_a_store_runs_fenced(
    lease_store: ExecutionLeaseRepository,
) -> None:
    store = Delegating(lease_store)
    records = Delegating(MemoryExecutionRecords())
    instance = Instance(store, InMemorySaver(), lease_ttl=30.0, records=records)  # type: ignore[arg-type]
    key = LeaseKey(unique("t"), unique("thread"))
    try:
        result = await instance.ainvoke(
            _graph(instance),
            {},
            {"configurable": {"thread_id": key.execution_id}},
            tenant_id=key.tenant_id,
        )
    finally:
        await instance.aclose()
    assert result == {"token": 1}
    # The run went through the wrapper: taken, proven held, and given back.
    assert {"acquire", "renew", "release"} <= set(store.calls)
    assert {"bind", "record"} <= set(records.calls)
    lease = await lease_store.get(key)
    assert lease is not None
    assert lease.status is LeaseStatus.DONE


async def test_a_store_without_methods_is_refused_naming_them(
    lease_store: ExecutionLeaseRepository,
) -> None:
    store = Delegating(lease_store, hide=frozenset({"take_over", "now"}))
    with pytest.raises(ValueError, match="repository must implement ExecutionLeaseRepository") as e:
        Instance(store, InMemorySaver())  # type: ignore[arg-type]
    assert "Delegating without now, take_over" in str(e.value)
    assert not store.calls  # refused before anything was asked of the store


def test_records_without_a_method_are_refused_naming_it() -> None:
    from langgraph_fence.lease.memory import MemoryLeaseRepository

    records = Delegating(MemoryExecutionRecords(), hide=frozenset({"bind"}))
    with pytest.raises(ValueError, match=r"records must implement ExecutionRecords, .* bind"):
        Instance(MemoryLeaseRepository(), InMemorySaver(), records=records)  # type: ignore[arg-type]


def test_a_member_that_is_not_callable_is_missing() -> None:
    from langgraph_fence.lease.memory import MemoryLeaseRepository

    class Broken(MemoryLeaseRepository):
        acquire = None  # type: ignore[assignment]

    assert missing_members(Broken(), ExecutionLeaseRepository) == ["acquire"]
    assert missing_members(MemoryLeaseRepository(), ExecutionLeaseRepository) == []
    assert missing_members(MemoryExecutionRecords(), ExecutionRecords) == []
    with pytest.raises(ValueError, match="without acquire"):
        Instance(Broken(), InMemorySaver())

"""Lease-store contract helpers: a key, a stamp, checks that a lease is held or a refusal
changed nothing, and one fenced step run against a store."""

from __future__ import annotations

import asyncio
import inspect
from collections.abc import Callable
from typing import Any

import pytest
from langchain_core.runnables.config import var_child_runnable_config

from langgraph_fence import (
    Effect,
    ExecutionFencedError,
    ExecutionLeaseRepository,
    Lease,
    LeaseKey,
    PendingEffect,
    fenced,
)
from langgraph_fence.fence import RunHandle
from langgraph_fence.keys import FENCE_CONFIG_KEY
from tests.support.databases import unique

TTL = 10.0


Store = ExecutionLeaseRepository


def stamp(token: int, effect: Effect = Effect.NON_IDEMPOTENT_WRITE) -> PendingEffect:
    return PendingEffect(effect=effect, node="charge", task_id=unique("task"), token=token)


async def held(store: Store, holder: str = "A", ttl: float = TTL) -> Lease:
    lease = await store.acquire(new_key(), holder, ttl)
    assert lease is not None
    return lease


async def refused_unchanged(store: Store, key: LeaseKey, op: Callable[[], object]) -> None:
    """``op()`` raises ``ExecutionFencedError`` and leaves the row of ``key`` as it was."""
    before = await store.get(key)
    with pytest.raises(ExecutionFencedError) as caught:
        await op()  # type: ignore[misc]
    assert await store.get(key) == before
    error = caught.value
    assert error.scope_key is not None
    assert error.token_seen == (None if before is None else before.epoch)


async def run_step(node: Callable[..., Any], handle: RunHandle, thread: str) -> Any:
    """Run ``node`` as a fenced step of ``handle``'s run, as LangGraph
    would: async on the loop, sync in a worker thread with the context copied."""
    # READ_ONLY (fence_graph's default): no stamp renews the lease before the body, so
    # the store write itself meets the take-over.
    step = fenced(effect=Effect.READ_ONLY)(node)
    config = {
        "configurable": {
            "thread_id": thread,
            "checkpoint_ns": "",
            "__pregel_task_id": f"task-{unique()}",
            FENCE_CONFIG_KEY: handle,
            "tenant_id": handle.key.tenant_id,
            "execution_id": thread,
        }
    }
    reset = var_child_runnable_config.set(config)  # type: ignore[arg-type]
    try:
        # A task of its own, as LangGraph runs each step: a fenced run cancels its steps.
        if inspect.iscoroutinefunction(step):
            return await asyncio.create_task(step({}))
        return await asyncio.create_task(asyncio.to_thread(step, {}))
    finally:
        var_child_runnable_config.reset(reset)


def new_key() -> LeaseKey:
    return LeaseKey(unique("tenant"), unique("exec"))

"""Worker A of the store's langgraph#8796-style chaos test, run as its own process; and the
``--graphs`` factory worker B (``langgraph-fence worker``) serves.

    python -m tests.support.store_worker URL SCHEMA TENANT THREAD TTL RENEW SIGNAL_FILE RENEWALS

The graph ``memory``: ``recall`` -> ``remember``; ``remember`` writes the thread's summary to
the store under ``("memories", THREAD)`` with the token it runs under. In A, ``remember``
first creates SIGNAL_FILE and blocks its whole process reading a line from stdin (a GC pause
holding the event loop: no renewal runs); the test SIGSTOPs it there, lets B take over and
write its own summary, writes ``go`` and SIGCONTs it. A then writes its stale summary at
once. With RENEWALS ``held`` A renews as usual up to ``remember`` and never again from the
moment it blocks (:class:`HeldAtPause`: a timer overdue after the pause does not fire), so
the write itself, not a renewal, meets the take-over: the store's own guard must refuse it.
With ``running`` the timer, overdue after the pause, races the write. A prints one JSON line
saying how its run ended; exits 3 when its run was fenced, 0 when it finished, 1 on
anything else.
"""

from __future__ import annotations

import asyncio
import json
import os
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any, TypedDict

from langgraph.config import get_store
from langgraph.graph import END, START, StateGraph

from langgraph_fence import (
    ExecutionFencedError,
    ExecutionLeaseLostError,
    fence_graph,
    get_execution_context,
)
from langgraph_fence.database import schema_options
from langgraph_fence.instance import Instance
from tests.support.chaos_graphs import EXIT_FENCED, EXIT_FINISHED, write_json_atomically

MEMORY_GRAPH = "memory"


class State(TypedDict, total=False):
    log: list[str]


def memory_namespace(thread: str) -> tuple[str, ...]:
    return ("memories", thread)


def build_memory_graph(
    instance: Instance, *, before_write: Callable[[int], None] | None = None
) -> Any:
    """recall -> remember, compiled with the instance's checkpointer and store."""

    async def recall(state: State) -> State:
        return {"log": [*state.get("log", []), f"recall@{get_execution_context().fence.token}"]}

    async def remember(state: State) -> State:
        context = get_execution_context()
        token = context.fence.token
        if before_write is not None:
            before_write(token)
        await get_store().aput(
            memory_namespace(context.thread_id), "summary", {"by": token, "pid": os.getpid()}
        )
        return {"log": [*state.get("log", []), f"remember@{token}"]}

    builder = StateGraph(State)
    builder.add_node("recall", recall)
    builder.add_node("remember", remember)
    builder.add_edge(START, "recall")
    builder.add_edge("recall", "remember")
    builder.add_edge("remember", END)
    return fence_graph(builder).compile(
        checkpointer=instance.checkpointer, store=instance.store, name=MEMORY_GRAPH
    )


def memory_graphs(instance: Instance) -> dict[str, Any]:
    """``--graphs`` factory of worker B."""
    return {MEMORY_GRAPH: build_memory_graph(instance)}


class HeldAtPause:
    """The keeper's sleep in A with RENEWALS ``held``: a real sleep until :meth:`hold`, then
    one that never returns, also for a sleep begun before (it wakes overdue after the pause,
    and goes back to sleep for good instead of renewing).

    Held from the pause only, not from the start: a run whose renewals never run loses its
    lease (its node-entry check) TTL seconds after taking it, and on a busy machine getting
    from the take to ``remember`` can last that long: A then exited before the pause.
    """

    def __init__(self) -> None:
        self.held = False

    def hold(self) -> None:
        self.held = True

    async def __call__(self, seconds: float) -> None:
        if not self.held:
            await asyncio.sleep(seconds)
        if self.held:
            await asyncio.Event().wait()


async def main(
    url: str,
    schema: str,
    tenant: str,
    thread: str,
    ttl: float,
    renew: float,
    signal: Path,
    renewals: str,
) -> int:
    # An injected sleep also keeps the renewals on this loop (no renewer thread), so the
    # blocked loop is all that stops them.
    sleep = HeldAtPause()
    options: dict[str, Any] = {"sleep": sleep} if renewals == "held" else {}
    async with Instance.open(
        url,
        engine_options=schema_options(schema),
        instance_id=f"worker-A-{os.getpid()}",
        lease_ttl=ttl,
        renew_interval=renew,
        **options,
    ) as instance:

        def before_write(token: int) -> None:
            sleep.hold()  # from here on no renewal: the write meets the take-over alone
            write_json_atomically(signal, {"token": token, "pid": os.getpid()})
            # Blocks the event loop itself, as a GC pause would: no renewal runs meanwhile.
            line = sys.stdin.readline()
            assert line.strip() == "go", line

        graph = build_memory_graph(instance, before_write=before_write)
        try:
            await instance.ainvoke(
                graph,
                {"log": []},
                {"configurable": {"thread_id": thread}},
                tenant_id=tenant,
                durability="sync",
            )
        except BaseException as exc:
            report: dict[str, Any] = {"raised": type(exc).__name__, "at": time.monotonic()}
            if isinstance(exc, ExecutionLeaseLostError):
                report.update(token_held=exc.token_held, token_seen=exc.token_seen)
                report["message"] = str(exc)
            print(json.dumps(report), flush=True)
            return EXIT_FENCED if isinstance(exc, ExecutionFencedError) else 1
        print(json.dumps({"raised": None}), flush=True)
        return EXIT_FINISHED


if __name__ == "__main__":
    url, schema, tenant, thread, ttl, renew, signal, renewals = sys.argv[1:9]
    sys.exit(
        asyncio.run(
            main(url, schema, tenant, thread, float(ttl), float(renew), Path(signal), renewals)
        )
    )

"""Worker A of the langgraph#8796 chaos test, run as its own process.

    python fork_worker.py URL SCHEMA TENANT THREAD TTL SIGNAL_FILE

It takes the lease of ``(TENANT, THREAD)`` with a short TTL, runs the three-node graph with
``durability="sync"`` through ``FencedCheckpointer(SqlCheckpointer)``, and inside node ``n2``
creates SIGNAL_FILE, then waits for a line on stdin (a long model call; the test freezes the
process meanwhile with SIGSTOP). It prints one JSON line saying how the run ended and exits
0 when it finished, 3 when its writes were fenced, 1 on anything else.
"""

from __future__ import annotations

import asyncio
import json
import operator
import os
import sys
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Annotated, Any, TypedDict

from langgraph.graph import END, START, StateGraph

from checkpointers import SqlCheckpointer
from langgraph_fence import (
    ExecutionFencedError,
    FencedCheckpointer,
    LeaseKey,
    SqlLeaseRepository,
    find_fence_error,
)
from langgraph_fence.database import create_engine
from langgraph_fence.fence import RunHandle

EXIT_FENCED = 3


class State(TypedDict):
    log: Annotated[list[str], operator.add]


def build_graph(checkpointer: Any, inside_n2: Callable[[], Awaitable[None]] | None = None) -> Any:
    """n1 -> n2 -> n3, each appending its name (the worker's, to tell who ran it)."""

    def step(name: str) -> Callable[[State], Awaitable[dict[str, list[str]]]]:
        async def node(state: State) -> dict[str, list[str]]:
            if name == "n2" and inside_n2 is not None:
                await inside_n2()
            return {"log": [name]}

        return node

    builder = StateGraph(State)
    for name in ("n1", "n2", "n3"):
        builder.add_node(name, step(name))
    builder.add_edge(START, "n1")
    builder.add_edge("n1", "n2")
    builder.add_edge("n2", "n3")
    builder.add_edge("n3", END)
    return builder.compile(checkpointer=checkpointer)


def write_signal(path: Path, token: int) -> None:
    """Create ``path`` holding ``token``, atomically (the test polls for it)."""
    partial = path.with_suffix(".partial")
    partial.write_text(str(token))
    os.replace(partial, path)


def engine_for(url: str, schema: str) -> Any:
    return create_engine(url, connect_args={"server_settings": {"search_path": schema}})


async def main(url: str, schema: str, tenant: str, thread: str, ttl: float, signal: Path) -> int:
    engine = engine_for(url, schema)
    try:
        repo = SqlLeaseRepository(engine)
        saver = SqlCheckpointer(engine)
        await saver.setup()
        lease = await repo.acquire(LeaseKey(tenant, thread), "worker-A", ttl)
        if lease is None:
            print(json.dumps({"result": "not-acquired"}), flush=True)
            return 1
        handle = RunHandle(repo, lease, ttl)

        async def inside_n2() -> None:
            write_signal(signal, handle.token)
            line = await asyncio.get_running_loop().run_in_executor(None, sys.stdin.readline)
            assert line.strip() == "go", line

        graph = build_graph(FencedCheckpointer(saver), inside_n2)
        config = {"configurable": {"thread_id": thread, "tenant_id": tenant, "__fence": handle}}
        try:
            await graph.ainvoke({"log": []}, config, durability="sync")
        except BaseException as exc:
            fenced = find_fence_error(exc) or handle.error
            if isinstance(fenced, ExecutionFencedError):
                report = {
                    "result": "fenced",
                    "token_held": fenced.token_held,
                    "token_seen": fenced.token_seen,
                    "recorded": fenced is handle.error,
                }
                print(json.dumps(report), flush=True)
                return EXIT_FENCED
            print(json.dumps({"result": "error", "error": repr(exc)}), flush=True)
            return 1
        print(json.dumps({"result": "finished", "token": handle.token}), flush=True)
        return 0
    finally:
        await engine.dispose()


if __name__ == "__main__":
    url, schema, tenant, thread, ttl, signal = sys.argv[1:7]
    sys.exit(asyncio.run(main(url, schema, tenant, thread, float(ttl), Path(signal))))

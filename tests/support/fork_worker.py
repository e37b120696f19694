"""Worker A of the langgraph#8796 chaos test, run as its own process.

    python fork_worker.py URL SCHEMA TENANT THREAD TTL SIGNAL_FILE [plain]

It takes the lease of ``(TENANT, THREAD)`` with a short TTL, runs the three-node graph with
``durability="sync"`` through ``FencedCheckpointer(SqlCheckpointer)`` (with ``plain``: opens
an ``Instance`` with that TTL and calls ``graph.ainvoke`` on the graph compiled with its
checkpointer, the LangGraph way, which takes the lease), and inside node ``n2``
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
    Instance,
    LeaseKey,
    SqlLeaseRepository,
    fence_graph,
    find_fence_error,
)
from langgraph_fence.database import create_engine
from langgraph_fence.fence import RunHandle

EXIT_FENCED = 3


class State(TypedDict):
    log: Annotated[list[str], operator.add]


def build_graph(
    checkpointer: Any,
    inside_n2: Callable[[], Awaitable[None]] | None = None,
    *,
    fenced: bool = False,
) -> Any:
    """n1 -> n2 -> n3, each appending its name (the worker's, to tell who ran it); with
    ``fenced``, its nodes fenced and the graph named, as an instance runs it."""

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
    if fenced:
        return fence_graph(builder).compile(checkpointer=checkpointer, name="fork")
    return builder.compile(checkpointer=checkpointer)


def write_signal(path: Path, token: int) -> None:
    """Create ``path`` holding ``token``, atomically (the test polls for it)."""
    partial = path.with_suffix(".partial")
    partial.write_text(str(token))
    os.replace(partial, path)


def engine_for(url: str, schema: str) -> Any:
    return create_engine(url, connect_args={"server_settings": {"search_path": schema}})


def fenced_report(exc: BaseException, recorded: bool) -> dict[str, Any] | None:
    fenced = find_fence_error(exc)
    if not isinstance(fenced, ExecutionFencedError):
        return None
    return {
        "result": "fenced",
        "token_held": fenced.token_held,
        "token_seen": fenced.token_seen,
        "recorded": recorded,
    }


async def wait_for_go() -> None:
    line = await asyncio.get_running_loop().run_in_executor(None, sys.stdin.readline)
    assert line.strip() == "go", line


async def main_plain(
    url: str, schema: str, tenant: str, thread: str, ttl: float, signal: Path
) -> int:
    """Worker A the LangGraph way: the instance takes the lease; the node reads its token."""
    from langgraph_fence import get_execution_context

    options = {"connect_args": {"server_settings": {"search_path": schema}}}
    async with Instance.open(
        url, engine_options=options, instance_id="worker-A", lease_ttl=ttl
    ) as instance:

        async def inside_n2() -> None:
            write_signal(signal, get_execution_context().fence.token)
            await wait_for_go()

        graph = build_graph(instance.checkpointer, inside_n2, fenced=True)
        config = {"configurable": {"thread_id": thread, "tenant_id": tenant}}
        try:
            await graph.ainvoke({"log": []}, config, durability="sync")
        except BaseException as exc:
            # The instance raises the recorded fencing error itself, whatever surfaced.
            report = fenced_report(exc, recorded=isinstance(exc, ExecutionFencedError))
            print(json.dumps(report or {"result": "error", "error": repr(exc)}), flush=True)
            return 1 if report is None else EXIT_FENCED
        print(json.dumps({"result": "finished"}), flush=True)
        return 0


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
    run = main_plain if sys.argv[7:] == ["plain"] else main
    sys.exit(asyncio.run(run(url, schema, tenant, thread, float(ttl), Path(signal))))

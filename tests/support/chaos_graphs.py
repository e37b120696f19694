"""Graphs and worker scripts for the real-process chaos tests and the takeover benchmark.

Graph factories, for ``langgraph-fence worker --graphs tests.support.chaos_graphs:FUNCTION``
(each takes the :class:`~langgraph_fence.instance.Instance` and returns ``{name: graph}``):

* :func:`hold_graphs`: ``fence_hold`` = start -> work -> end. A worker started with the
  ``hold`` script below stops inside ``work`` (a long model call); any other worker runs
  through it, and writes when it entered ``work`` to ``$LGF_CHAOS_MARK_DIR/<thread>.json``
  (``time.monotonic()``, the same clock in every process of the machine).
* :func:`poison_graphs`: ``poison_pill`` = prepare -> pill -> END. ``pill`` appends its
  token and pid to ``$LGF_CHAOS_MARK_DIR/<thread>.pill`` and SIGKILLs its own process: a
  poison pill, which kills every worker that runs it, once prepare's checkpoint is stored
  (on a thread named ``healthy...`` it just returns).
* :func:`chaos_graphs`: ``chaos_plain`` and ``chaos_sink`` = prepare -> charge -> finish.
  ``charge`` appends one row per charge to the external table ``chaos_effects``: in
  ``chaos_plain`` with a plain INSERT (``NON_IDEMPOTENT_WRITE``: at most once), in
  ``chaos_sink`` through :func:`langgraph_fence.sinks.fenced_write` (``IDEMPOTENT_WRITE``:
  exactly once). Each node takes a little while, so signals land inside steps.
  ``chaos_nested`` = prepare -> parent -> finish, where ``parent`` runs a
  ``PARENT_INSTANCE`` child whose ``middle`` node runs another, charge -> after, whose
  ``charge`` is ``chaos_plain``'s (depth 3: the charge is two subgraph levels down). With
  ``LGF_CHAOS_SLOW_ROOT=1`` in its environment, a process that builds these graphs holds
  every root checkpoint back 0 to 0.3 s (a slow disk, a lock wait), so under
  ``durability="async"`` the children's writes often land before the root checkpoint of
  their superstep. With ``LGF_CHAOS_AIM_WHILE=PATH``, while PATH exists a worker SIGKILLs
  itself right after one in ten of the children's charge writes is stored: the kill aimed
  at that race.

The ``hold`` script (one run through ``Instance.ainvoke``, held inside ``work``)::

    python -m tests.support.chaos_graphs hold URL SCHEMA TENANT THREAD TTL RENEW SIGNAL_FILE

writes SIGNAL_FILE (JSON: token, pid) once inside ``work``, then waits until its run is
stopped. It prints one JSON line saying how ``ainvoke`` ended, with ``time.monotonic()`` at
that moment, and exits 3 on ``ExecutionFencedError``, 4 on any other lease loss, 0 when the
run finished, 1 on anything else.

The ``start`` script (a client that starts executions through ``Instance.ainvoke``)::

    python -m tests.support.chaos_graphs start URL SCHEMA TENANT TTL IDS_FILE CONCURRENCY

IDS_FILE holds one ``GRAPH EXECUTION_ID`` line per execution.

The ``serve`` script (``serve()`` with every connection tagged, so a test can kill them)::

    python -m tests.support.chaos_graphs serve URL SCHEMA APPLICATION_NAME TTL POLL
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import operator
import os
import random
import signal
import sys
import time
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Annotated, Any, TypedDict

from langgraph.graph import END, START, StateGraph
from sqlalchemy import text

from langgraph_fence import (
    Effect,
    ExecutionFencedError,
    ExecutionLeaseLostError,
    fence_graph,
)
from langgraph_fence.database import transaction
from langgraph_fence.instance import Instance
from langgraph_fence.lease.faults import arm_fault
from langgraph_fence.sinks import fenced_write
from langgraph_fence.steps.context import get_execution_context
from tests.support.polling import eventually
from tests.support.processes import MARK_DIR_ENV, Started, start_process
from tests.support.write_steps import line, spawning

EXIT_FINISHED = 0
EXIT_FENCED = 3
EXIT_LEASE_LOST = 4
HOLD_GRAPH = "fence_hold"
PLAIN_GRAPH = "chaos_plain"
SINK_GRAPH = "chaos_sink"
POISON_GRAPH = "poison_pill"
NESTED_GRAPH = "chaos_nested"
SLOW_ROOT_ENV = "LGF_CHAOS_SLOW_ROOT"
AIM_WHILE_ENV = "LGF_CHAOS_AIM_WHILE"

#: The external table the chaos graphs charge into; no unique key, so a repeat shows.
CREATE_EFFECTS = """
CREATE TABLE IF NOT EXISTS chaos_effects (
    id BIGSERIAL PRIMARY KEY,
    execution_id TEXT NOT NULL,
    variant TEXT NOT NULL,
    token BIGINT NOT NULL,
    worker TEXT NOT NULL
)
"""
_INSERT_EFFECT = text(
    "INSERT INTO chaos_effects (execution_id, variant, token, worker) "
    "VALUES (:execution_id, :variant, :token, :worker)"
)


class State(TypedDict, total=False):
    log: Annotated[list[str], operator.add]


def write_json_atomically(path: Path, payload: dict[str, Any]) -> None:
    """Create ``path`` holding ``payload`` in one rename (a poller never reads half of it)."""
    partial = path.with_name(path.name + ".partial")
    partial.write_text(json.dumps(payload))
    os.replace(partial, path)


def _token() -> int:
    return get_execution_context().fence.token


# -- fence_hold: one long node


def build_hold_graph(
    instance: Instance,
    *,
    inside_work: Callable[[int], Awaitable[None]] | None = None,
    mark_dir: Path | None = None,
) -> Any:
    """start -> work -> end; ``inside_work(token)`` holds the holder inside ``work``."""

    async def start(state: State) -> dict[str, list[str]]:
        return {"log": [f"start@{_token()}"]}

    async def work(state: State) -> dict[str, list[str]]:
        token = _token()
        if mark_dir is not None:
            thread = get_execution_context().thread_id
            write_json_atomically(
                mark_dir / f"{thread}.json",
                {"at": time.monotonic(), "token": token, "pid": os.getpid()},
            )
        if inside_work is not None:
            await inside_work(token)
        return {"log": [f"work@{token}"]}

    async def end(state: State) -> dict[str, list[str]]:
        return {"log": [f"end@{_token()}"]}

    builder = StateGraph(State)
    for name, node in (("start", start), ("work", work), ("end", end)):
        builder.add_node(name, node)
    builder.add_edge(START, "start")
    builder.add_edge("start", "work")
    builder.add_edge("work", "end")
    builder.add_edge("end", END)
    return fence_graph(builder).compile(checkpointer=instance.checkpointer, name=HOLD_GRAPH)


def hold_graphs(instance: Instance) -> dict[str, Any]:
    """``--graphs`` factory of the takeover workers: ``fence_hold``, marking ``work``."""
    mark_dir = os.environ.get(MARK_DIR_ENV)
    return {HOLD_GRAPH: build_hold_graph(instance, mark_dir=Path(mark_dir) if mark_dir else None)}


# -- chaos_plain / chaos_sink: a charge that must not happen twice


async def _pause(low: float, high: float) -> None:
    # Simulated work (a model call): it gives SIGSTOP and SIGKILL a step to land in.
    await asyncio.sleep(random.uniform(low, high))


def build_chaos_graph(instance: Instance, variant: str) -> Any:
    """prepare -> charge -> finish; ``charge`` appends one row to ``chaos_effects``."""
    engine = instance.repository.engine  # type: ignore[attr-defined]
    worker = instance.instance_id

    async def prepare(state: State) -> dict[str, list[str]]:
        await _pause(0.05, 0.4)
        return {"log": [f"prepare@{_token()}"]}

    async def charge_plain(state: State) -> dict[str, list[str]]:
        fence = get_execution_context().fence
        await _pause(0.02, 0.15)
        async with engine.connect() as conn:  # autocommit: the row lands at once
            await conn.execute(
                _INSERT_EFFECT,
                {
                    "execution_id": fence.lease_execution_id,
                    "variant": variant,
                    "token": fence.token,
                    "worker": worker,
                },
            )
        await _pause(0.02, 0.15)
        return {"log": [f"charge@{fence.token}"]}

    async def charge_sink(state: State) -> dict[str, list[str]]:
        fence = get_execution_context().fence
        await _pause(0.02, 0.15)
        async with transaction(engine) as conn:
            async with fenced_write(conn, fence, "charge") as write:
                if not write.applied:
                    await conn.execute(
                        _INSERT_EFFECT,
                        {
                            "execution_id": fence.lease_execution_id,
                            "variant": variant,
                            "token": fence.token,
                            "worker": worker,
                        },
                    )
                    write.record(fence.token)
            # Inside the transaction: a stall here holds the sink's row lock, as a slow
            # commit would.
            await _pause(0.0, 0.05)
        await _pause(0.02, 0.15)
        return {"log": [f"charge@{fence.token}"]}

    async def finish(state: State) -> dict[str, list[str]]:
        await _pause(0.02, 0.1)
        return {"log": [f"finish@{_token()}"]}

    if variant == NESTED_GRAPH:
        charging = line(("charge", charge_plain), ("after", finish))
        charging_graph = fence_graph(
            charging, effects={"charge": Effect.NON_IDEMPOTENT_WRITE}
        ).compile(name="charging")
        middle = fence_graph(line(("middle", spawning("charging", charging_graph))))
        parent = spawning("middle", middle.compile(name="middle"))
        return fence_graph(
            line(("prepare", prepare), ("parent", parent), ("finish", finish))
        ).compile(checkpointer=instance.checkpointer, name=variant)
    if variant == PLAIN_GRAPH:
        charge, effect = charge_plain, Effect.NON_IDEMPOTENT_WRITE
    elif variant == SINK_GRAPH:
        charge, effect = charge_sink, Effect.IDEMPOTENT_WRITE
    else:
        raise ValueError(f"unknown chaos graph {variant!r}")
    builder = line(("prepare", prepare), ("charge", charge), ("finish", finish))
    return fence_graph(builder, effects={"charge": effect}).compile(
        checkpointer=instance.checkpointer, name=variant
    )


#: The fault points this process armed for good (kept: a context manager collected would
#: disarm its point as its generator closes).
_slow_root: list[Any] = []


def _hold_root_checkpoints_back() -> None:
    """Each root checkpoint of this process waits 0 to 0.3 s before it is written (once per
    process; the fault point stays armed until it exits)."""
    if _slow_root:
        return

    async def slow(context: Any) -> None:
        if not context["config"]["configurable"].get("checkpoint_ns"):
            await asyncio.sleep(random.uniform(0.0, 0.3))

    _slow_root.append(arm_fault("checkpoint.before", slow))
    aim_while = os.environ.get(AIM_WHILE_ENV)
    if aim_while:

        def kill_after_a_childs_charge(context: Any) -> None:
            if (
                context["config"]["configurable"].get("checkpoint_ns")
                and any(
                    channel == "log" and any(str(v).startswith("charge@") for v in value)
                    for channel, value in context["writes"]
                )
                and os.path.exists(aim_while)
                and random.random() < 0.1
            ):
                os.kill(os.getpid(), signal.SIGKILL)

        _slow_root.append(arm_fault("writes.after", kill_after_a_childs_charge))
    for armed in _slow_root:
        armed.__enter__()


def chaos_graphs(instance: Instance) -> dict[str, Any]:
    """``--graphs`` factory of the chaos workers: ``chaos_plain``, ``chaos_sink`` and
    ``chaos_nested`` (root checkpoints held back where ``LGF_CHAOS_SLOW_ROOT=1``)."""
    if os.environ.get(SLOW_ROOT_ENV) == "1":
        _hold_root_checkpoints_back()
    return {
        name: build_chaos_graph(instance, name) for name in (PLAIN_GRAPH, SINK_GRAPH, NESTED_GRAPH)
    }


# -- poison_pill: a step that kills whoever runs it


def pill_runs(mark_dir: Path, thread: str) -> list[tuple[int, int]]:
    """``(token, pid)`` of every run of ``pill`` on ``thread``, in order."""
    path = mark_dir / f"{thread}.pill"
    if not path.exists():
        return []
    return [
        (int(token), int(pid))
        for token, pid in (line.split() for line in path.read_text().splitlines() if line)
    ]


def build_poison_graph(instance: Instance) -> Any:
    async def prepare(state: State) -> dict[str, list[str]]:
        return {"log": [f"prepare@{_token()}"]}

    async def pill(state: State) -> dict[str, list[str]]:
        frame = get_execution_context()
        if frame.thread_id.startswith("healthy"):
            return {"log": ["no pill"]}  # what the workers run once the poison is gone
        # Die only once prepare's checkpoint is stored (durability="async" saves it beside
        # this step): the first run then makes its progress, every later one none, whatever
        # the timing, so the test can count the takeovers the budget allows. Should it not
        # show within 30 s, the step dies all the same (the test then sees no progress).
        config = {
            "configurable": {"thread_id": frame.thread_id, "tenant_id": frame.fence.tenant_id}
        }

        async def prepare_stored() -> bool:
            stored = await instance.checkpointer.aget_tuple(config)
            return stored is not None and "prepare" in str(stored.checkpoint["channel_values"])

        with contextlib.suppress(AssertionError):
            await eventually(prepare_stored, timeout=30.0, interval=0.01, what="prepare stored")
        path = Path(os.environ[MARK_DIR_ENV]) / f"{frame.thread_id}.pill"
        # O_APPEND: the line is on disk before the kill; one line per run of the step.
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
        try:
            os.write(fd, f"{frame.fence.token} {os.getpid()}\n".encode())
        finally:
            os.close(fd)
        os.kill(os.getpid(), signal.SIGKILL)
        raise AssertionError("unreachable: the process is dead")

    builder = StateGraph(State)
    builder.add_node("prepare", prepare)
    builder.add_node("pill", pill)
    builder.add_edge(START, "prepare")
    builder.add_edge("prepare", "pill")
    builder.add_edge("pill", END)
    return fence_graph(builder).compile(checkpointer=instance.checkpointer, name=POISON_GRAPH)


def poison_graphs(instance: Instance) -> dict[str, Any]:
    """``--graphs`` factory of the poison-pill workers: ``poison_pill``."""
    return {POISON_GRAPH: build_poison_graph(instance)}


# -- the hold script


async def hold(
    url: str,
    schema: str,
    tenant: str,
    thread: str,
    ttl: float,
    renew: float,
    signal_file: Path,
) -> int:
    """Run ``fence_hold`` once through ``Instance.ainvoke``, held inside ``work``."""
    options = {"connect_args": {"server_settings": {"search_path": schema}}}
    async with Instance.open(
        url,
        engine_options=options,
        instance_id=f"holder-{os.getpid()}",
        lease_ttl=ttl,
        renew_interval=renew,
    ) as instance:

        async def inside_work(token: int) -> None:
            write_json_atomically(signal_file, {"token": token, "pid": os.getpid()})
            await asyncio.Event().wait()  # until the run is stopped (cancelled)

        graph = build_hold_graph(instance, inside_work=inside_work)
        report: dict[str, Any]
        try:
            result = await instance.ainvoke(
                graph,
                {"log": []},
                {"configurable": {"thread_id": thread}},
                tenant_id=tenant,
                durability="sync",
            )
        except BaseException as exc:
            at = time.monotonic()
            report = {"result": "error", "raised": type(exc).__name__, "at": at}
            code = 1
            if isinstance(exc, ExecutionLeaseLostError):
                report.update(token_held=exc.token_held, token_seen=exc.token_seen)
                fenced = isinstance(exc, ExecutionFencedError)
                report["result"] = "fenced" if fenced else "lease-lost"
                code = EXIT_FENCED if fenced else EXIT_LEASE_LOST
            else:
                report["error"] = repr(exc)
            print(json.dumps(report), flush=True)
            return code
        print(json.dumps({"result": "finished", "state": result}), flush=True)
        return EXIT_FINISHED


async def spawn_hold(
    url: str,
    schema: str,
    tenant: str,
    thread: str,
    ttl: float,
    renew: float,
    signal_file: Path,
    directory: Path,
    name: str = "a",
) -> Started:
    """Start the ``hold`` script in a process of its own, its output in ``directory``."""
    args = ["-m", "tests.support.chaos_graphs", "hold", url, schema, tenant, thread]
    return await start_process([*args, str(ttl), str(renew), str(signal_file)], directory, name)


# -- the start script


async def start(
    url: str, schema: str, tenant: str, ttl: float, jobs: list[list[str]], concurrency: int
) -> int:
    """Start every execution of ``jobs`` (``[graph, execution_id]``) with ``ainvoke``.

    The runs go ``concurrency`` at a time; a run that fails (fenced after a freeze,
    dead-lettered, ...) is counted by its error class, and the next one starts. The last
    line printed is the count of each outcome, as JSON.
    """
    options = {"connect_args": {"server_settings": {"search_path": schema}}}
    outcomes: dict[str, int] = {}
    async with Instance.open(
        url, engine_options=options, instance_id=f"starter-{os.getpid()}", lease_ttl=ttl
    ) as instance:
        graphs = chaos_graphs(instance)
        gate = asyncio.Semaphore(concurrency)
        print("starter ready", flush=True)

        async def run(graph: str, execution_id: str) -> None:
            async with gate:
                try:
                    await instance.ainvoke(
                        graphs[graph],
                        {"log": []},
                        {"configurable": {"thread_id": execution_id}},
                        tenant_id=tenant,
                    )
                    outcome = "done"
                except Exception as exc:
                    outcome = type(exc).__name__
                outcomes[outcome] = outcomes.get(outcome, 0) + 1

        await asyncio.gather(*(run(graph, execution_id) for graph, execution_id in jobs))
    print(json.dumps(outcomes), flush=True)
    return 0


# -- the serve script: a worker whose connections a test can find and kill


async def serve(url: str, schema: str, application_name: str, ttl: float, poll: float) -> int:
    """``serve()`` the chaos graphs with every connection tagged ``application_name``."""
    settings = {"search_path": schema, "application_name": application_name}
    async with Instance.open(
        url,
        engine_options={"connect_args": {"server_settings": settings}},
        instance_id=f"{application_name}-{os.getpid()}",
        lease_ttl=ttl,
    ) as instance:
        print("serving", flush=True)
        await instance.serve(chaos_graphs(instance), poll_interval=poll, concurrency=4)
    return 0


def main(argv: list[str]) -> int:
    if len(argv) == 8 and argv[0] == "hold":
        _, url, schema, tenant, thread, ttl, renew, signal_file = argv
        return asyncio.run(
            hold(url, schema, tenant, thread, float(ttl), float(renew), Path(signal_file))
        )
    if len(argv) == 7 and argv[0] == "start":
        _, url, schema, tenant, ttl, ids_file, concurrency = argv
        lines = Path(ids_file).read_text().splitlines()
        jobs = [line.split() for line in lines if line.strip()]
        return asyncio.run(start(url, schema, tenant, float(ttl), jobs, int(concurrency)))
    if len(argv) == 6 and argv[0] == "serve":
        _, url, schema, application_name, ttl, poll = argv
        return asyncio.run(serve(url, schema, application_name, float(ttl), float(poll)))
    print(__doc__, file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))

"""Graphs with non-idempotent write steps, and a worker script that is killed mid-run.

Every write appends one line (``node token pid``) to ``EFFECTS_DIR/<execution id>``, a file
of its own per execution: a line written before a SIGKILL is on disk, so a repeated write
shows as a second line. The graphs (``build_graph(instance, variant, doomed=...)``):

* ``pair-slow-first`` / ``pair-slow-second``: START -> (a, b) -> END, both
  ``NON_IDEMPOTENT_WRITE``, in one superstep; the slow one is ``a`` or ``b``.
* ``fanout``: START -> Send x4 -> ``charge`` (``NON_IDEMPOTENT_WRITE``); tasks 0 and 1 are
  fast, 2 and 3 slow.
* ``linear``: START -> hold -> charge -> receipt -> END, only ``charge`` a write.
* ``nested-spawn`` / ``nested-node``: START -> hold -> parent -> receipt -> END, where
  ``parent`` runs a child graph, START -> charge -> child_done -> END, as a subgraph under the
  root's lease: a ``PARENT_INSTANCE`` child (``spawn_child`` + ``wait_children``), or the
  compiled child graph added as the node itself. Only the child's ``charge`` is a write.
* ``nested-deep``: the same with a grandchild: ``parent`` spawns a ``PARENT_INSTANCE``
  child whose ``middle`` node spawns the charging graph (depth 3).
* ``agent-<kind>-<first>``: the agents users build (``create_react_agent`` v1 and v2, a
  custom ``ToolNode`` graph, LangChain's ``create_agent``), fenced, whose scripted model
  answers with two undeclared (so non-idempotent) tool calls, ``send_email`` (slow) and
  ``charge_card`` (fast), ``<first>`` first.
* ``sync-pair-slow-first`` / ``sync-pair-slow-second`` / ``sync-fanout``: the same graphs
  with sync node functions (LangGraph runs them in worker threads; their stamps hop to the
  run's loop).
* ``agent-<kind>-sync-<first>``: the same agents with sync tools (``toolnode``,
  ``react-v2``), and ``agent-sync-node-<first>``: a sync node that calls the sync tools
  itself with ``tool.invoke()`` from its worker thread.

In a *doomed* process a slow task writes, then waits until the fast tasks' writes are
stored (they are in the latest checkpoint's pending writes), writes
``READY_DIR/<execution id>.<node>`` and waits to be killed: the moment at which one stamp
per lease lost the slow write (the fast writes had cleared the only stamp). Anywhere else
(the taker) every task just writes and returns.

The script::

    python -m tests.support.write_steps URL SCHEMA TENANT VARIANT DURABILITY TTL DIR FAULT IDS...

runs one execution per id (thread = execution id) through ``Instance.ainvoke``, doomed.
FAULT is ``-`` or a fault point (``langgraph_fence.lease.faults.FAULT_POINTS``): the process then
SIGKILLs itself the first time it reaches that point after the ``charge`` step began
(``linear`` only).
"""

from __future__ import annotations

import asyncio
import operator
import os
import signal
import sys
import time
from collections.abc import Callable, Mapping, Sequence
from contextlib import AbstractAsyncContextManager
from dataclasses import dataclass
from pathlib import Path
from typing import Annotated, Any, TypedDict

from langgraph.graph import END, START, StateGraph
from langgraph.graph.message import add_messages
from langgraph.types import Send

from langgraph_fence import (
    ChildPlacement,
    Effect,
    Instance,
    LeaseKey,
    LeaseStatus,
    fence_graph,
    fence_tools,
    get_execution_context,
)
from langgraph_fence.lease import Lease
from langgraph_fence.lease.faults import arm_fault
from tests.support.polling import eventually, eventually_sync

AGENTS = ("react-v1", "react-v2", "toolnode", "create-agent")
#: The agents with sync tools: two of the above, and a sync node calling the tools itself.
SYNC_TOOL_AGENTS = ("toolnode-sync", "react-v2-sync", "sync-node")
#: The agents that run each tool call of one model answer as a task of its own.
PER_CALL_TASKS = ("react-v2", "create-agent")
AGENT_VARIANTS = tuple(
    f"agent-{kind}-{first}" for kind in AGENTS + SYNC_TOOL_AGENTS for first in ("email", "charge")
)
SYNC_VARIANTS = ("sync-pair-slow-first", "sync-pair-slow-second", "sync-fanout")
NESTED_VARIANTS = ("nested-spawn", "nested-node", "nested-deep")
VARIANTS = ("pair-slow-first", "pair-slow-second", "fanout", "linear", *SYNC_VARIANTS)
VARIANTS += NESTED_VARIANTS
VARIANTS += AGENT_VARIANTS
SLOW_WAIT = 60.0  # a doomed slow task waits this long at most for its kill


class State(TypedDict, total=False):
    log: Annotated[list[str], operator.add]
    i: int


class Messages(TypedDict):
    messages: Annotated[list[Any], add_messages]


def graph_name(variant: str) -> str:
    return f"write_steps_{variant.replace('-', '_')}"


def effects_of(directory: Path, execution_id: str) -> list[str]:
    """The nodes that performed their write for ``execution_id``, one entry per write."""
    path = directory / "effects" / execution_id
    if not path.exists():
        return []
    return [line.split()[0] for line in path.read_text().splitlines() if line.strip()]


def _record_effect(directory: Path, node: str) -> None:
    frame = get_execution_context()
    path = directory / "effects" / frame.thread_id
    # O_APPEND: one write per line, each whole; it survives the process's SIGKILL.
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    try:
        os.write(fd, f"{node} {frame.fence.token} {os.getpid()}\n".encode())
    finally:
        os.close(fd)


def _thread_config() -> tuple[str, Any]:
    """This task's id, and the config reading its thread's latest checkpoint.

    The tenant is named: a read with a bare thread id is the default tenant's thread (since
    threads are keyed by tenant), where this run's checkpoints are not.
    """
    frame = get_execution_context()
    configurable = {"thread_id": frame.thread_id, "checkpoint_ns": "", "tenant_id": frame.tenant_id}
    return frame.task_id, {"configurable": configurable}


def _others_wrote(found: Any, me: str, count: int) -> bool:
    writers = {w[0] for w in (found.pending_writes or [])} if found else set()
    return len(writers - {me}) >= count


def _wait_for_fast_writes_sync(instance: Instance, count: int) -> None:
    """:func:`_wait_for_fast_writes` from a worker thread (a sync step)."""
    me, config = _thread_config()
    eventually_sync(
        lambda: _others_wrote(instance.checkpointer.get_tuple(config), me, count),
        timeout=SLOW_WAIT,
        what="the fast tasks' writes",
    )


async def _wait_for_fast_writes(instance: Instance, count: int) -> None:
    """Until ``count`` tasks other than this one have their writes stored."""
    me, config = _thread_config()

    async def others_wrote() -> bool:
        return _others_wrote(await instance.checkpointer.aget_tuple(config), me, count)

    await eventually(others_wrote, timeout=SLOW_WAIT, what="the fast tasks' writes")


def build_graph(
    instance: Instance,
    variant: str,
    directory: Path,
    *,
    doomed: bool,
    on_effect: Callable[[str], None] | None = None,
) -> Any:
    """The compiled graph of ``variant`` (see the module docstring); ``on_effect(node)`` is
    called right after each write."""
    if variant not in VARIANTS:
        raise ValueError(f"variant must be one of {', '.join(VARIANTS)}, got {variant!r}")
    if variant.startswith("agent-"):
        return _build_agent(instance, variant, directory, doomed=doomed)

    def effect(node: str) -> None:
        _record_effect(directory, node)
        if on_effect is not None:
            on_effect(node)

    async def write(node: str, *, slow: bool, fast_writers: int) -> dict[str, Any]:
        effect(node)
        if doomed and slow:
            thread = get_execution_context().thread_id
            await _wait_for_fast_writes(instance, fast_writers)
            (directory / "ready" / f"{thread}.{node}").write_text("ready")
            await asyncio.sleep(SLOW_WAIT)  # the kill lands here, mid-step
        return {"log": [node]}

    def write_sync(node: str, *, slow: bool, fast_writers: int) -> dict[str, Any]:
        # A sync step, in LangGraph's worker thread: it blocks where the async one awaits.
        effect(node)
        if doomed and slow:
            thread = get_execution_context().thread_id
            _wait_for_fast_writes_sync(instance, fast_writers)
            (directory / "ready" / f"{thread}.{node}").write_text("ready")
            time.sleep(SLOW_WAIT)  # the kill lands here, mid-step
        return {"log": [node]}

    if variant in NESTED_VARIANTS:
        return _build_nested(instance, variant, effect)
    builder = StateGraph(State)
    effects: dict[str, Effect] = {}
    sync = variant.startswith("sync-")
    shape = variant.removeprefix("sync-")
    if shape.startswith("pair-"):
        slow = "a" if shape == "pair-slow-first" else "b"
        for node in ("a", "b"):

            async def body(state: State, _node: str = node) -> dict[str, Any]:
                return await write(_node, slow=_node == slow, fast_writers=1)

            def sync_body(state: State, _node: str = node) -> dict[str, Any]:
                return write_sync(_node, slow=_node == slow, fast_writers=1)

            builder.add_node(node, sync_body if sync else body)
            builder.add_edge(START, node)
            builder.add_edge(node, END)
            effects[node] = Effect.NON_IDEMPOTENT_WRITE
    elif shape == "fanout":

        async def async_charge(state: State) -> dict[str, Any]:
            i = state["i"]
            return await write(f"charge-{i}", slow=i >= 2, fast_writers=2)

        def sync_charge(state: State) -> dict[str, Any]:
            i = state["i"]
            return write_sync(f"charge-{i}", slow=i >= 2, fast_writers=2)

        charge = sync_charge if sync else async_charge

        def fan_out(state: State) -> list[Send]:
            return [Send("charge", {"i": i}) for i in range(4)]

        builder.add_node("charge", charge)
        builder.add_conditional_edges(START, fan_out, ["charge"])
        builder.add_edge("charge", END)
        effects["charge"] = Effect.NON_IDEMPOTENT_WRITE
    else:

        async def hold(state: State) -> dict[str, Any]:
            return {"log": ["hold"]}

        async def charge_once(state: State) -> dict[str, Any]:
            effect("charge")
            return {"log": ["charge"]}

        async def receipt(state: State) -> dict[str, Any]:
            return {"log": ["receipt"]}

        for name, node in (("hold", hold), ("charge", charge_once), ("receipt", receipt)):
            builder.add_node(name, node)
        builder.add_edge(START, "hold")
        builder.add_edge("hold", "charge")
        builder.add_edge("charge", "receipt")
        builder.add_edge("receipt", END)
        effects["charge"] = Effect.NON_IDEMPOTENT_WRITE
    return fence_graph(builder, effects=effects).compile(
        checkpointer=instance.checkpointer, name=graph_name(variant)
    )


def line(*nodes: tuple[str, Any]) -> StateGraph[Any]:
    """START -> each node in turn -> END (on a state with a ``log``)."""
    builder: StateGraph[Any] = StateGraph(State)
    previous = START
    for name, node in nodes:
        builder.add_node(name, node)
        builder.add_edge(previous, name)
        previous = name
    builder.add_edge(previous, END)
    return builder


def spawning(name: str, graph: Any) -> Any:
    """A node that runs ``graph`` as a ``PARENT_INSTANCE`` child and waits for it."""

    async def spawn_and_wait(state: State) -> dict[str, Any]:
        frame = get_execution_context()
        child = await frame.spawn_child(
            name, {"log": []}, placement=ChildPlacement.PARENT_INSTANCE, key=name, graph=graph
        )
        await frame.wait_children([child])
        return {"log": [f"{name}@{frame.fence.token}"]}

    return spawn_and_wait


def _build_nested(instance: Instance, variant: str, effect: Callable[[str], None]) -> Any:
    async def step(state: State) -> dict[str, Any]:
        return {"log": ["step"]}

    async def charge(state: State) -> dict[str, Any]:
        effect("charge")
        return {"log": ["charge"]}

    charging = fence_graph(
        line(("charge", charge), ("child_done", step)),
        effects={"charge": Effect.NON_IDEMPOTENT_WRITE},
    ).compile(name="charging")
    if variant == "nested-node":
        parent: Any = charging
    elif variant == "nested-spawn":
        parent = spawning("child", charging)
    else:
        middle = fence_graph(line(("middle", spawning("grandchild", charging)))).compile(
            name="middle"
        )
        parent = spawning("child", middle)
    return fence_graph(line(("hold", step), ("parent", parent), ("receipt", step))).compile(
        checkpointer=instance.checkpointer, name=graph_name(variant)
    )


def _build_agent(instance: Instance, variant: str, directory: Path, *, doomed: bool) -> Any:
    from langchain_core.messages import AIMessage
    from langchain_core.tools import tool

    from tests.support.agents import ScriptedModel

    kind, first = variant.removeprefix("agent-").rsplit("-", 1)
    sync_tools = kind in SYNC_TOOL_AGENTS
    kind = kind.removesuffix("-sync")

    @tool("send_email")
    def send_email_sync(to: str) -> str:
        """Send an e-mail."""
        _record_effect(directory, "send_email")
        if doomed:
            frame = get_execution_context()
            if kind != "sync-node" or first == "charge":  # else charge_card comes after
                _wait_for_effect_sync(directory, frame.thread_id, "charge_card")
            if kind in PER_CALL_TASKS:
                _wait_for_fast_writes_sync(instance, 1)
            (directory / "ready" / f"{frame.thread_id}.send_email").write_text("ready")
            time.sleep(SLOW_WAIT)  # the kill lands here, mid-send
        return "sent"

    @tool("charge_card")
    def charge_card_sync(order: str) -> str:
        """Charge a card."""
        _record_effect(directory, "charge_card")
        return "charged"

    @tool
    async def send_email(to: str) -> str:
        """Send an e-mail."""
        _record_effect(directory, "send_email")
        if doomed:
            frame = get_execution_context()
            await _wait_for_effect(directory, frame.thread_id, "charge_card")
            if kind in PER_CALL_TASKS:
                # charge_card's task is done: its writes (which cleared the only stamp on
                # the first version) are stored before the kill.
                await _wait_for_fast_writes(instance, 1)
            (directory / "ready" / f"{frame.thread_id}.send_email").write_text("ready")
            await asyncio.sleep(SLOW_WAIT)  # the kill lands here, mid-send
        return "sent"

    @tool
    async def charge_card(order: str) -> str:
        """Charge a card."""
        _record_effect(directory, "charge_card")
        return "charged"

    calls = [
        {"name": "send_email", "args": {"to": "a@example.com"}, "id": "call-email"},
        {"name": "charge_card", "args": {"order": "o1"}, "id": "call-charge"},
    ]
    if first == "charge":
        calls.reverse()
    model = ScriptedModel(turns=[AIMessage("", tool_calls=calls), AIMessage("all done")])
    # Undeclared: NON_IDEMPOTENT_WRITE.
    tools = fence_tools(
        [send_email_sync, charge_card_sync] if sync_tools else [send_email, charge_card]
    )
    builder: Any
    if kind == "sync-node":
        by_name = {t.name: t for t in tools}

        def agent_sync(state: Messages) -> dict[str, Any]:
            return {"messages": [model.invoke(state["messages"])]}

        def call_tools(state: Messages) -> dict[str, Any]:
            # A sync node calling its tools itself: each call stamps from this worker thread.
            answer = state["messages"][-1]
            return {
                "messages": [
                    by_name[call["name"]].invoke({**call, "type": "tool_call"})
                    for call in answer.tool_calls
                ]
            }

        builder = StateGraph(Messages)
        builder.add_node("agent", agent_sync)
        builder.add_node("tools", call_tools)
        builder.add_edge(START, "agent")
        builder.add_edge("agent", "tools")
        builder.add_edge("tools", END)
    elif kind in ("react-v1", "react-v2"):
        import warnings

        from langgraph.prebuilt import create_react_agent

        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # deprecated in LangGraph 1.x, still the default
            builder = create_react_agent(model, tools, version=kind[-2:]).builder
    elif kind == "create-agent":
        from langchain.agents import create_agent

        builder = create_agent(model, tools).builder
    else:
        from langgraph.prebuilt import ToolNode

        async def agent(state: Messages) -> dict[str, Any]:
            return {"messages": [await model.ainvoke(state["messages"])]}

        builder = StateGraph(Messages)
        builder.add_node("agent", agent)
        builder.add_node("tools", ToolNode(tools))
        builder.add_edge(START, "agent")
        builder.add_edge("agent", "tools")
        builder.add_edge("tools", END)
    return fence_graph(builder).compile(
        checkpointer=instance.checkpointer, name=graph_name(variant)
    )


def _wait_for_effect_sync(directory: Path, execution_id: str, node: str) -> None:
    eventually_sync(
        lambda: node in effects_of(directory, execution_id),
        timeout=SLOW_WAIT,
        what=f"{node} to write",
    )


async def _wait_for_effect(directory: Path, execution_id: str, node: str) -> None:
    await eventually(
        lambda: node in effects_of(directory, execution_id),
        timeout=SLOW_WAIT,
        what=f"{node} to write",
    )


def first_input(variant: str) -> dict[str, Any]:
    """What a doomed process starts ``variant`` with."""
    if variant.startswith("agent-"):
        return {"messages": [("user", "e-mail the receipt and charge the card")]}
    return {"log": []}


def engine_options(url: str, schema: str) -> dict[str, Any]:
    if url.startswith("sqlite"):
        return {}
    return {"connect_args": {"server_settings": {"search_path": schema}}}


# -- for the tests: start doomed processes, take their executions over

ROOT = Path(__file__).resolve().parents[2]
DOOMED_TTL = 3.0  # long enough for ten processes starting at once on two cores
TENANT = "acme"
ENDED = frozenset({LeaseStatus.DONE, LeaseStatus.DEAD_LETTERED, LeaseStatus.FAILED})


@dataclass(frozen=True)
class Database:
    """Where the processes of one test meet: a SQLite file, or a PostgreSQL schema."""

    url: str
    schema: str


async def spawn(
    database: Database, variant: str, durability: str, directory: Path, fault: str, ids: list[str]
) -> asyncio.subprocess.Process:
    # A file of its own per process, kept for a failure's post-mortem.
    log = os.open(directory / f"doomed-{ids[0]}.log", os.O_WRONLY | os.O_CREAT, 0o644)
    try:
        return await asyncio.create_subprocess_exec(
            sys.executable,
            "-m",
            "tests.support.write_steps",
            database.url,
            database.schema or "-",
            TENANT,
            variant,
            durability,
            str(DOOMED_TTL),
            str(directory),
            fault,
            *ids,
            cwd=ROOT,
            stdout=log,
            stderr=log,
        )
    finally:
        os.close(log)


async def take_over_all(
    database: Database, variant: str, directory: Path, ids: list[str], *, deadline: float
) -> dict[str, Lease]:
    """Serve ``variant`` from this process until every execution of ``ids`` has ended."""

    async with Instance.open(
        database.url,
        engine_options=engine_options(database.url, database.schema),
        instance_id="taker",
        lease_ttl=DOOMED_TTL,
    ) as taker:
        graph = build_graph(taker, variant, directory, doomed=False)
        stop = asyncio.Event()
        serving = asyncio.create_task(
            taker.serve(
                {graph_name(variant): graph}, poll_interval=0.05, stop=stop, handle_signals=False
            )
        )

        async def all_ended() -> dict[str, Lease] | None:
            leases = {i: await taker.repository.get(LeaseKey(TENANT, i)) for i in ids}
            if all(lease is not None and lease.status in ENDED for lease in leases.values()):
                return {i: lease for i, lease in leases.items() if lease is not None}
            return None

        try:
            return await eventually(all_ended, timeout=deadline, what="every takeover to end")
        finally:
            stop.set()
            await asyncio.wait_for(serving, 30)


def at_charge(point: str, context: Mapping[str, Any], charge_began: Sequence[object]) -> bool:
    """Whether the fault point ``point`` is reached in (or after) the ``charge`` step: its
    stamp, its body's end, or any later point once its body began (``charge_began``)."""
    if point == "stamp.after":
        return bool(context["effect"].node == "charge")
    if point == "effect.after":
        return bool(context["node"] == "charge")
    return bool(charge_began)


def assert_charged_at_most_once(point: str, lease: Lease, effects: list[str], where: str) -> None:
    """The verdict of a ``linear`` run faulted at ``point`` and taken over: ``charge`` ran
    once (never, if the fault came between its stamp and its body), and the execution is
    done, or dead-lettered naming it."""
    assert effects.count("charge") == (0 if point == "stamp.after" else 1), where
    assert lease.status in (LeaseStatus.DONE, LeaseStatus.DEAD_LETTERED), where
    if lease.status is LeaseStatus.DEAD_LETTERED:
        assert lease.reason is not None, where
        assert "'charge'" in lease.reason, where


def _kill_after_charge(point: str, charge_began: list[bool]) -> Any:
    def action(context: Mapping[str, Any]) -> None:
        if at_charge(point, context, charge_began):
            os.kill(os.getpid(), signal.SIGKILL)

    return action


def open_doomed(url: str, schema: str, ttl: float) -> AbstractAsyncContextManager[Instance]:
    """The instance of a doomed process (killed mid-write by the test's fault): on the
    test's database, named by its pid, holding its leases ``ttl`` seconds."""
    return Instance.open(
        url,
        engine_options=engine_options(url, schema),
        instance_id=f"doomed-{os.getpid()}",
        lease_ttl=ttl,
    )


async def doomed(
    url: str,
    schema: str,
    tenant: str,
    variant: str,
    durability: str,
    ttl: float,
    directory: Path,
    fault: str,
    ids: list[str],
) -> int:
    async with open_doomed(url, schema, ttl) as instance:
        charge_began: list[bool] = []
        graph = build_graph(
            instance,
            variant,
            directory,
            doomed=True,
            on_effect=lambda _n: charge_began.append(True),
        )

        async def run(execution_id: str) -> None:
            await instance.ainvoke(
                graph,
                first_input(variant),
                {"configurable": {"thread_id": execution_id}},
                tenant_id=tenant,
                durability=durability,  # type: ignore[arg-type]
            )

        if fault == "-":
            await asyncio.gather(*(run(i) for i in ids))
        else:
            with arm_fault(fault, _kill_after_charge(fault, charge_began)):
                await asyncio.gather(*(run(i) for i in ids))
    return 0


def main(argv: list[str]) -> int:
    if len(argv) < 9:
        print(__doc__, file=sys.stderr)
        return 2
    url, schema, tenant, variant, durability, ttl, directory, fault, *ids = argv
    return asyncio.run(
        doomed(url, schema, tenant, variant, durability, float(ttl), Path(directory), fault, ids)
    )


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))

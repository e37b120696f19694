"""The demo: two instances, one order, a stall past the lease, and the stale writes refused.

Instance A runs an order graph and is frozen (as by a GC pause or SIGSTOP) inside its
``charge_card`` step. Its lease runs out; instance B takes the execution over (token 2) and
finishes it, charging the card once through the exactly-once sink. Then A thaws and goes on
with its step under token 1: its renewal, its charge and its checkpoint writes are refused.
The demo checks the outcome itself and exits non-zero if anything went wrong.
"""

from __future__ import annotations

import asyncio
import contextvars
import logging
import operator
import tempfile
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import Annotated, Any, TypedDict

from langchain_core.runnables import RunnableConfig
from sqlalchemy import text

from .context import get_execution_context
from .database import create_engine, schema_options
from .effects import Effect
from .errors import ExecutionLeaseLostError, find_fence_error
from .executions import SqlExecutionRecords
from .faults import StallableRepository, StallGate
from .instance import Instance
from .lease import LeaseKey
from .nodes import fence_graph
from .sinks import fenced_write, setup_sink
from .stores.sql import SqlLeaseRepository

__all__ = ["DemoResult", "TimelineEvent", "run_demo"]

LEASE_TTL = 2.0
RENEW_INTERVAL = 0.5
TENANT = "acme"

_worker: contextvars.ContextVar[str] = contextvars.ContextVar("demo_worker", default="?")


@dataclass(frozen=True, slots=True)
class TimelineEvent:
    """One line of the demo's timeline."""

    at: float
    worker: str
    token: int | None
    what: str
    outcome: str = "ok"


@dataclass(slots=True)
class DemoResult:
    """What the demo saw, and whether it is what the guarantees promise."""

    db: str
    execution: str
    events: list[TimelineEvent] = field(default_factory=list)
    payments: list[tuple[str, int, int]] = field(default_factory=list)
    final_state: dict[str, Any] = field(default_factory=dict)
    a_error: BaseException | None = None
    problems: list[str] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        """True when every check of the demo held."""
        return not self.problems


class Order(TypedDict, total=False):
    order_id: str
    amount_cents: int
    log: Annotated[list[str], operator.add]
    receipt: str


class _Timeline:
    def __init__(self, result: DemoResult) -> None:
        self.result = result
        self.start = time.monotonic()

    def add(self, worker: str, token: int | None, what: str, outcome: str = "ok") -> None:
        self.result.events.append(
            TimelineEvent(round(time.monotonic() - self.start, 2), worker, token, what, outcome)
        )


class _RefusalLog(logging.Handler):
    """Turns the library's own fencing warnings into timeline lines."""

    def __init__(self, timeline: _Timeline) -> None:
        super().__init__(logging.WARNING)
        self.timeline = timeline

    def emit(self, record: logging.LogRecord) -> None:
        message = record.getMessage()
        if "fenced" in message or "refused" in message or "lost its lease" in message:
            # The first sentence says what happened; the rest is advice for logs.
            self.timeline.add(_worker.get(), None, message.split(". ")[0], "refused")


def _build_graph(timeline: _Timeline, engine: Any, frozen: dict[str, asyncio.Event]) -> Any:
    from langgraph.graph import END, START, StateGraph

    async def receive_order(state: Order) -> dict[str, Any]:
        fence = get_execution_context().fence
        timeline.add(_worker.get(), fence.token, f"receive_order {state['order_id']}")
        return {"log": [f"received by {_worker.get()}"]}

    async def charge_card(state: Order) -> dict[str, Any]:
        frame = get_execution_context()
        worker = _worker.get()
        timeline.add(worker, frame.fence.token, "charge_card: stamped its pending effect, begins")
        thaw = frozen.get(worker)
        if thaw is not None:
            timeline.add(worker, frame.fence.token, "frozen inside charge_card (GC pause)")
            await thaw.wait()
            timeline.add(worker, frame.fence.token, "thawed: goes on with its charge")
        async with engine.connect() as conn:
            if conn.dialect.name == "postgresql":
                conn = await conn.execution_options(isolation_level="READ COMMITTED")
            async with conn.begin():
                key = f"charge:{state['order_id']}"
                try:
                    async with fenced_write(conn, frame.fence, key) as write:
                        if write.applied:
                            receipt = write.result
                        else:
                            await conn.execute(
                                text(
                                    "INSERT INTO demo_payments (order_id, amount_cents, token)"
                                    " VALUES (:o, :a, :t)"
                                ),
                                {
                                    "o": state["order_id"],
                                    "a": state["amount_cents"],
                                    "t": frame.fence.token,
                                },
                            )
                            receipt = f"rcpt-{state['order_id']}-t{frame.fence.token}"
                            write.record(receipt)
                except ExecutionLeaseLostError as exc:
                    timeline.add(worker, frame.fence.token, f"charge refused: {exc}", "refused")
                    raise
        timeline.add(worker, frame.fence.token, f"charged {state['amount_cents']} cents once")
        return {"receipt": receipt, "log": [f"charged by {worker}"]}

    async def send_receipt(state: Order) -> dict[str, Any]:
        fence = get_execution_context().fence
        timeline.add(_worker.get(), fence.token, f"send_receipt {state['receipt']}")
        return {"log": [f"receipt sent by {_worker.get()}"]}

    builder = StateGraph(Order)
    builder.add_node("receive_order", receive_order)
    builder.add_node("charge_card", charge_card)
    builder.add_node("send_receipt", send_receipt)
    builder.add_edge(START, "receive_order")
    builder.add_edge("receive_order", "charge_card")
    builder.add_edge("charge_card", "send_receipt")
    builder.add_edge("send_receipt", END)
    # The charge is exactly-once through the sink, so repeating the step converges.
    return fence_graph(builder, effects={"charge_card": Effect.IDEMPOTENT_WRITE})


async def _wait_for_expiry(store: SqlLeaseRepository, key: LeaseKey, deadline: float) -> None:
    while time.monotonic() < deadline:
        lease = await store.get(key)
        if lease is not None and lease.expires_at is not None:
            if lease.expires_at <= await store.now():
                return
        await asyncio.sleep(0.05)
    raise TimeoutError(f"the lease of {key.scope_key} did not expire in time")


async def run_demo(db: str | None = None, *, schema: str | None = None) -> DemoResult:
    """Run the demo on ``db`` (default: a SQLite file in a temporary folder), in PostgreSQL
    ``schema`` when given."""
    from checkpointers import SqlCheckpointer

    with tempfile.TemporaryDirectory(prefix="langgraph-fence-demo-") as folder:
        url = db or f"sqlite+aiosqlite:///{Path(folder) / 'demo.db'}"
        order_id = f"order-{uuid.uuid4().hex[:6]}"
        result = DemoResult(db=url.split("@")[-1], execution=f"{TENANT}:{order_id}")
        timeline = _Timeline(result)
        handler = _RefusalLog(timeline)
        library_log = logging.getLogger("langgraph_fence")
        level = library_log.level
        if library_log.getEffectiveLevel() > logging.WARNING:
            library_log.setLevel(logging.WARNING)
        library_log.addHandler(handler)
        engine = create_engine(url, **schema_options(schema))
        try:
            await _run(engine, order_id, timeline, result, SqlCheckpointer)
        finally:
            library_log.removeHandler(handler)
            library_log.setLevel(level)
            await engine.dispose()
        return result


async def _run(
    engine: Any, order_id: str, timeline: _Timeline, result: DemoResult, saver_cls: Any
) -> None:
    store = SqlLeaseRepository(engine)
    await store.setup()
    saver = saver_cls(engine)
    await saver.setup()
    await setup_sink(engine)
    records = SqlExecutionRecords(engine)
    await records.setup()
    async with engine.begin() as conn:
        await conn.execute(
            text(
                "CREATE TABLE IF NOT EXISTS demo_payments (order_id TEXT NOT NULL, "
                "amount_cents INTEGER NOT NULL, token INTEGER NOT NULL)"
            )
        )
    gates = {"A": StallGate(), "B": StallGate()}
    instances = {
        name: Instance(
            StallableRepository(store, gate),
            saver,
            instance_id=f"worker-{name}",
            lease_ttl=LEASE_TTL,
            renew_interval=RENEW_INTERVAL,
            sleep=gate.gated_sleep(asyncio.sleep),
            records=records,
        )
        for name, gate in gates.items()
    }
    frozen = {"A": asyncio.Event()}
    graph = _build_graph(timeline, engine, frozen).compile(
        checkpointer=instances["A"].checkpointer, name="orders"
    )
    config: RunnableConfig = {"configurable": {"thread_id": order_id}}
    key = LeaseKey(TENANT, order_id)

    async def run_a() -> None:
        _worker.set("A")
        timeline.add("A", None, "acquires the lease of the order")
        try:
            await instances["A"].ainvoke(
                graph,
                {"order_id": order_id, "amount_cents": 4200, "log": []},
                config,
                tenant_id=TENANT,
                durability="sync",
            )
        except Exception as exc:
            result.a_error = exc
            fence_error = find_fence_error(exc)
            shown = fence_error if fence_error is not None else exc
            timeline.add("A", None, f"run ends with {type(shown).__name__}", "refused")

    task_a = asyncio.create_task(run_a())
    try:
        final = await _takeover(
            store, key, gates, frozen, instances, graph, config, timeline, result, task_a
        )
    finally:
        # Whatever happened, thaw A and let its run end: a frozen instance never exits.
        gates["A"].resume()
        frozen["A"].set()
        try:
            await asyncio.wait_for(task_a, 10)
        except (TimeoutError, asyncio.CancelledError):
            result.problems.append("instance A did not stop within 10 s of being resumed")
    if final is None:
        return
    result.final_state = dict(final)
    async with engine.connect() as conn:
        rows = await conn.execute(
            text("SELECT order_id, amount_cents, token FROM demo_payments WHERE order_id = :o"),
            {"o": order_id},
        )
        result.payments = [(r.order_id, r.amount_cents, r.token) for r in rows]
    _check(result, await store.get(key))


async def _takeover(
    store: SqlLeaseRepository,
    key: LeaseKey,
    gates: dict[str, StallGate],
    frozen: dict[str, asyncio.Event],
    instances: dict[str, Instance],
    graph: Any,
    config: Any,
    timeline: _Timeline,
    result: DemoResult,
    task_a: asyncio.Task[None],
) -> Any:
    """Freeze A inside charge_card, let its lease expire, let B take over, then thaw A."""
    deadline = time.monotonic() + 10
    while not any("frozen inside" in e.what for e in result.events):
        if task_a.done() or time.monotonic() > deadline:
            result.problems.append("instance A never reached charge_card")
            return None
        await asyncio.sleep(0.01)
    gates["A"].stall()
    timeline.add("A", 1, f"stalled: no renewals for longer than the {LEASE_TTL:g} s lease")
    await _wait_for_expiry(store, key, time.monotonic() + 10 * LEASE_TTL)
    timeline.add("-", 1, "the lease of A has expired (judged by the store's clock)")

    _worker.set("B")
    timeline.add("B", None, "takes the execution over and resumes it from its checkpoint")
    final = await instances["B"].ainvoke(graph, None, config, tenant_id=TENANT, durability="sync")
    lease = await store.get(key)
    timeline.add("B", lease.epoch if lease else None, f"run ends: {lease.status if lease else '?'}")

    _worker.set("A")
    timeline.add("A", 1, "resumed (SIGCONT)")
    gates["A"].resume()
    frozen["A"].set()
    await asyncio.wait_for(asyncio.shield(task_a), 10)
    return final


def _check(result: DemoResult, lease: Any) -> None:
    if len(result.payments) != 1:
        result.problems.append(f"expected exactly one payment, found {result.payments}")
    elif result.payments[0][2] != 2:
        result.problems.append(f"the payment was made under token {result.payments[0][2]}, not 2")
    if lease is None or lease.status != "done" or lease.epoch != 2:
        result.problems.append(f"expected the execution done at token 2, found {lease}")
    if result.a_error is None or find_fence_error(result.a_error) is None:
        result.problems.append(f"instance A was not fenced: it ended with {result.a_error!r}")
    if not any(e.outcome == "refused" for e in result.events):
        result.problems.append("no refused write was recorded")
    log = result.final_state.get("log", [])
    if any("by A" in line and "charged" in line for line in log):
        result.problems.append(f"A's charge reached the final state: {log}")

"""The demo: two instances, one order, a stall past the lease, and the stale write refused.

Instance A runs an order graph and is frozen (as a paused VM is: its timers stop and its
clock does not move) inside its ``charge_card`` step. Its lease runs out by the store's
clock; instance B takes the execution over (token 2) and finishes it, charging the card
once through the exactly-once sink. Then A thaws, still believing it holds token 1, and goes
on with its charge: the sink refuses it (it has seen token 2) and A's run ends fenced. Every
timeline row names its worker and the token it acted under; the rows of the instances'
events (acquired, fenced, ...) come from the event hook (:mod:`langgraph_fence.events`).

The database is kept (by default ``langgraph-fence-demo.db`` in the current folder), so
``langgraph-fence executions --db ...`` can be pointed at it afterwards; on PostgreSQL the
demo works in a schema of its own (``langgraph_fence_demo`` unless ``schema`` is given) and
creates it if needed. The demo checks the outcome itself and exits non-zero if anything
went wrong.
"""

from __future__ import annotations

import asyncio
import contextvars
import operator
import shlex
import sys
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import Annotated, Any, TypedDict

from langchain_core.runnables import RunnableConfig
from sqlalchemy import text
from sqlalchemy.engine import make_url

from langgraph_fence.database import create_engine, normalize_url
from langgraph_fence.effects import Effect
from langgraph_fence.errors import ExecutionLeaseLostError, find_fence_error
from langgraph_fence.events import FenceEvent
from langgraph_fence.instance import Instance
from langgraph_fence.lease import LeaseKey
from langgraph_fence.lease.faults import StallableRepository, StallGate
from langgraph_fence.lease.journal import Journal
from langgraph_fence.lease.records import SqlExecutionRecords
from langgraph_fence.lease.sql import SqlLeaseRepository
from langgraph_fence.redact import mask_password
from langgraph_fence.sinks import fenced_write, setup_sink
from langgraph_fence.steps.context import get_execution_context
from langgraph_fence.steps.graph import fence_graph

__all__ = ["DEFAULT_DEMO_FILE", "DEFAULT_DEMO_SCHEMA", "DemoResult", "TimelineEvent", "run_demo"]

LEASE_TTL = 2.0
RENEW_INTERVAL = 0.5
TENANT = "acme"
#: Where the demo keeps its database when no ``--db`` is given (in the current folder).
DEFAULT_DEMO_FILE = "langgraph-fence-demo.db"
#: The PostgreSQL schema the demo works in when no ``--schema`` is given.
DEFAULT_DEMO_SCHEMA = "langgraph_fence_demo"

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
    #: The kept database's URL (its password left out) and PostgreSQL schema, to inspect it.
    url: str = ""
    schema: str | None = None
    #: Whether ``url`` had a password, left out of :attr:`inspect_command` (never printed).
    password_left_out: bool = False
    events: list[TimelineEvent] = field(default_factory=list)
    payments: list[tuple[str, int, int]] = field(default_factory=list)
    final_state: dict[str, Any] = field(default_factory=dict)
    a_error: BaseException | None = None
    problems: list[str] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        """True when every check of the demo held."""
        return not self.problems

    @property
    def inspect_command(self) -> str:
        """The command that lists the executions of the kept database, runnable as printed
        in a shell (quoted where needed): this interpreter's path and ``-m langgraph_fence``,
        so it needs no activated virtual environment."""
        schema = ["--schema", self.schema] if self.schema else []
        command = [sys.executable, "-m", "langgraph_fence", "executions", "--db", self.url]
        return shlex.join([*command, *schema])


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

    def on_event(self, event: FenceEvent) -> None:
        """An instance's event as a row: the instance, the token, and what happened."""
        worker = event.holder.removeprefix("worker-")
        what = event.kind.value.replace("_", " ")
        if event.reason:
            # The first sentence says what happened; the rest is advice for logs.
            what += f": {event.reason.split('. ')[0]}"
        refused = event.kind.value in ("lost", "fenced", "dead_lettered")
        self.add(worker, event.token, what, "refused" if refused else "ok")


class _PausableClock:
    """A monotonic clock that stops while paused, as a paused VM's does: the instance
    frozen on it believes, when thawed, that its lease is still held."""

    def __init__(self) -> None:
        self._lost = 0.0
        self._paused_at: float | None = None

    def __call__(self) -> float:
        now = time.monotonic() if self._paused_at is None else self._paused_at
        return now - self._lost

    def pause(self) -> None:
        if self._paused_at is None:
            self._paused_at = time.monotonic()

    def resume(self) -> None:
        if self._paused_at is not None:
            self._lost += time.monotonic() - self._paused_at
            self._paused_at = None


@dataclass(slots=True)
class _Freeze:
    """Holds worker A inside charge_card until thawed; tells when its charge was refused."""

    worker: str = "A"
    thaw: asyncio.Event = field(default_factory=asyncio.Event)
    refused: asyncio.Event = field(default_factory=asyncio.Event)


def _build_graph(timeline: _Timeline, engine: Any, frozen: _Freeze) -> Any:
    from langgraph.graph import END, START, StateGraph

    async def receive_order(state: Order) -> dict[str, Any]:
        fence = get_execution_context().fence
        timeline.add(_worker.get(), fence.token, f"receive_order {state['order_id']}")
        return {"log": [f"received by {_worker.get()}"]}

    async def charge_card(state: Order) -> dict[str, Any]:
        frame = get_execution_context()
        worker = _worker.get()
        timeline.add(worker, frame.fence.token, "charge_card begins")
        if worker == frozen.worker:
            timeline.add(worker, frame.fence.token, "frozen inside charge_card (VM paused)")
            await frozen.thaw.wait()
            timeline.add(worker, frame.fence.token, "goes on: tries its charge through the sink")
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
                    what = f"charge refused ({type(exc).__name__}): no payment made"
                    timeline.add(worker, frame.fence.token, what, "refused")
                    frozen.refused.set()
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
        if (
            lease is not None
            and lease.expires_at is not None
            and lease.expires_at <= await store.now()
        ):
            return
        await asyncio.sleep(0.05)
    raise TimeoutError(f"the lease of {key.scope_key} did not expire in time")


async def run_demo(db: str | None = None, *, schema: str | None = None) -> DemoResult:
    """Run the demo on ``db`` and keep the database.

    Args:
        db: the database URL (default: ``langgraph-fence-demo.db`` in the current folder).
        schema: on PostgreSQL, the schema to work in (default ``langgraph_fence_demo``),
            created if it does not exist.

    Raises:
        ValueError: an unsupported URL, or a schema given for SQLite.
    """
    from langgraph_fence.checkpointers import SqlCheckpointer

    url = db or f"sqlite+aiosqlite:///{Path.cwd() / DEFAULT_DEMO_FILE}"
    postgres = normalize_url(url).get_backend_name() == "postgresql"
    if schema is not None and not postgres:
        raise ValueError("--schema is for PostgreSQL; leave it out on SQLite")
    if postgres:
        schema = schema or DEFAULT_DEMO_SCHEMA  # created by the stores' setup() if missing
    order_id = f"order-{uuid.uuid4().hex[:6]}"
    shown = mask_password(url)
    parsed = make_url(url)
    result = DemoResult(
        db=shown.split("@")[-1],
        execution=f"{TENANT}:{order_id}",
        # A masked password would not work in the printed command; asyncpg reads PGPASSWORD.
        url=parsed._replace(password=None).render_as_string(hide_password=False)
        if parsed.password
        else url,
        schema=schema,
        password_left_out=bool(parsed.password),
    )
    engine = create_engine(url, schema=schema)
    try:
        await _run(engine, order_id, _Timeline(result), result, SqlCheckpointer)
    finally:
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
                "amount_cents INTEGER NOT NULL, token BIGINT NOT NULL)"
            )
        )
    gates = {"A": StallGate(), "B": StallGate()}
    clocks = {"A": _PausableClock(), "B": _PausableClock()}
    instances = {
        name: Instance(
            StallableRepository(store, gate),
            saver,
            instance_id=f"worker-{name}",
            lease_ttl=LEASE_TTL,
            renew_interval=RENEW_INTERVAL,
            clock=clocks[name],
            sleep=gate.gated_sleep(asyncio.sleep),
            records=records,
        )
        for name, gate in gates.items()
    }
    # Each instance journals its turns, as Instance.open's do: `langgraph-fence ui` on the
    # kept database shows the takeover and the refused charge on the token timeline.
    journals = [Journal(engine) for _ in instances]
    for instance, journal in zip(instances.values(), journals, strict=True):
        instance.add_listener(timeline.on_event)
        instance.add_listener(journal)
    frozen = _Freeze()
    graph = _build_graph(timeline, engine, frozen).compile(
        checkpointer=instances["A"].checkpointer, name="orders"
    )
    config: RunnableConfig = {"configurable": {"thread_id": order_id}}
    key = LeaseKey(TENANT, order_id)

    async def run_a() -> None:
        _worker.set("A")
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
            timeline.add("A", 1, f"run ends with {type(shown).__name__}", "refused")

    task_a = asyncio.create_task(run_a())
    try:
        final = await _takeover(
            store,
            key,
            gates,
            clocks["A"],
            frozen,
            instances,
            graph,
            config,
            timeline,
            result,
            task_a,
        )
    finally:
        # Whatever happened, thaw A and let its run end: a frozen instance never exits.
        clocks["A"].resume()
        gates["A"].resume()
        frozen.thaw.set()
        try:
            await asyncio.wait_for(task_a, 10)
        except (TimeoutError, asyncio.CancelledError):
            result.problems.append("instance A did not stop within 10 s of being resumed")
        for journal in journals:
            await journal.aclose()
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
    clock_a: _PausableClock,
    frozen: _Freeze,
    instances: dict[str, Instance],
    graph: Any,
    config: Any,
    timeline: _Timeline,
    result: DemoResult,
    task_a: asyncio.Task[None],
) -> Any:
    """Freeze A inside charge_card, let its lease expire, let B take over, then thaw A:
    its step first (as a thawed VM's threads race its timers), so its charge is tried."""
    deadline = time.monotonic() + 10
    while not any("frozen inside" in e.what for e in result.events):
        if task_a.done() or time.monotonic() > deadline:
            result.problems.append("instance A never reached charge_card")
            return None
        await asyncio.sleep(0.01)
    gates["A"].stall()
    clock_a.pause()
    timeline.add("A", 1, f"paused: no renewals for longer than the {LEASE_TTL:g} s lease")
    await _wait_for_expiry(store, key, time.monotonic() + 10 * LEASE_TTL)
    timeline.add("A", 1, "its lease has expired (judged by the store's clock)")

    _worker.set("B")
    timeline.add("B", 1, "finds the lease of token 1 expired: takes the execution over")
    final = await instances["B"].ainvoke(graph, None, config, tenant_id=TENANT, durability="sync")
    lease = await store.get(key)
    status = lease.status.value if lease else "?"
    timeline.add("B", lease.epoch if lease else None, f"run ends: {status}")

    _worker.set("A")
    timeline.add("A", 1, "thawed: its clock did not move, it believes it holds token 1")
    clock_a.resume()
    frozen.thaw.set()
    # The step's attempt first; then its timers wake.
    refused = asyncio.ensure_future(frozen.refused.wait())
    await asyncio.wait([task_a, refused], timeout=10, return_when=asyncio.FIRST_COMPLETED)
    refused.cancel()
    gates["A"].resume()
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
    if not any("charge refused" in e.what for e in result.events):
        result.problems.append("A's stale charge was not tried and refused")
    log = result.final_state.get("log", [])
    if any("by A" in line and "charged" in line for line in log):
        result.problems.append(f"A's charge reached the final state: {log}")

"""The instance's event hook, and the OpenTelemetry spans and metrics made from it.

On real stores (a SQLite file, a PostgreSQL schema of the test's own) with the ``leases``
tools' controlled clock: a run that is taken over is told as acquired (token 1, A), taken
over (token 2, B), fenced (token 1, A), in that order.
"""

from __future__ import annotations

import asyncio
import importlib
import logging
import sys
from pathlib import Path
from typing import Any

import pytest
from langgraph.graph import END, START, StateGraph
from opentelemetry.sdk.metrics import MeterProvider
from opentelemetry.sdk.metrics.export import InMemoryMetricReader
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.trace import StatusCode

from langgraph_fence import (
    Effect,
    EventKind,
    ExecutionFencedError,
    FenceEvent,
    LeaseKey,
    LeaseStatus,
    fence_graph,
)
from langgraph_fence.otel import instrument
from langgraph_fence.testing import Leases, open_leases
from tests.support.databases import SQL_BACKENDS, unique
from tests.support.polling import eventually
from tests.support.takeovers import Order, Shop, take_over_mid_charge

RUNS_ON = SQL_BACKENDS


@pytest.fixture
def store(own_leases: Leases) -> Leases:
    return own_leases


def _of(events: list[FenceEvent], key: LeaseKey) -> list[tuple[str, int, str]]:
    return [(e.kind.value, e.token, e.holder) for e in events if e.scope_key == key.scope_key]


async def test_a_takeover_is_told_as_acquired_taken_over_fenced_in_order(
    store: Leases, caplog: pytest.LogCaptureFixture
) -> None:
    a, b = store.instance("A"), store.instance("B")
    events: list[FenceEvent] = []
    a.add_listener(events.append)
    b.add_listener(events.append)

    with caplog.at_level(logging.INFO, logger="langgraph_fence"):
        key, a_error = await take_over_mid_charge(store, a, b, Shop())

    assert isinstance(a_error, ExecutionFencedError)
    told = _of(events, key)
    # A may first notice that its hold ran out (lost) before its renewal is refused
    # (fenced): that is its own token too.
    assert [t for t in told if t[0] != "lost"] == [
        ("acquired", 1, "A"),
        ("taken_over", 2, "B"),
        ("fenced", 1, "A"),
    ]
    assert all(t == ("lost", 1, "A") for t in told if t[0] == "lost")
    taken = next(e for e in events if e.kind is EventKind.TAKEN_OVER)
    assert taken.reason == "from A at token 1"
    fenced = next(e for e in events if e.kind is EventKind.FENCED)
    assert fenced.reason is not None
    assert "epoch 2" in fenced.reason
    assert all(e.at > 0 for e in events)
    # The log says it too, with the scope key and token as fields a log pipeline can index.
    logged = {
        (r.getMessage().split(": ")[0], r.token)  # type: ignore[attr-defined]
        for r in caplog.records
        if getattr(r, "scope_key", None) == key.scope_key
    }
    assert (f"execution {key.scope_key} fenced at token 1", 1) in logged
    assert (f"run {key.scope_key} started at token 1 on A", 1) in logged
    assert (f"run {key.scope_key} ended done at token 2", 2) in logged


async def test_a_takeover_of_a_stamped_write_is_told_as_dead_lettered(store: Leases) -> None:
    a, b = store.instance("A"), store.instance("B")
    events: list[FenceEvent] = []
    b.add_listener(events.append)

    key, _ = await take_over_mid_charge(store, a, b, Shop(Effect.NON_IDEMPOTENT_WRITE))

    (dead,) = [e for e in events if e.scope_key == key.scope_key]
    assert dead.kind is EventKind.DEAD_LETTERED
    assert dead.holder == "B"
    assert dead.reason is not None
    assert "charge" in dead.reason
    lease = await store.store.get(key)
    assert lease is not None
    assert lease.status is LeaseStatus.DEAD_LETTERED
    assert dead.token == lease.epoch


async def test_a_renewal_close_to_the_end_of_the_hold_is_told_as_renewed_late(
    store: Leases,
) -> None:
    a = store.instance("A", lease_ttl=30.0, renew_interval=10.0)
    events: list[FenceEvent] = []
    a.add_listener(events.append)
    shop = Shop()
    thread = unique("order")
    task = asyncio.create_task(
        a.ainvoke(
            shop.graph(a), {"log": []}, {"configurable": {"thread_id": thread}}, tenant_id="acme"
        )
    )
    await asyncio.wait_for(shop.a_inside.wait(), 20)
    # The renewal due at 10 s fires at 25 s (as after a long pause): 3 s of the proven
    # 28 s hold (30 s less its safety margin) are left.
    store.advance(25.0)
    await eventually(
        lambda: any(e.kind is EventKind.RENEWED_LATE for e in events),
        timeout=20,
        interval=0.01,
        what=lambda: f"a late renewal; heard {events}",
    )
    shop.a_go.set()
    await asyncio.wait_for(task, 20)
    late = next(e for e in events if e.kind is EventKind.RENEWED_LATE)
    assert (late.scope_key, late.token, late.holder) == (f"acme:{thread}", 1, "A")
    assert late.reason == "renewed with 3.0 s of its proven hold left"


async def test_a_drained_run_is_told_as_handed_back(store: Leases) -> None:
    b = store.instance("B")
    events: list[FenceEvent] = []
    b.add_listener(events.append)
    shop = Shop()
    a = store.instance("A")  # only to hold the execution: it starts and freezes
    key = LeaseKey("acme", unique("order"))
    task_a = asyncio.create_task(
        a.ainvoke(
            shop.graph(a),
            {"log": []},
            {"configurable": {"thread_id": key.execution_id}},
            tenant_id="acme",
        )
    )
    await asyncio.wait_for(shop.a_inside.wait(), 20)
    store.stall(a)
    store.advance(31.0)
    in_step = asyncio.Event()
    release = asyncio.Event()

    async def charge(state: Order) -> dict[str, Any]:
        in_step.set()
        await release.wait()
        return {"log": ["charged"]}

    async def receipt(state: Order) -> dict[str, Any]:
        return {"log": ["receipt"]}

    builder = StateGraph(Order)
    builder.add_node("charge", charge)
    builder.add_node("receipt", receipt)
    builder.add_edge(START, "charge")
    builder.add_edge("charge", "receipt")
    builder.add_edge("receipt", END)
    graph = fence_graph(builder).compile(checkpointer=b.checkpointer, name="shop")
    stop = asyncio.Event()
    serve = asyncio.create_task(
        b.serve({"shop": graph}, poll_interval=0.02, stop=stop, handle_signals=False)
    )
    await asyncio.wait_for(in_step.wait(), 20)
    stop.set()  # as SIGTERM: the step in flight ends, then the run is handed back
    await eventually(
        lambda: any(run.control.drain_requested for run in b.host.runs),
        timeout=20,
        interval=0.01,
        what="the run to be asked to drain",
    )
    release.set()
    await asyncio.wait_for(serve, 20)
    store.resume(a)
    shop.a_go.set()
    with pytest.raises(ExecutionFencedError):
        await asyncio.wait_for(task_a, 20)
    assert [(e.kind.value, e.token) for e in events if e.scope_key == key.scope_key] == [
        ("taken_over", 2),
        ("handed_back", 2),
    ]


async def test_a_listener_that_raises_never_breaks_a_run(
    store: Leases, caplog: pytest.LogCaptureFixture
) -> None:
    a = store.instance("A")
    heard: list[FenceEvent] = []

    def broken(event: FenceEvent) -> None:
        raise RuntimeError("the listener is broken")

    a.add_listener(broken)
    a.add_listener(heard.append)
    shop = Shop()
    shop.a_go.set()
    thread = unique("order")
    with caplog.at_level(logging.ERROR, logger="langgraph_fence.events"):
        result = await a.ainvoke(
            shop.graph(a), {"log": []}, {"configurable": {"thread_id": thread}}, tenant_id="acme"
        )
    assert result["log"] == ["charged at token 1"]
    lease = await store.store.get(LeaseKey("acme", thread))
    assert lease is not None
    assert lease.status is LeaseStatus.DONE
    assert [(e.kind, e.token) for e in heard] == [(EventKind.ACQUIRED, 1)]
    (record,) = [r for r in caplog.records if "the listener is broken" in str(r.exc_info)]
    assert record.scope_key == f"acme:{thread}"  # type: ignore[attr-defined]
    assert record.token == 1  # type: ignore[attr-defined]


async def test_a_listener_that_is_not_callable_is_refused(store: Leases) -> None:
    with pytest.raises(ValueError, match="listener must be a callable"):
        store.instance("A").add_listener("print")  # type: ignore[arg-type]


async def test_otel_records_a_span_and_a_count_per_event(tmp_path: Path) -> None:
    spans = InMemorySpanExporter()
    tracer_provider = TracerProvider()
    tracer_provider.add_span_processor(SimpleSpanProcessor(spans))
    reader = InMemoryMetricReader()
    meter_provider = MeterProvider(metric_readers=[reader])
    async with open_leases(f"sqlite+aiosqlite:///{tmp_path / 'otel.db'}") as leases:
        a, b = leases.instance("A"), leases.instance("B")
        for instance in (a, b):
            instrument(instance, tracer_provider=tracer_provider, meter_provider=meter_provider)
        key, _ = await take_over_mid_charge(leases, a, b, Shop())

    finished = [s for s in spans.get_finished_spans() if s.name != "langgraph_fence.lost"]
    assert [s.name for s in finished] == [
        "langgraph_fence.acquired",
        "langgraph_fence.taken_over",
        "langgraph_fence.fenced",
    ]
    acquired, taken, fenced = finished
    assert dict(acquired.attributes or {}) == {
        "langgraph_fence.scope_key": key.scope_key,
        "langgraph_fence.token": 1,
        "langgraph_fence.holder": "A",
        # The GenAI agent attributes agent backends group spans by: thread and graph.
        "gen_ai.conversation.id": key.execution_id,
        "gen_ai.agent.name": "shop",
    }
    # B learnt them from the record it took over; A, from its own start.
    assert (taken.attributes or {})["gen_ai.conversation.id"] == key.execution_id
    assert (taken.attributes or {})["gen_ai.agent.name"] == "shop"
    assert (fenced.attributes or {})["gen_ai.conversation.id"] == key.execution_id
    assert (taken.attributes or {})["langgraph_fence.token"] == 2
    assert (taken.attributes or {})["langgraph_fence.reason"] == "from A at token 1"
    assert (fenced.attributes or {})["langgraph_fence.token"] == 1
    assert fenced.status.status_code is StatusCode.ERROR
    assert acquired.status.status_code is StatusCode.UNSET

    data = reader.get_metrics_data()
    assert data is not None
    counts = {
        point.attributes["langgraph_fence.kind"]: point.value
        for resource in data.resource_metrics
        for scope in resource.scope_metrics
        for metric in scope.metrics
        if metric.name == "langgraph_fence.events"
        for point in metric.data.data_points  # type: ignore[union-attr]
        if point.attributes is not None
    }
    counts.pop("lost", None)
    assert counts == {"acquired": 1, "taken_over": 1, "fenced": 1}


def test_otel_without_opentelemetry_says_how_to_install_it(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "opentelemetry", None)  # as if not installed
    monkeypatch.delitem(sys.modules, "langgraph_fence.otel")
    with pytest.raises(ImportError, match=r"pip install 'langgraph-fence\[otel\]'"):
        importlib.import_module("langgraph_fence.otel")

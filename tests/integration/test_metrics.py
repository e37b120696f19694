"""``/metrics`` scraped during a run with a takeover, each family parsed with Prometheus'
own parser, on real databases: what a Grafana board reads without a collector."""

from __future__ import annotations

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families
from prometheus_client.samples import Sample

from langgraph_fence import Effect, LeaseKey
from langgraph_fence.console import LocalFigures, create_app
from langgraph_fence.lease.journal import Journal
from langgraph_fence.testing import Leases
from tests.support.databases import SQL_BACKENDS
from tests.support.polling import eventually
from tests.support.takeovers import Shop, take_over_mid_charge

RUNS_ON = SQL_BACKENDS

#: Every family the issue names, by its name in the exposition (counters end in _total).
FAMILIES = {
    "langgraph_fence_executions": "gauge",
    "langgraph_fence_queue_depth": "gauge",
    "langgraph_fence_queue_oldest_age_seconds": "gauge",
    "langgraph_fence_held_leases": "gauge",
    "langgraph_fence_max_held": "gauge",
    "langgraph_fence_renewal_lateness_seconds": "gauge",
    "langgraph_fence_takeovers": "counter",
    "langgraph_fence_dead_letters": "gauge",
    "langgraph_fence_refused_writes": "counter",
    "langgraph_fence_stamps_standing": "gauge",
    "langgraph_fence_non_idempotent_stamps_standing": "gauge",
}


@pytest.fixture
def leases(own_leases: Leases) -> Leases:
    return own_leases


async def scrape(http: httpx.AsyncClient) -> dict[str, list[Sample]]:
    answer = await http.get("/metrics")
    assert answer.status_code == 200
    assert answer.headers["content-type"].startswith("text/plain; version=0.0.4")
    families = {f.name: f for f in text_string_to_metric_families(answer.text)}
    for name, kind in FAMILIES.items():
        assert name in families, f"{name} missing from /metrics"
        assert families[name].type == kind, name
    return {name: list(f.samples) for name, f in families.items()}


def value(samples: list[Sample], **labels: str) -> float | None:
    for sample in samples:
        if all(sample.labels.get(k) == v for k, v in labels.items()):
            return sample.value
    return None


async def test_metrics_during_a_run_with_a_takeover(leases: Leases) -> None:
    a, b = leases.instance("A"), leases.instance("B")
    journals = [Journal(leases.engine), Journal(leases.engine)]
    a.add_listener(journals[0])
    b.add_listener(journals[1])
    app = create_app(leases.engine, metrics_max_age=0)
    seen: dict[str, list[Sample]] = {}

    async with httpx.AsyncClient(
        transport=httpx.ASGITransport(app=app), base_url="http://console"
    ) as http:

        async def while_b_inside(key: LeaseKey) -> None:
            # B took the execution over and is inside its charge (its stamp stands).
            async def b_reported() -> bool:
                await journals[1].flush()
                seen.update(await scrape(http))
                return (
                    value(seen["langgraph_fence_max_held"], instance="B") is not None
                    and value(seen["langgraph_fence_takeovers"]) == 1.0
                )

            await eventually(b_reported, timeout=20, what="B's serve() to report its hold")

        key, a_error = await take_over_mid_charge(
            leases,
            a,
            b,
            Shop(Effect.IDEMPOTENT_WRITE, hold=("A", "B")),
            while_b_inside=while_b_inside,
        )
        assert a_error is not None
        during = seen
        assert value(during["langgraph_fence_executions"], status="running", graph="shop") == 1.0
        assert value(during["langgraph_fence_held_leases"], instance="B") == 1.0
        assert value(during["langgraph_fence_held_leases"], instance="A") is None  # taken over
        assert value(during["langgraph_fence_max_held"], instance="B") == b.max_held
        lateness = value(during["langgraph_fence_renewal_lateness_seconds"], instance="B")
        assert lateness is not None
        assert lateness >= 0.0
        assert value(during["langgraph_fence_stamps_standing"]) == 1.0
        assert value(during["langgraph_fence_non_idempotent_stamps_standing"]) == 0.0
        assert value(during["langgraph_fence_refused_writes"]) == 0.0

        for journal in journals:
            await journal.flush()
        after = await scrape(http)
        assert value(after["langgraph_fence_executions"], status="done", graph="shop") == 1.0
        assert value(after["langgraph_fence_takeovers"]) == 1.0
        assert value(after["langgraph_fence_refused_writes"]) == 1.0  # A's, when it thawed
        assert value(after["langgraph_fence_stamps_standing"]) == 0.0
        assert value(after["langgraph_fence_dead_letters"]) == 0.0
    for journal in journals:
        await journal.aclose()
    assert key.tenant_id == "acme"


async def test_a_workers_own_figures_are_added_under_its_instance(leases: Leases) -> None:
    local = [LocalFigures("worker-9", held=0, max_held=7, renewal_late=0.25, journal_dropped=3)]
    app = create_app(leases.engine, local=lambda: local, metrics_max_age=0)
    async with httpx.AsyncClient(
        transport=httpx.ASGITransport(app=app), base_url="http://console"
    ) as http:
        samples = await scrape(http)
    assert value(samples["langgraph_fence_max_held"], instance="worker-9") == 7.0
    assert value(samples["langgraph_fence_renewal_lateness_seconds"], instance="worker-9") == 0.25
    dropped = samples["langgraph_fence_journal_entries_dropped"]
    assert value(dropped, instance="worker-9") == 3.0

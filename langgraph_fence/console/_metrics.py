"""``/metrics``: the fence's figures in Prometheus' exposition format.

Read from the database (one connection, a handful of indexed or grouped queries; scrapes
within ``metrics_max_age`` seconds share one read), so any process on it reports the fleet:
the console, and a worker started with ``--metrics-port`` (which adds its own instance's
figures, labelled ``instance``). The families, each prefixed ``langgraph_fence_``:

=====================================  =======  ==========================================
family                                 type     labels, meaning
=====================================  =======  ==========================================
``executions``                         gauge    ``status``, ``graph``: executions now
``queue_depth``                        gauge    ``graph``, ``tenant``: pending executions
                                                and queued runs
``queue_oldest_age_seconds``           gauge    ``graph``, ``tenant``: age of the oldest
                                                pending submitted run
``held_leases``                        gauge    ``instance``: running leases it holds
``max_held``                           gauge    ``instance``: the most it holds at once
``renewal_lateness_seconds``           gauge    ``instance``: how far below half its
                                                margin a renewal's answer left a lease
                                                (0: in time; > 0: it takes no new run)
``takeovers_total``                    counter  takeovers journaled
``dead_letters``                       gauge    executions dead-lettered now
``refused_writes_total``               counter  stale writes refused, journaled
``stamps_standing``                    gauge    executions with a stamped write standing
``non_idempotent_stamps_standing``     gauge    of those, with a non-idempotent one
``journal_entries_dropped_total``      counter  journal entries this process dropped
                                                (worker only)
=====================================  =======  ==========================================

The totals count the journal's entries: erasing an execution removes its own, which a
Prometheus ``rate()`` reads as a counter reset.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import dataclass

from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from langgraph_fence.console._queries import Figures
from langgraph_fence.events import EventKind

__all__ = ["CONTENT_TYPE", "LocalFigures", "exposition"]

#: The exposition format's content type.
CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"
_PREFIX = "langgraph_fence_"


@dataclass(frozen=True, slots=True)
class LocalFigures:
    """What a worker process adds of its own instance."""

    instance_id: str
    held: int
    max_held: int
    renewal_late: float
    journal_dropped: int


class _Snapshot(Collector):
    def __init__(self, figures: Figures, local: Sequence[LocalFigures]) -> None:
        self._figures = figures
        self._local = local

    def collect(self) -> Iterator[Metric]:
        f = self._figures
        executions = GaugeMetricFamily(
            _PREFIX + "executions", "Executions by status and graph.", labels=["status", "graph"]
        )
        for (status, graph), n in sorted(f.executions.items()):
            executions.add_metric([status, graph], n)
        yield executions
        depth = GaugeMetricFamily(
            _PREFIX + "queue_depth",
            "Pending executions and queued runs, by graph and tenant.",
            labels=["graph", "tenant"],
        )
        oldest = GaugeMetricFamily(
            _PREFIX + "queue_oldest_age_seconds",
            "Age of the oldest pending submitted run, by graph and tenant.",
            labels=["graph", "tenant"],
        )
        for queued in f.queue:
            labels = [queued.graph, queued.tenant_id]
            depth.add_metric(labels, queued.pending + queued.queued_runs)
            oldest.add_metric(labels, queued.oldest_age or 0.0)
        yield depth
        yield oldest
        held = GaugeMetricFamily(
            _PREFIX + "held_leases", "Running leases held, by instance.", labels=["instance"]
        )
        max_held = GaugeMetricFamily(
            _PREFIX + "max_held", "The most leases an instance holds at once.", labels=["instance"]
        )
        late = GaugeMetricFamily(
            _PREFIX + "renewal_lateness_seconds",
            "How late an instance's latest renewal came (0: in time).",
            labels=["instance"],
        )
        local = {figures.instance_id: figures for figures in self._local}
        for row in f.instances:
            here = local.pop(row.instance_id, None)
            if row.held or here is not None:
                held.add_metric([row.instance_id], row.held)
            if here is None and not row.serving:
                continue  # stopped or died: its last word is no figure of now
            said_max = here.max_held if here is not None else row.max_held
            if said_max is not None:
                max_held.add_metric([row.instance_id], said_max)
            said_late = here.renewal_late if here is not None else row.renewal_late
            if said_late is not None:
                late.add_metric([row.instance_id], said_late)
        for here in local.values():  # holds nothing the table shows yet
            held.add_metric([here.instance_id], here.held)
            max_held.add_metric([here.instance_id], here.max_held)
            late.add_metric([here.instance_id], here.renewal_late)
        yield held
        yield max_held
        yield late
        yield CounterMetricFamily(
            _PREFIX + "takeovers",
            "Takeovers of an expired or handed-back execution, journaled.",
            value=f.journal.get(EventKind.TAKEN_OVER.value, 0),
        )
        yield GaugeMetricFamily(
            _PREFIX + "dead_letters",
            "Executions dead-lettered now.",
            value=sum(n for (status, _), n in f.executions.items() if status == "dead_lettered"),
        )
        yield CounterMetricFamily(
            _PREFIX + "refused_writes",
            "Writes refused because a newer token held the execution, journaled.",
            value=f.journal.get(EventKind.FENCED.value, 0),
        )
        yield GaugeMetricFamily(
            _PREFIX + "stamps_standing",
            "Executions with a stamped write standing (it may have happened).",
            value=f.stamps_standing,
        )
        yield GaugeMetricFamily(
            _PREFIX + "non_idempotent_stamps_standing",
            "Executions with a non-idempotent stamped write standing.",
            value=f.non_idempotent_standing,
        )
        if self._local:
            dropped = CounterMetricFamily(
                _PREFIX + "journal_entries_dropped",
                "Journal entries this process dropped while the database was out of reach.",
                labels=["instance"],
            )
            for here in self._local:
                dropped.add_metric([here.instance_id], here.journal_dropped)
            yield dropped


def exposition(figures: Figures, local: Sequence[LocalFigures] = ()) -> bytes:
    """``figures`` (and a worker's ``local`` ones) in the exposition format."""
    registry = CollectorRegistry(auto_describe=False)
    registry.register(_Snapshot(figures, local))
    return generate_latest(registry)

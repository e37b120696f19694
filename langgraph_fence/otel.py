"""OpenTelemetry spans and metrics from an instance's events (``langgraph-fence[otel]``).

``instrument(instance)`` adds a listener (:mod:`langgraph_fence.events`) that turns each
event into

* a span named ``langgraph_fence.<kind>`` (``langgraph_fence.acquired``,
  ``langgraph_fence.fenced``, ...), a child of the span current where the event happened
  (the run's, when you trace your runs), starting and ending at the event's time, with the
  attributes ``langgraph_fence.scope_key``, ``.token``, ``.holder`` and ``.reason``, and
  OpenTelemetry's GenAI agent attributes ``gen_ai.conversation.id`` (the thread) and
  ``gen_ai.agent.name`` (the graph) where the instance ran the execution; its status is
  ERROR for ``lost``, ``fenced`` and ``dead_lettered``;
* one count on the counter ``langgraph_fence.events``, with the attribute
  ``langgraph_fence.kind`` (the scope key is left out of metrics: one series per execution
  would grow without bound).

It uses the global tracer and meter providers unless given others. Needs
``opentelemetry-api`` (``pip install 'langgraph-fence[otel]'``); the SDK or exporter is
your choice.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

try:
    from opentelemetry import metrics, trace
    from opentelemetry.trace import Status, StatusCode
except ImportError as exc:
    raise ImportError(
        "langgraph_fence.otel needs OpenTelemetry: pip install 'langgraph-fence[otel]'"
    ) from exc

from langgraph_fence.events import EventKind, FenceEvent

if TYPE_CHECKING:
    from langgraph_fence.instance import Instance

__all__ = ["OtelListener", "instrument"]

_SCOPE = "langgraph_fence"
_FAILURES = frozenset({EventKind.LOST, EventKind.FENCED, EventKind.DEAD_LETTERED})


class OtelListener:
    """An event listener that records spans and metrics (see the module docstring)."""

    def __init__(
        self,
        *,
        tracer_provider: trace.TracerProvider | None = None,
        meter_provider: metrics.MeterProvider | None = None,
    ) -> None:
        self._tracer = trace.get_tracer(_SCOPE, tracer_provider=tracer_provider)
        meter = metrics.get_meter(_SCOPE, meter_provider=meter_provider)
        self._events = meter.create_counter(
            "langgraph_fence.events",
            unit="{event}",
            description="lease events of langgraph-fence instances, by kind",
        )

    def __call__(self, event: FenceEvent) -> None:
        at = int(event.at * 1e9)
        attributes: dict[str, str | int] = {
            "langgraph_fence.scope_key": event.scope_key,
            "langgraph_fence.token": event.token,
            "langgraph_fence.holder": event.holder,
        }
        if event.reason is not None:
            attributes["langgraph_fence.reason"] = event.reason
        # OpenTelemetry's GenAI agent attributes: agent backends group spans by them.
        if event.thread_id is not None:
            attributes["gen_ai.conversation.id"] = event.thread_id
        if event.graph is not None:
            attributes["gen_ai.agent.name"] = event.graph
        span = self._tracer.start_span(
            f"langgraph_fence.{event.kind.value}", attributes=attributes, start_time=at
        )
        if event.kind in _FAILURES:
            span.set_status(Status(StatusCode.ERROR, event.reason))
        span.end(end_time=at)
        self._events.add(1, {"langgraph_fence.kind": event.kind.value})


def instrument(
    instance: Instance,
    *,
    tracer_provider: trace.TracerProvider | None = None,
    meter_provider: metrics.MeterProvider | None = None,
) -> Callable[[], None]:
    """Record spans and metrics of every event of ``instance``; returns how to stop.

    Args:
        instance: the instance whose events are recorded.
        tracer_provider: where spans go (default: the global one).
        meter_provider: where the counter goes (default: the global one).
    """
    listener = OtelListener(tracer_provider=tracer_provider, meter_provider=meter_provider)
    return instance.add_listener(listener)

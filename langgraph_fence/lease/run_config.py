"""What of a run's config and options is recorded with its execution, and how it comes back.

A run started with input records, besides its graph, thread and input, the parts of its
config and ``ainvoke`` options that change what its steps do: the user's
``configurable`` keys (a ``user_id`` a node reads), the runtime ``context=``,
``recursion_limit``, ``tags``, ``metadata``, ``run_name``, ``max_concurrency``, and the
options ``durability``, ``interrupt_before`` and ``interrupt_after``. An instance that takes
the execution over runs it with them again (:func:`restore_run`), so a resumed step sees
the run as it was started.

Not recorded, and not carried over to a takeover: callbacks and any other live object
(they cannot be stored; a value of ``configurable``, the context or an option that cannot
be is refused at start, :func:`record_run`), the ids the runtime sets itself
(``thread_id``, ``tenant_id``, ``execution_id``, the run's handle, every ``configurable``
key with two leading underscores, LangGraph's and its Agent Server's own, and the server's
``langgraph_auth_*``),
a ``checkpoint_id``
(a takeover resumes from the thread's last checkpoint, not the one the run started from),
``run_id``, and the options that only shape what a caller is handed back
(``stream_mode``, ``output_keys``, ``subgraphs``, ...).
"""

from __future__ import annotations

from collections.abc import Collection, Mapping
from dataclasses import dataclass, field
from typing import Any

from langchain_core.runnables import RunnableConfig
from langgraph.checkpoint.serde.base import SerializerProtocol

from langgraph_fence.keys import FENCE_CONFIG_KEY
from langgraph_fence.serde import graph_allowlist, loads_checked, with_allowlist

__all__ = ["RECORDED_CONFIG_KEYS", "RECORDED_OPTIONS", "RecordedRun", "record_run", "restore_run"]

#: Top-level config keys recorded with an execution.
RECORDED_CONFIG_KEYS = ("recursion_limit", "tags", "metadata", "run_name", "max_concurrency")
#: ``ainvoke`` / ``astream`` options recorded with an execution.
RECORDED_OPTIONS = ("context", "durability", "interrupt_before", "interrupt_after")
# Set by the runtime (or pointing at one checkpoint): never recorded from a caller's config.
_RUNTIME_CONFIGURABLE = frozenset(
    {
        "thread_id",
        "tenant_id",
        "execution_id",
        "execution_context",
        "checkpoint_id",
        "checkpoint_ns",
        "checkpoint_map",
        FENCE_CONFIG_KEY,
    }
)


def _recorded_key(key: str) -> bool:
    """Whether ``configurable[key]`` is the user's, to record. Keys with two leading
    underscores are LangGraph's and its Agent Server's own (``__pregel_runtime``,
    ``__pregel_node_finished``, ...), and ``langgraph_auth_*`` the server's for the request's
    user (a live object under custom auth): set on every run, never by the user."""
    return (
        key not in _RUNTIME_CONFIGURABLE
        and not key.startswith("__")
        and not key.startswith("langgraph_auth_")
    )


@dataclass(frozen=True, slots=True)
class RecordedRun:
    """The recorded part of a run's config (``configurable`` holds the user's keys only)
    and of its ``ainvoke`` options."""

    configurable: Mapping[str, Any] = field(default_factory=dict)
    config: Mapping[str, Any] = field(default_factory=dict)
    options: Mapping[str, Any] = field(default_factory=dict)

    def as_payload(self) -> dict[str, Any]:
        """The plain dict a serializer stores (see :meth:`from_payload`)."""
        return {
            "configurable": dict(self.configurable),
            "config": dict(self.config),
            "options": dict(self.options),
        }

    @classmethod
    def from_payload(cls, payload: Any) -> RecordedRun:
        """The run :meth:`as_payload` stored; ``ValueError`` for anything else."""
        if not isinstance(payload, Mapping) or not all(
            isinstance(payload.get(part, {}), Mapping)
            for part in ("configurable", "config", "options")
        ):
            raise ValueError(f"a recorded run config must be a dict of dicts, got {payload!r}")
        return cls(
            dict(payload.get("configurable", {})),
            dict(payload.get("config", {})),
            dict(payload.get("options", {})),
        )


def run_allowlist(graph: Any) -> frozenset[tuple[str, ...]]:
    """What a recorded run of ``graph`` may construct: the graph's schema types
    (:func:`~langgraph_fence.serde.graph_allowlist`) and its declared ``context_schema``
    (the user's own class, named in code, not by the stored row)."""
    allow = set(graph_allowlist(graph))
    schema = getattr(graph, "context_schema", None)
    if isinstance(schema, type) and schema.__module__ != "builtins":
        allow.add((schema.__module__, schema.__qualname__))
    return frozenset(allow)


def record_run(
    config: Mapping[str, Any],
    options: Mapping[str, Any],
    *,
    serde: SerializerProtocol,
    allow: Collection[tuple[str, ...]] = (),
) -> RecordedRun:
    """The part of ``config`` and ``options`` a takeover runs with again, checked storable.

    Each value is encoded and decoded once with ``serde`` (and ``allow``, what a takeover
    decodes it with): a value that does not survive that is refused here, at start, before
    anything is written.

    Raises:
        ValueError: a value cannot be recorded; the message names its key (e.g.
            ``config['configurable']['db']``) and the fix.
    """
    configurable = config.get("configurable") or {}
    picked = RecordedRun(
        {k: v for k, v in configurable.items() if _recorded_key(k)},
        {k: config[k] for k in RECORDED_CONFIG_KEYS if config.get(k) is not None},
        {k: options[k] for k in RECORDED_OPTIONS if options.get(k) is not None},
    )
    checker = with_allowlist(serde, allow)
    named = [
        *((f"config['configurable'][{k!r}]", v) for k, v in picked.configurable.items()),
        *((f"config[{k!r}]", v) for k, v in picked.config.items()),
        *((f"{k}=", v) for k, v in picked.options.items()),
    ]
    for name, value in named:
        try:
            loads_checked(checker, serde.dumps_typed(value), what=f"the value of {name}")
        except Exception as exc:
            raise ValueError(
                f"{name} cannot be recorded with the execution ({type(exc).__name__}: {exc}); "
                "a takeover runs the execution again with it, so it must be storable data "
                "(str, numbers, lists, dicts, or your graph's context_schema / state types "
                "when LANGGRAPH_STRICT_MSGPACK allows them). Pass live objects (clients, "
                "callbacks) another way, e.g. build them inside the node: refused before "
                "anything was written"
            ) from exc
    return picked


def restore_run(
    recorded: RecordedRun, thread_id: str, tenant_id: str
) -> tuple[RunnableConfig, dict[str, Any]]:
    """The config and ``ainvoke`` options a takeover of the run runs with: the recorded
    ones, on the execution's thread of its tenant."""
    config: dict[str, Any] = dict(recorded.config)
    config["configurable"] = {
        **recorded.configurable,
        "thread_id": thread_id,
        "tenant_id": tenant_id,
    }
    return config, dict(recorded.options)  # type: ignore[return-value]

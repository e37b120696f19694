"""Between LangGraph's values and the saver's rows, no I/O: a config's thread and tenant read
and checked, a checkpoint split into its row and the blobs of its channels, a task's writes
serialized, and a stored checkpoint read back as the tuple LangGraph expects.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from langchain_core.runnables import RunnableConfig
from langgraph.checkpoint.base import (
    WRITES_IDX_MAP,
    ChannelVersions,
    Checkpoint,
    CheckpointMetadata,
    CheckpointTuple,
    get_serializable_checkpoint_metadata,
    writes_sort_key,
)

from langgraph_fence.checkpointers._rows import (
    BlobRow,
    CheckpointRow,
    StoredCheckpoint,
    WriteRow,
)
from langgraph_fence.fence.tenancy import DEFAULT_TENANT, thread_tenant
from langgraph_fence.validate import storable_text

__all__ = [
    "INLINE_MAX_CHARS",
    "checkpoint_row",
    "checkpoint_tuple",
    "tenant_arg",
    "tenant_of",
    "text_arg",
    "thread_config",
    "thread_of",
    "write_rows",
]

Dumps = Callable[[Any], tuple[str, bytes]]
Loads = Callable[[tuple[str, bytes]], Any]

#: The longest text kept inline in a checkpoint row; a longer one is a channel blob, stored
#: once per version instead of once per checkpoint (a 100 MB input was in every one).
INLINE_MAX_CHARS = 1024


def text_arg(value: Any, name: str) -> str:
    """``config["configurable"][name]`` as a text a row can store."""
    return storable_text(f'config["configurable"]["{name}"]', str(value))


def thread_of(config: RunnableConfig | None, action: str) -> tuple[str, str]:
    """``(thread_id, checkpoint_ns)`` of ``config``, checked."""
    configurable = config.get("configurable") if isinstance(config, Mapping) else None
    if not isinstance(configurable, Mapping) or configurable.get("thread_id") is None:
        raise ValueError(
            f'{action} needs config["configurable"]["thread_id"]: pass '
            'config={"configurable": {"thread_id": "<your thread id>"}} (a checkpointer keys '
            "every checkpoint by its thread)"
        )
    thread_id = text_arg(configurable["thread_id"], "thread_id")
    checkpoint_ns = text_arg(configurable.get("checkpoint_ns") or "", "checkpoint_ns")
    return thread_id, checkpoint_ns


def tenant_arg(tenant_id: object) -> str:
    """A maintenance call's ``tenant_id``, checked."""
    if not isinstance(tenant_id, str):
        raise ValueError(
            f"tenant_id must be a str (the tenant whose threads to act on; '' for the "
            f"default tenant), got {tenant_id!r}"
        )
    return storable_text("tenant_id", tenant_id)


def tenant_of(config: RunnableConfig | None) -> str:
    """The tenant whose thread ``config`` names (see :func:`thread_tenant`), checked."""
    return text_arg(thread_tenant(config), "tenant_id")


def thread_config(
    tenant_id: str, thread_id: str, checkpoint_ns: str, checkpoint_id: str
) -> RunnableConfig:
    """The config naming one checkpoint; it names the tenant unless it is the default one
    (the plain LangGraph config, for plain LangGraph use)."""
    configurable: dict[str, Any] = {
        "thread_id": thread_id,
        "checkpoint_ns": checkpoint_ns,
        "checkpoint_id": checkpoint_id,
    }
    if tenant_id != DEFAULT_TENANT:
        configurable["tenant_id"] = tenant_id
    return {"configurable": configurable}


def _is_inline(value: Any) -> bool:
    if isinstance(value, str):
        return len(value) <= INLINE_MAX_CHARS
    return value is None or isinstance(value, int | float | bool)


def checkpoint_row(
    config: RunnableConfig,
    checkpoint: Checkpoint,
    metadata: CheckpointMetadata,
    new_versions: ChannelVersions,
    dumps: Dumps,
) -> CheckpointRow:
    """The row ``aput`` writes: small primitive values inline, every other channel value a
    blob of its version."""
    thread_id, checkpoint_ns = thread_of(config, "aput")
    inline: dict[str, Any] = {}
    blob_values: dict[str, Any] = {}
    for channel, value in checkpoint["channel_values"].items():
        (inline if _is_inline(value) else blob_values)[channel] = value
    stored = checkpoint.copy()
    stored["channel_values"] = inline
    versions = {**checkpoint["channel_versions"], **new_versions}
    # A new version's blob, and a long text's at any version: a checkpoint written
    # before long texts left the row kept it inline, so its blob may not exist yet (it
    # is written once: an existing blob row is left as it is).
    blobs: list[BlobRow] = [
        (channel, str(versions[channel]), *dumps(value))
        for channel, value in blob_values.items()
        if channel in new_versions or (isinstance(value, str) and channel in versions)
    ]
    type_, data = dumps(stored)
    meta = get_serializable_checkpoint_metadata(config, metadata)
    run_id = meta.get("run_id")
    return CheckpointRow(
        tenant_id=tenant_of(config),
        thread_id=thread_id,
        checkpoint_ns=checkpoint_ns,
        checkpoint_id=checkpoint["id"],
        parent_checkpoint_id=config["configurable"].get("checkpoint_id"),
        type=type_,
        checkpoint=data,
        channel_versions=json.dumps({k: str(v) for k, v in checkpoint["channel_versions"].items()}),
        metadata=json.dumps(meta),
        run_id=None if run_id is None else str(run_id),
        blobs=blobs,
    )


def write_rows(writes: Sequence[tuple[str, Any]], dumps: Dumps) -> tuple[list[WriteRow], bool]:
    """A task's writes as rows, and whether a write again replaces them (every channel is
    one of LangGraph's special ones)."""
    rows: list[WriteRow] = [
        (WRITES_IDX_MAP.get(channel, idx), channel, *dumps(value))
        for idx, (channel, value) in enumerate(writes)
    ]
    return rows, all(channel in WRITES_IDX_MAP for channel, _ in writes)


def checkpoint_tuple(row: StoredCheckpoint, loads: Loads) -> CheckpointTuple:
    """A stored checkpoint as LangGraph reads it: its blobs back in its channel values, its
    pending writes in LangGraph's order."""
    checkpoint: Checkpoint = loads((row.type, row.checkpoint))
    values = checkpoint["channel_values"]
    for channel, type_, blob in row.blobs:
        if type_ != "empty" and blob is not None:
            values[channel] = loads((type_, blob))
    writes = sorted(row.writes, key=lambda w: writes_sort_key(w[4], w[0], w[5]))
    metadata = json.loads(row.metadata) if isinstance(row.metadata, str) else row.metadata
    parent = (
        thread_config(row.tenant_id, row.thread_id, row.checkpoint_ns, row.parent_checkpoint_id)
        if row.parent_checkpoint_id
        else None
    )
    return CheckpointTuple(
        thread_config(row.tenant_id, row.thread_id, row.checkpoint_ns, row.checkpoint_id),
        checkpoint,
        metadata,
        parent,
        [(w[0], w[1], loads((w[2], w[3]))) for w in writes],
    )

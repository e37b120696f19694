"""The checkpoint tables of :class:`~checkpointers.SqlCheckpointer` and their migrations.

The split follows the official PostgreSQL saver, for the same reason: a channel's value is
written once per *version*, not once per checkpoint. ``fence_checkpoint_blobs`` holds one
row per ``(thread, namespace, channel, version)``; a checkpoint row keeps only the small
primitive values inline and the channel versions it was taken at, so a superstep that
changed one channel of a large state writes that channel alone. ``fence_checkpoint_writes``
holds the pending writes of the tasks of a checkpoint (what a resumed run reuses).

Differences from the official schema:

* every checkpoint and write row carries ``fence_token``: the lease epoch it was written
  under (``NULL`` when written without a run handle, or copied by ``copy_thread``);
* the checkpoint itself is stored serialized by the saver's serde (msgpack), not as JSON,
  so no value is lost to JSON and PostgreSQL's NUL-byte rule does not apply to it;
* ``channel_versions`` and ``metadata`` are JSON (``JSONB`` on PostgreSQL, ``TEXT`` on
  SQLite) so pruning and metadata filters can run in SQL; ``run_id`` is its own indexed
  column so ``delete_for_runs`` does not scan metadata.

Table names carry the ``fence_`` prefix: they can live beside the official savers' tables.
"""

from __future__ import annotations

from langgraph_fence.migrations import Migration

__all__ = ["CHECKPOINT_MIGRATIONS", "COMPONENT"]

#: The component name in ``fence_schema_versions``.
COMPONENT = "checkpoints"

_CHECKPOINTS = """
CREATE TABLE IF NOT EXISTS fence_checkpoints (
    thread_id TEXT NOT NULL,
    checkpoint_ns TEXT NOT NULL DEFAULT '',
    checkpoint_id TEXT NOT NULL,
    parent_checkpoint_id TEXT,
    type TEXT NOT NULL,
    checkpoint {binary} NOT NULL,
    channel_versions {json} NOT NULL,
    metadata {json} NOT NULL,
    run_id TEXT,
    fence_token BIGINT,
    PRIMARY KEY (thread_id, checkpoint_ns, checkpoint_id)
)
"""

_BLOBS = """
CREATE TABLE IF NOT EXISTS fence_checkpoint_blobs (
    thread_id TEXT NOT NULL,
    checkpoint_ns TEXT NOT NULL DEFAULT '',
    channel TEXT NOT NULL,
    version TEXT NOT NULL,
    type TEXT NOT NULL,
    blob {binary},
    PRIMARY KEY (thread_id, checkpoint_ns, channel, version)
)
"""

_WRITES = """
CREATE TABLE IF NOT EXISTS fence_checkpoint_writes (
    thread_id TEXT NOT NULL,
    checkpoint_ns TEXT NOT NULL DEFAULT '',
    checkpoint_id TEXT NOT NULL,
    task_id TEXT NOT NULL,
    idx INTEGER NOT NULL,
    channel TEXT NOT NULL,
    type TEXT NOT NULL,
    blob {binary} NOT NULL,
    task_path TEXT NOT NULL DEFAULT '',
    fence_token BIGINT,
    PRIMARY KEY (thread_id, checkpoint_ns, checkpoint_id, task_id, idx)
)
"""

_RUN_ID_INDEX = "CREATE INDEX IF NOT EXISTS fence_checkpoints_run_id ON fence_checkpoints (run_id)"


def _steps(*, binary: str, json: str) -> list[str]:
    return [
        _CHECKPOINTS.format(binary=binary, json=json),
        _BLOBS.format(binary=binary),
        _WRITES.format(binary=binary),
        _RUN_ID_INDEX,
    ]


CHECKPOINT_MIGRATIONS = [
    Migration(
        version=1,
        description="checkpoints, channel blobs and pending writes, with fence tokens",
        sqlite=_steps(binary="BLOB", json="TEXT"),
        postgresql=_steps(binary="BYTEA", json="JSONB"),
    ),
]

"""The saver's maintenance statements: delete threads or runs, copy a thread, prune, and
collect the blobs no checkpoint references. Each runs on a connection inside the caller's one
transaction, within one tenant; none is fenced (see ``SqlCheckpointer``).
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence

from sqlalchemy import text
from sqlalchemy.ext.asyncio import AsyncConnection

from langgraph_fence.database import Dialect

__all__ = [
    "PRUNE_STRATEGIES",
    "collect_blobs",
    "copy_rows",
    "delete_runs",
    "delete_threads",
    "keep_latest",
    "prune_plan",
]

_TABLES = ("fence_checkpoint_writes", "fence_checkpoints", "fence_checkpoint_blobs")
PRUNE_STRATEGIES = ("keep_latest", "delete")
_DELTA_KEYS = ("counters_since_delta_snapshot", "delta_writes_versioned")

_COPY_THREAD = (
    "INSERT INTO fence_checkpoints (tenant_id, thread_id, checkpoint_ns, checkpoint_id,"
    " parent_checkpoint_id, type, checkpoint, channel_versions, metadata, run_id,"
    " fence_token) SELECT tenant_id, :dst, checkpoint_ns, checkpoint_id,"
    " parent_checkpoint_id, type, checkpoint, channel_versions, metadata, run_id, NULL"
    " FROM fence_checkpoints WHERE tenant_id = :tenant AND thread_id = :src"
    " ON CONFLICT DO NOTHING",
    "INSERT INTO fence_checkpoint_blobs (tenant_id, thread_id, checkpoint_ns, channel,"
    " version, type, blob) SELECT tenant_id, :dst, checkpoint_ns, channel, version, type,"
    " blob FROM fence_checkpoint_blobs WHERE tenant_id = :tenant AND thread_id = :src"
    " ON CONFLICT DO NOTHING",
    "INSERT INTO fence_checkpoint_writes (tenant_id, thread_id, checkpoint_ns,"
    " checkpoint_id, task_id, idx, channel, type, blob, task_path, fence_token)"
    " SELECT tenant_id, :dst, checkpoint_ns, checkpoint_id, task_id, idx, channel, type,"
    " blob, task_path, NULL FROM fence_checkpoint_writes"
    " WHERE tenant_id = :tenant AND thread_id = :src ON CONFLICT DO NOTHING",
)


def prune_plan(
    heads: Mapping[str, tuple[str, str | None]], saved_roots: set[str]
) -> tuple[dict[str, str], set[str]]:
    """What ``keep_latest`` keeps: ``({namespace: head kept}, {namespaces dropped whole})``.

    ``heads`` maps each namespace to its latest checkpoint and the root checkpoint that
    checkpoint's run started from (``metadata["parents"][""]``). A subgraph *call*'s
    namespace (it has a task id after a ``:``) goes with the root checkpoint it started
    from: dropped whole once that root is saved and is not the root kept. A
    ``checkpointer=True`` subgraph's namespace (no ``:``) outlives each call and keeps its
    latest, like the root.
    """
    root_head = heads.get("", (None, None))[0]
    dropped = {
        ns
        for ns, (_, root) in heads.items()
        if ":" in ns and root is not None and root in saved_roots and root != root_head
    }
    kept = {ns: head for ns, (head, _) in heads.items() if ns not in dropped}
    return kept, dropped


async def collect_blobs(
    conn: AsyncConnection, dialect: Dialect, tenant_id: str, thread_id: str
) -> None:
    """Delete the thread's blobs that no checkpoint of it references any more."""
    each = "jsonb_each_text" if dialect == "postgresql" else "json_each"
    await conn.execute(
        text(
            "DELETE FROM fence_checkpoint_blobs WHERE tenant_id = :tenant AND thread_id = :t"
            f" AND NOT EXISTS (SELECT 1 FROM fence_checkpoints c, {each}"
            "(c.channel_versions) v WHERE c.tenant_id = fence_checkpoint_blobs.tenant_id"
            " AND c.thread_id = fence_checkpoint_blobs.thread_id"
            " AND c.checkpoint_ns = fence_checkpoint_blobs.checkpoint_ns"
            " AND v.key = fence_checkpoint_blobs.channel"
            " AND v.value = fence_checkpoint_blobs.version)"
        ),
        {"tenant": tenant_id, "t": thread_id},
    )


async def delete_threads(conn: AsyncConnection, tenant_id: str, thread_ids: Sequence[str]) -> None:
    """Delete every checkpoint, blob and write of the tenant's threads."""
    for thread_id in thread_ids:
        for table in _TABLES:
            await conn.execute(
                text(f"DELETE FROM {table} WHERE tenant_id = :tenant AND thread_id = :t"),
                {"tenant": tenant_id, "t": thread_id},
            )


async def delete_runs(
    conn: AsyncConnection, dialect: Dialect, tenant_id: str, run_ids: Sequence[str]
) -> None:
    """Delete the tenant's checkpoints of ``run_ids``, their writes, and the blobs no
    remaining checkpoint references."""
    in_runs = "run_id IN (" + ", ".join(f":r{i}" for i in range(len(run_ids))) + ")"
    params: dict[str, str] = {f"r{i}": r for i, r in enumerate(run_ids)}
    params["tenant"] = tenant_id
    threads = (
        await conn.execute(
            text(
                "SELECT DISTINCT thread_id FROM fence_checkpoints"
                f" WHERE tenant_id = :tenant AND {in_runs}"
            ),
            params,
        )
    ).scalars()
    affected = list(threads)
    await conn.execute(
        text(
            "DELETE FROM fence_checkpoint_writes WHERE tenant_id = :tenant AND EXISTS"
            " (SELECT 1 FROM fence_checkpoints c"
            " WHERE c.tenant_id = fence_checkpoint_writes.tenant_id"
            " AND c.thread_id = fence_checkpoint_writes.thread_id"
            " AND c.checkpoint_ns = fence_checkpoint_writes.checkpoint_ns"
            " AND c.checkpoint_id = fence_checkpoint_writes.checkpoint_id"
            f" AND c.{in_runs})"
        ),
        params,
    )
    await conn.execute(
        text(f"DELETE FROM fence_checkpoints WHERE tenant_id = :tenant AND {in_runs}"),
        params,
    )
    for thread_id in affected:
        await collect_blobs(conn, dialect, tenant_id, thread_id)


async def copy_rows(conn: AsyncConnection, tenant_id: str, source: str, target: str) -> None:
    """Copy every checkpoint, blob and write of one of the tenant's threads to another; the
    copies carry no ``fence_token``."""
    params = {"tenant": tenant_id, "src": source, "dst": target}
    for statement in _COPY_THREAD:
        await conn.execute(text(statement), params)


async def keep_latest(
    conn: AsyncConnection, dialect: Dialect, tenant_id: str, thread_id: str
) -> None:
    """Prune one thread to its latest checkpoint per namespace (see :func:`prune_plan`);
    checkpoints saved meanwhile (newer ids) are kept.

    Raises:
        NotImplementedError: the thread uses a ``DeltaChannel`` (its history lives in the
            checkpoints it would drop).
    """
    rows = (
        await conn.execute(
            text(
                "SELECT c.checkpoint_ns, c.checkpoint_id, c.metadata FROM fence_checkpoints c"
                " JOIN (SELECT checkpoint_ns, max(checkpoint_id) AS head"
                " FROM fence_checkpoints WHERE tenant_id = :tenant AND thread_id = :t"
                " GROUP BY checkpoint_ns) h"
                " ON c.checkpoint_ns = h.checkpoint_ns AND c.checkpoint_id = h.head"
                " WHERE c.tenant_id = :tenant AND c.thread_id = :t"
            ),
            {"tenant": tenant_id, "t": thread_id},
        )
    ).all()
    if not rows:
        return
    heads: dict[str, tuple[str, str | None]] = {}
    for ns, head, raw_meta in rows:
        meta = json.loads(raw_meta) if isinstance(raw_meta, str) else raw_meta
        if any(key in meta for key in _DELTA_KEYS):
            raise NotImplementedError(
                f"keep_latest can't prune threads that use a DeltaChannel: {thread_id}"
            )
        root = (meta.get("parents") or {}).get("")
        heads[ns] = (head, None if root is None else str(root))
    roots = {root for _, root in heads.values() if root is not None}
    saved: set[str] = set()
    if roots:
        names = [f":r{i}" for i in range(len(roots))]
        found = await conn.execute(
            text(
                "SELECT checkpoint_id FROM fence_checkpoints WHERE tenant_id = :tenant"
                " AND thread_id = :t AND checkpoint_ns = ''"
                f" AND checkpoint_id IN ({', '.join(names)})"
            ),
            {
                "tenant": tenant_id,
                "t": thread_id,
                **{n[1:]: r for n, r in zip(names, sorted(roots), strict=True)},
            },
        )
        saved = set(found.scalars())
    kept, dropped = prune_plan(heads, saved)
    where = "tenant_id = :tenant AND thread_id = :t AND checkpoint_ns = :ns"
    for ns in dropped:
        for table in _TABLES:
            await conn.execute(
                text(f"DELETE FROM {table} WHERE {where}"),
                {"tenant": tenant_id, "t": thread_id, "ns": ns},
            )
    for ns, head in kept.items():
        params = {"tenant": tenant_id, "t": thread_id, "ns": ns, "head": head}
        # Older ids only: what a run saves meanwhile has a newer id and stays.
        for table in ("fence_checkpoint_writes", "fence_checkpoints"):
            await conn.execute(
                text(f"DELETE FROM {table} WHERE {where} AND checkpoint_id < :head"),
                params,
            )
        await conn.execute(
            text(
                "UPDATE fence_checkpoints SET parent_checkpoint_id = NULL"
                f" WHERE {where} AND checkpoint_id = :head"
            ),
            params,
        )
    await collect_blobs(conn, dialect, tenant_id, thread_id)

"""The listings: ``executions``, ``dead-letters`` and ``runs``, as tables or JSON."""

from __future__ import annotations

import argparse
import sys
import time
from collections.abc import Iterable, Sequence
from typing import Any

from langgraph_fence.cli._common import checked_target, expires, printable, run_status, utc


async def executions(args: argparse.Namespace, status: str | None) -> int:
    import json

    from sqlalchemy import select

    from langgraph_fence.database import create_engine, read_only
    from langgraph_fence.lease.schema import LEASES, effects_from_json
    from langgraph_fence.lease.sql import SqlLeaseRepository

    if args.tenant is not None and not args.tenant:
        raise ValueError("--tenant must be a non-empty tenant id (or left out for every tenant)")
    checked_target(args, must_exist=True)
    engine = create_engine(args.db, schema=args.schema)
    try:
        query: Any = select(LEASES).order_by(LEASES.c.updated_at.desc()).limit(args.limit)
        if status is not None:
            query = query.where(LEASES.c.status == status)
        if args.tenant is not None:
            query = query.where(LEASES.c.tenant_id == args.tenant)
        async with read_only(engine).connect() as conn:
            rows = (await conn.execute(query)).all()
        # The clock every expiry was written in: the database's (PostgreSQL), or this
        # machine's for SQLite, as the lease store reads it.
        now = await SqlLeaseRepository(engine).now()
    finally:
        await engine.dispose()
    listed = [
        {
            "scope_key": row.scope_key,
            "tenant_id": row.tenant_id,
            "execution_id": row.execution_id,
            "status": row.status,
            "holder": row.holder,
            "epoch": row.epoch,
            "expires_at": row.expires_at,
            "expires_in": None if row.expires_at is None else round(row.expires_at - now, 1),
            "pending_effects": [
                {"effect": e.effect.value, "node": e.node, "key": e.key, "token": e.token}
                for e in effects_from_json(row.pending_effects)
            ],
            "reason": row.reason,
            "takeovers": row.takeovers,
            "parent": _parent_scope_key(row.execution_id),
        }
        for row in rows
    ]
    listed = as_tree(listed)
    if args.json:
        plain = [{k: v for k, v in entry.items() if k != "depth"} for entry in listed]
        sys.stdout.write(json.dumps(plain, indent=2) + "\n")
        return 0
    _print_executions(args, status, listed, now)
    return 0


def _parent_scope_key(execution_id: str) -> str | None:
    """The scope key of the parent of a child execution (``None``: not a child)."""
    from langgraph_fence.execution.children import parse_child_execution_id

    parsed = parse_child_execution_id(execution_id)
    return None if parsed is None else parsed[0].scope_key


def as_tree(listed: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """``listed`` (in its order) with each child moved under its parent when the parent is
    listed too, a ``depth`` added (0 for a root, or a child whose parent is not listed)."""
    keys = {entry["scope_key"] for entry in listed}
    under: dict[str, list[dict[str, Any]]] = {}
    roots = []
    for entry in listed:
        parent = entry.get("parent")
        if isinstance(parent, str) and parent in keys and parent != entry["scope_key"]:
            under.setdefault(parent, []).append(entry)
        else:
            roots.append(entry)
    ordered: list[dict[str, Any]] = []

    def place(entry: dict[str, Any], depth: int) -> None:
        ordered.append({**entry, "depth": depth} if depth else entry)
        for child in under.pop(entry["scope_key"], []):
            place(child, depth + 1)

    for entry in roots:
        place(entry, 0)
    for rest in under.values():  # a cycle cannot be (ids nest), but lose nothing
        ordered.extend(rest)
    return ordered


async def runs(args: argparse.Namespace) -> int:
    import json

    from langgraph_fence.database import create_engine, read_only
    from langgraph_fence.queue import list_runs, served_graphs

    if args.tenant is not None and not args.tenant:
        raise ValueError("--tenant must be a non-empty tenant id (or left out for every tenant)")
    checked_target(args, must_exist=True)
    engine = create_engine(args.db, schema=args.schema)
    try:
        reader = read_only(engine)
        found = await list_runs(reader, args.limit, tenant_id=args.tenant)
        served = await served_graphs(reader)
    finally:
        await engine.dispose()
    now = time.time()
    listed: list[dict[str, Any]] = [
        {
            "scope_key": r.key.scope_key,
            "tenant_id": r.key.tenant_id,
            "execution_id": r.key.execution_id,
            "graph": r.graph,
            "thread_id": r.thread_id,
            "status": run_status(r, now),
            "holder": r.holder,
            "epoch": r.epoch,
            "submitted": r.submitted,
            "run_id": r.run_id,
            "not_before": utc(r.not_before),
            "served_by": served.get(r.graph or "", []),
            "unserved": r.holder is None and not served.get(r.graph or ""),
        }
        for r in found
    ]
    if args.json:
        sys.stdout.write(json.dumps(listed, indent=2) + "\n")
        return 0
    rows = []
    for entry in listed:
        serving = "UNSERVED" if entry["unserved"] else ", ".join(entry["served_by"])
        status = entry["status"]
        if status == "scheduled":
            status += f" for {entry['not_before']}"
        cells = (
            entry["scope_key"],
            entry["graph"] or "",
            entry["thread_id"] or "",
            status,
            entry["holder"] or "",
            str(entry["epoch"]),
            serving,
        )
        rows.append([printable(cell) for cell in cells])
    _print_table(
        args,
        "pending and running executions, and the runs queued behind them",
        ("graph", "thread", "status", "worker", "token", "served by"),
        rows,
    )
    return 0


def _print_executions(
    args: argparse.Namespace, status: str | None, listed: list[dict[str, Any]], now: float
) -> None:
    rows = []
    for entry in listed:
        pending = "\n".join(
            printable(f"{e['effect']} @ {e['node']} (token {e['token']})")
            for e in entry["pending_effects"]
        )
        cells = (
            "  " * entry.get("depth", 0)
            + ("└ " if entry.get("depth") else "")
            + printable(entry["scope_key"]),
            printable(entry["status"]),
            printable(entry["holder"] or ""),
            str(entry["epoch"]),
            expires(entry["expires_at"], now),
            pending,
            printable(entry["reason"] or ""),
        )
        rows.append(cells)
    title = "dead-lettered executions" if status == "dead_lettered" else "executions"
    columns = ("status", "holder", "token", "expires", "pending effects", "reason")
    _print_table(args, title, columns, rows)


def _print_table(
    args: argparse.Namespace, title: str, columns: Sequence[str], rows: Iterable[Sequence[str]]
) -> None:
    """Print ``rows`` as a table titled ``title`` (of the tenant ``--tenant`` names), each
    a scope key (in full: the KEY that ``resolve`` takes) and its ``columns``."""
    from rich.console import Console
    from rich.table import Table
    from rich.text import Text

    if args.tenant is not None:
        title += f" of tenant {args.tenant}"
    table = Table(title=printable(title))
    table.add_column("scope key", overflow="fold")
    for column in columns:
        table.add_column(column, overflow="fold")
    for cells in rows:
        # Text, not markup: a stored reason or id is data ("[/b]" in a reason must not
        # break the listing or restyle it), and printable: no escape sequence of a tenant's
        # reaches the terminal.
        table.add_row(*(Text(cell) for cell in cells))
    Console().print(table)

"""The ``langgraph-fence`` command: demo, worker, migrate, executions, dead-letters, resolve,
erase.

The only module that prints; it prints through rich.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import sys
from collections.abc import Sequence
from typing import Any

from rich.console import Console
from rich.table import Table
from rich.text import Text
from sqlalchemy.exc import SQLAlchemyError

from .lease import DEFAULT_MAX_TAKEOVERS
from .redact import failure_reason, mask_password

__all__ = ["main"]

DB_HELP = "database URL: sqlite+aiosqlite:///path.db or postgresql+asyncpg://user@host/db"


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="langgraph-fence",
        description="Fencing tokens for LangGraph: stale workers never land a write.",
    )
    parser.add_argument("-v", "--verbose", action="store_true", help="log the library's events")
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    demo = commands.add_parser(
        "demo", help="two instances, a stall past the lease, the stale writes refused"
    )
    demo.add_argument("--db", default=None, help=DB_HELP + " (default: a temporary SQLite file)")
    demo.add_argument("--schema", default=None, help="PostgreSQL schema (search_path) to use")
    worker = commands.add_parser(
        "worker", help="serve: take over expired executions and run them (until SIGTERM)"
    )
    worker.add_argument("--db", required=True, help=DB_HELP)
    worker.add_argument(
        "--graphs",
        required=True,
        metavar="MODULE:FUNCTION",
        help="a function taking the Instance and returning {graph name: compiled graph}",
    )
    worker.add_argument("--concurrency", type=int, default=4)
    worker.add_argument("--poll-interval", type=float, default=1.0)
    worker.add_argument("--lease-ttl", type=float, default=30.0)
    worker.add_argument("--instance-id", default=None)
    worker.add_argument(
        "--max-takeovers",
        type=int,
        default=DEFAULT_MAX_TAKEOVERS,
        help="the takeover budget: an execution taken over more than this many times in a "
        "row from workers that died with no new checkpoint is dead-lettered "
        f"('crashed N workers'); default {DEFAULT_MAX_TAKEOVERS}",
    )
    worker.add_argument("--schema", default=None, help="PostgreSQL schema (search_path) to use")
    migrate = commands.add_parser("migrate", help="create or upgrade every table on a database")
    migrate.add_argument("--db", required=True, help=DB_HELP)
    erase = commands.add_parser(
        "erase",
        help="erase one tenant's thread: every row of it (refused while a run holds it)",
        description=(
            "Erase a tenant's thread under its execution's lease (refused, naming the holder, "
            "while another instance runs it): its checkpoints, blobs and writes, the "
            "execution's record (the run's input), the thread's binding, the lease's reason "
            "and stamps, and the exactly-once sink's stored results. What stays, holding no "
            "data of the run: the lease row (done, no reason: its token must never go back) "
            "and the sink's high-water mark row (the scope key and a token). Exit status 3 "
            "when refused."
        ),
    )
    erase.add_argument("--db", required=True, help=DB_HELP)
    erase.add_argument("--tenant", required=True, help="the thread's tenant")
    erase.add_argument("--thread", required=True, help="the thread id to erase")
    erase.add_argument(
        "--sink-db",
        default=None,
        help="database of the exactly-once sink's tables, when not --db (its results go too)",
    )
    erase.add_argument("--schema", default=None, help="PostgreSQL schema (search_path)")
    executions = commands.add_parser("executions", help="list executions and their leases")
    executions.add_argument("--status", default=None, help="only this status")
    dead = commands.add_parser("dead-letters", help="list dead-lettered executions and why")
    for listing in (executions, dead):
        listing.add_argument("--db", required=True, help=DB_HELP)
        listing.add_argument(
            "--tenant", default=None, help="only this tenant's executions (their reasons too)"
        )
        listing.add_argument("--limit", type=int, default=50)
        listing.add_argument("--schema", default=None, help="PostgreSQL schema (search_path)")
    resolve = commands.add_parser(
        "resolve",
        help="act on one dead-lettered execution (--retry: run it again)",
        description="Act on one dead-lettered execution, named by tenant and execution id. "
        "--retry makes it pending again with its takeover budget reset: any worker serving "
        "its graph takes it at its next poll and resumes it from its last checkpoint (fix "
        "the step that killed its workers first). Refused while a non-idempotent write "
        "stamped before it was dead-lettered stands: that write may have happened, and a "
        "retry would repeat it.",
    )
    resolve.add_argument("--db", required=True, help=DB_HELP)
    resolve.add_argument("--tenant", required=True, help="the execution's tenant id")
    resolve.add_argument(
        "--execution", required=True, help="the execution id (the thread id unless set)"
    )
    resolve.add_argument("--schema", default=None, help="PostgreSQL schema (search_path)")
    action = resolve.add_mutually_exclusive_group(required=True)
    action.add_argument(
        "--retry",
        action="store_true",
        help="make it pending again, its takeover budget reset",
    )
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the ``langgraph-fence`` console script; returns the exit code."""
    from .errors import ExecutionLeaseHeldError

    args = _parser().parse_args(argv)
    logging.basicConfig(level=logging.INFO if args.verbose else logging.ERROR)
    console = Console()
    try:
        if args.command == "demo":
            return asyncio.run(_demo(console, args.db, args.schema))
        if args.command == "worker":
            return asyncio.run(_worker(console, args))
        if args.command == "migrate":
            return asyncio.run(_migrate(console, args.db))
        if args.command == "erase":
            return asyncio.run(_erase(console, args))
        if args.command in ("executions", "dead-letters"):
            status = "dead_lettered" if args.command == "dead-letters" else args.status
            return asyncio.run(_executions(console, args, status))
        if args.command == "resolve":
            return asyncio.run(_resolve(console, args))
    except ValueError as exc:
        console.print(f"[red]error:[/red] {mask_password(str(exc))}", markup=False, highlight=False)
        return 2
    except ExecutionLeaseHeldError as exc:
        console.print(f"refused: {exc}", markup=False, highlight=False)
        return 3
    except (SQLAlchemyError, OSError) as exc:
        # A database that cannot be reached or read: say so, without the driver's quoted
        # statement and parameters, and without the URL's password.
        console.print(f"error: {failure_reason(exc)}", markup=False, highlight=False)
        return 1
    raise AssertionError(f"unknown command {args.command!r}")


async def _demo(console: Console, db: str | None, schema: str | None) -> int:
    from .database import normalize_url
    from .demo import run_demo

    if db is not None:
        normalize_url(db)
    console.print("[bold]langgraph-fence demo[/bold]: one order, two instances, one stall\n")
    result = await run_demo(db, schema=schema)
    table = Table(title=f"timeline of execution {result.execution} on {result.db}")
    table.add_column("t (s)", justify="right")
    table.add_column("worker")
    table.add_column("token", justify="right")
    table.add_column("event")
    for event in result.events:
        style = "red" if event.outcome == "refused" else None
        token = "" if event.token is None else str(event.token)
        table.add_row(f"{event.at:.2f}", event.worker, token, event.what, style=style)
    console.print(table)
    refused = sum(1 for e in result.events if e.outcome == "refused")
    console.print(f"\nrefused stale writes and steps: [bold]{refused}[/bold]")
    console.print(f"payments for the order: {result.payments}  (order, cents, token)")
    console.print(f"final state log: {result.final_state.get('log')}")
    if result.ok:
        console.print("[green]OK[/green]: charged once, by the holder of token 2; A was fenced")
        return 0
    for problem in result.problems:
        console.print(f"[red]PROBLEM[/red]: {problem}")
    return 1


def _load_graphs_factory(spec: str) -> Any:
    import importlib

    module_name, _, attribute = spec.partition(":")
    if not module_name or not attribute:
        raise ValueError(f"--graphs must be MODULE:FUNCTION, got {spec!r}")
    try:
        module = importlib.import_module(module_name)
    except ImportError as exc:
        raise ValueError(f"--graphs: cannot import {module_name!r}: {exc}") from exc
    factory = getattr(module, attribute, None)
    if not callable(factory):
        raise ValueError(f"--graphs: {spec!r} is not a function of the module")
    return factory


async def _worker(console: Console, args: argparse.Namespace) -> int:
    from .database import schema_options
    from .instance import Instance

    factory = _load_graphs_factory(args.graphs)
    async with Instance.open(
        args.db,
        engine_options=schema_options(args.schema),
        instance_id=args.instance_id,
        lease_ttl=args.lease_ttl,
        max_takeovers=args.max_takeovers,
    ) as instance:
        graphs = factory(instance)
        console.print(f"worker {instance.instance_id} serves {sorted(graphs)}")
        await instance.serve(graphs, concurrency=args.concurrency, poll_interval=args.poll_interval)
    console.print(f"worker {instance.instance_id} stopped")
    return 0


async def _migrate(console: Console, db: str) -> int:
    from checkpointers import SqlCheckpointer, SqlStore

    from .database import create_engine
    from .executions import SqlExecutionRecords
    from .sinks import setup_sink
    from .stores.sql import SqlLeaseRepository

    engine = create_engine(db)
    try:
        await SqlLeaseRepository(engine).setup()
        await SqlCheckpointer(engine).setup()
        await SqlExecutionRecords(engine).setup()
        await setup_sink(engine)
        await SqlStore(engine).setup()
    finally:
        await engine.dispose()
    console.print("migrated: leases, checkpoints, execution records, sink, store")
    return 0


async def _erase(console: Console, args: argparse.Namespace) -> int:
    from .admin import ThreadAdmin
    from .database import create_engine, schema_options
    from .instance import Instance

    if not args.tenant:
        raise ValueError("--tenant must be the thread's tenant id (non-empty)")
    if not args.thread:
        raise ValueError("--thread must be the id of the thread to erase (non-empty)")
    options = schema_options(args.schema)
    sink = None if args.sink_db is None else create_engine(args.sink_db)
    try:
        async with Instance.open(args.db, engine_options=options) as instance:
            checkpointer = instance.checkpointer
            if sink is not None and checkpointer.admin is not None:
                admin = checkpointer.admin
                checkpointer.admin = ThreadAdmin(
                    admin.repository, admin.records, holder=admin.holder, sink_engine=sink
                )
            await checkpointer.adelete_thread(args.thread, tenant_id=args.tenant)
    finally:
        if sink is not None:
            await sink.dispose()
    console.print(
        f"erased thread {args.thread!r} of tenant {args.tenant!r}: checkpoints, record, "
        "binding, lease reason, sink results (kept: the lease's token, the sink's "
        "high-water mark)",
        markup=False,
        highlight=False,
    )
    return 0


async def _executions(console: Console, args: argparse.Namespace, status: str | None) -> int:
    from sqlalchemy import select

    from .database import create_engine, schema_options
    from .schema import LEASES, effects_from_json

    if args.limit < 1:
        raise ValueError(f"--limit must be >= 1, got {args.limit}")
    if args.tenant is not None and not args.tenant:
        raise ValueError("--tenant must be a non-empty tenant id (or left out for every tenant)")
    engine = create_engine(args.db, **schema_options(args.schema))
    try:
        query: Any = select(LEASES).order_by(LEASES.c.updated_at.desc()).limit(args.limit)
        if status is not None:
            query = query.where(LEASES.c.status == status)
        if args.tenant is not None:
            query = query.where(LEASES.c.tenant_id == args.tenant)
        async with engine.connect() as conn:
            rows = (await conn.execute(query)).all()
    finally:
        await engine.dispose()
    title = "dead-lettered executions" if status == "dead_lettered" else "executions"
    if args.tenant is not None:
        title += f" of tenant {args.tenant}"
    table = Table(title=title)
    columns = ("tenant", "execution", "scope key", "status", "token", "holder", "pending effects")
    for column in (*columns, "reason"):
        table.add_column(column)
    for row in rows:
        pending = "\n".join(
            f"{e.effect.value} @ {e.node} (token {e.token})"
            for e in effects_from_json(row.pending_effects)
        )
        cells = (
            row.tenant_id,
            row.execution_id,
            row.scope_key,
            row.status,
            str(row.epoch),
            row.holder or "",
            pending,
        )
        # Text, not markup: a stored reason or id is data ("[/b]" in a reason must not
        # break the listing or restyle it).
        table.add_row(*(Text(cell) for cell in (*cells, row.reason or "")))
    console.print(table)
    return 0


async def _resolve(console: Console, args: argparse.Namespace) -> int:
    from .database import create_engine, schema_options
    from .lease import LeaseKey
    from .stores.sql import SqlLeaseRepository

    key = LeaseKey(args.tenant, args.execution)
    engine = create_engine(args.db, **schema_options(args.schema))
    try:
        repo = SqlLeaseRepository(engine)
        await repo.setup()  # the budget's columns (lease migration 4) on an older database
        try:
            lease = await repo.retry(key)
        except KeyError:
            raise ValueError(
                f"no execution {key.execution_id!r} of tenant {key.tenant_id!r}: see "
                "`langgraph-fence dead-letters --tenant ...`"
            ) from None
    finally:
        await engine.dispose()
    console.print(
        Text(
            f"execution {lease.scope_key} is pending again at token {lease.epoch}, its "
            "takeover budget reset: a worker serving its graph takes it at its next poll"
        )
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""The commands that act: ``demo``, ``worker``, ``migrate``, ``erase``, ``submit`` and
``resolve``."""

from __future__ import annotations

import argparse
import os
import sys
import time
from datetime import datetime
from typing import TYPE_CHECKING, Any

from langgraph_fence.lease import LeaseKey

if TYPE_CHECKING:
    import asyncio
    from collections.abc import Callable

    from rich.console import Console

    from langgraph_fence.database.diagnosis import Target
    from langgraph_fence.queue import RunState
from langgraph_fence.cli._common import (
    WORKER_MAX_BACKOFF,
    as_json,
    checked_target,
    iso_time,
    json_option,
    printable,
    run_status,
    stderr,
    utc,
)


async def demo(console: Console, db: str | None, schema: str | None) -> int:
    from rich.table import Table
    from rich.text import Text

    from langgraph_fence.cli.demo import run_demo
    from langgraph_fence.database import normalize_url

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
    refused = sum(1 for e in result.events if e.what.startswith("charge refused"))
    console.print(f"\nstale writes refused: [bold]{refused}[/bold]")
    console.print(f"payments for the order: {result.payments}  (order, cents, token)")
    console.print(f"final state log: {result.final_state.get('log')}")
    where = f", schema {result.schema}" if result.schema else ""
    password = " (its password left out: give it in PGPASSWORD)" if result.password_left_out else ""
    kept = Text(f"the database is kept ({result.db}{where}); inspect it with{password}:")
    if result.ok:
        console.print("[green]OK[/green]: charged once, by the holder of token 2; A was fenced")
    else:
        for problem in result.problems:
            console.print(f"[red]PROBLEM[/red]: {problem}")
    console.print(kept)
    # On a line of its own and never wrapped, whatever the terminal's width: it is copied.
    console.print(Text(result.inspect_command), soft_wrap=True)
    return 0 if result.ok else 1


def _load_graphs_factory(spec: str) -> Any:
    import importlib

    module_name, _, attribute = spec.partition(":")
    if not module_name or not attribute:
        raise ValueError(f"--graphs must be MODULE:FUNCTION, got {spec!r}")
    # As `uvicorn app:app` does: a module in the folder the worker was started from imports
    # (the console script's sys.path starts with its own bin folder, not the current one).
    here = os.getcwd()
    if here not in sys.path:
        sys.path.insert(0, here)
    try:
        module = importlib.import_module(module_name)
    except ModuleNotFoundError as exc:
        if exc.name is None or not module_name.startswith(exc.name):
            raise ValueError(f"--graphs: importing {module_name!r} failed: {exc}") from exc
        raise ValueError(
            f"--graphs: no module {exc.name!r} in the current folder ({here}) or on sys.path: "
            "start the worker in the folder that holds it, or fix MODULE"
        ) from exc
    except ImportError as exc:
        raise ValueError(f"--graphs: importing {module_name!r} failed: {exc}") from exc
    factory = getattr(module, attribute, None)
    if not callable(factory):
        raise ValueError(f"--graphs: {spec!r} is not a function of the module")
    return factory


async def worker(args: argparse.Namespace) -> int:
    import asyncio

    from langgraph_fence.execution.serve import on_signals

    target = checked_target(args, must_exist=False)
    factory = _load_graphs_factory(args.graphs)
    # SIGTERM / SIGINT stop the worker gracefully from here on: a signal that comes right
    # after the banner below (or while the database is out of reach) drains and exits 0,
    # never kills it before serve() would have installed its handlers.
    stop = asyncio.Event()
    remove_signals = on_signals(stop)
    try:
        return await _work(args, target, factory, stop)
    finally:
        remove_signals()


async def _work(
    args: argparse.Namespace, target: Target, factory: Callable[[Any], Any], stop: asyncio.Event
) -> int:
    """Serve until ``stop``; a database out of reach at the start is waited for."""
    import asyncio
    import contextlib

    from rich.console import Console

    from langgraph_fence.database.retry import is_database_connection_error
    from langgraph_fence.instance import Instance
    from langgraph_fence.redact import failure_reason

    failures = 0
    while not stop.is_set():
        serving = False
        try:
            async with Instance.open(
                args.db,
                schema=args.schema,
                instance_id=args.instance_id,
                lease_ttl=args.lease_ttl,
                max_takeovers=args.max_takeovers,
                max_held=args.max_held,
            ) as instance:
                graphs = factory(instance)
                schema = f" (schema {args.schema})" if args.schema else ""
                Console().print(
                    f"worker {instance.instance_id} serves {sorted(graphs)} on "
                    f"{target.masked}{schema}: concurrency {args.concurrency}, polls every "
                    f"{args.poll_interval} s, lease TTL {args.lease_ttl} s, holds at most "
                    f"{instance.max_held}, at most {args.max_takeovers} takeovers without progress",
                    markup=False,
                    highlight=False,
                    soft_wrap=True,
                )
                serving = True
                metrics = _metrics_endpoint(args, instance, stop)
                await instance.serve(
                    graphs,
                    concurrency=args.concurrency,
                    poll_interval=args.poll_interval,
                    stop=stop,
                    handle_signals=False,
                )
                if metrics is not None:
                    await metrics
        except Exception as exc:
            # A database out of reach at the start (serve() itself rides out outages): wait
            # for it, as a worker started with its database mid-restart must.
            if serving or not is_database_connection_error(exc):
                raise
            failures += 1
            pause = min(WORKER_MAX_BACKOFF, 0.5 * float(1 << min(failures, 16)))
            stderr().print(
                f"worker: the database cannot be reached ({failure_reason(exc)}); "
                f"trying again in {pause:.1f}s",
                markup=False,
                highlight=False,
            )
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(stop.wait(), pause)
            continue
        Console().print(f"worker {instance.instance_id} stopped", markup=False, highlight=False)
        return 0
    return 0


async def migrate(args: argparse.Namespace) -> int:
    from rich.console import Console

    from langgraph_fence.checkpointers import SqlCheckpointer, SqlStore
    from langgraph_fence.database import create_engine
    from langgraph_fence.lease.records import SqlExecutionRecords
    from langgraph_fence.lease.sql import SqlLeaseRepository
    from langgraph_fence.sinks import setup_sink

    checked_target(args, must_exist=False)
    engine = create_engine(args.db, schema=args.schema)
    try:
        await SqlLeaseRepository(engine).setup()
        await SqlCheckpointer(engine).setup()
        await SqlExecutionRecords(engine).setup()
        await setup_sink(engine)
        await SqlStore(engine).setup()
    finally:
        await engine.dispose()
    Console().print("migrated: leases, checkpoints, execution records, sink, store")
    return 0


async def erase(args: argparse.Namespace) -> int:
    from rich.console import Console
    from rich.table import Table

    from langgraph_fence.database import create_engine, schema_options
    from langgraph_fence.instance import Instance
    from langgraph_fence.saver.admin import ThreadAdmin, count_erasable

    if not args.tenant:
        raise ValueError("--tenant must be the thread's tenant id (non-empty)")
    if not args.thread:
        raise ValueError("--thread must be the id of the thread to erase (non-empty)")
    checked_target(args, must_exist=True)
    options = schema_options(args.schema)
    sink = None if args.sink_db is None else create_engine(args.sink_db)
    try:
        async with Instance.open(args.db, engine_options=options) as instance:
            checkpointer = instance.checkpointer
            admin = checkpointer.admin
            assert admin is not None  # an instance's checkpointer erases under its leases
            if sink is not None:
                admin = ThreadAdmin(
                    admin.repository,
                    admin.records,
                    holder=admin.holder,
                    sink_engine=sink,
                    store=admin.store,
                )
                checkpointer.admin = admin
            engine = instance.repository.engine  # type: ignore[attr-defined]
            # Looked for before anything binds the thread (the tree's lookup would).
            plain = LeaseKey(args.tenant, args.thread)
            known = await instance.repository.get(plain) is not None
            if not known and not any(
                (await count_erasable(engine, args.tenant, [(plain, args.thread)])).values()
            ):
                Console(stderr=True).print(
                    f"nothing erased: tenant {printable(args.tenant)!r} has no thread "
                    f"{printable(args.thread)!r} on this database (check --tenant, --thread "
                    "and --schema; `langgraph-fence executions --tenant T` lists its threads)",
                    markup=False,
                    highlight=False,
                )
                return 1
            tree = await admin.tree(args.tenant, args.thread)
            before = await count_erasable(engine, args.tenant, tree)
            await checkpointer.adelete_thread(args.thread, tenant_id=args.tenant)
            after = await count_erasable(engine, args.tenant, tree)
    finally:
        if sink is not None:
            await sink.dispose()
    table = Table(
        title=f"erased thread {printable(args.thread)!r} of tenant {printable(args.tenant)!r}"
        + (f" and {len(tree) - 1} child execution(s)" if len(tree) > 1 else ""),
        title_justify="left",
    )
    table.add_column("table")
    table.add_column("rows", justify="right")
    for name, count in before.items():
        table.add_row(name, str(count - after[name]))
    console = Console()
    console.print(table)
    console.print(
        "also erased: the lease's reason and stamps, the sink's results (with --sink-db); "
        "kept: each lease's token, the sink's high-water mark",
        markup=False,
        highlight=False,
    )
    return 0


def run_request(args: argparse.Namespace) -> tuple[Any, dict[str, Any], dict[str, Any]]:
    """The input, run config and options of a run the command line describes (``submit``,
    ``schedules create``): ``--input``, ``--config`` with ``--configurable`` and
    ``--thread``, and ``--context``."""
    payload = json_option("--input", args.input, "'{\"n\": 1}'")
    options: dict[str, Any] = {}
    if args.context is not None:
        options["context"] = json_option("--context", args.context, '\'{"currency": "EUR"}\'')
    return payload, _submit_config(args), options


def _submit_config(args: argparse.Namespace) -> dict[str, Any]:
    """The run config ``submit`` was given: ``--config``, each ``--configurable KEY=VALUE``
    over its ``configurable``, and ``--thread`` as the thread id."""
    config: Any = {}
    if args.config is not None:
        config = json_option("--config", args.config, '\'{"configurable": {"user_id": "u-7"}}\'')
        if not isinstance(config, dict):
            raise ValueError(
                f"--config must be a JSON object (the run config), got {args.config!r}: e.g. "
                '\'{"configurable": {"user_id": "u-7"}, "tags": ["cli"]}\''
            )
    configurable = config.get("configurable", {})
    if not isinstance(configurable, dict):
        raise ValueError(
            f'--config\'s "configurable" must be a JSON object, got {configurable!r}: e.g. '
            '\'{"configurable": {"user_id": "u-7"}}\''
        )
    configurable = dict(configurable)
    for item in args.configurable:
        key, sep, value = item.partition("=")
        if not sep or not key.strip():
            raise ValueError(
                f"--configurable must be KEY=VALUE (e.g. --configurable user_id=u-7), got "
                f"{item!r}; give it once per key"
            )
        configurable[key.strip()] = value
    thread = configurable.setdefault("thread_id", args.thread)
    if thread != args.thread:
        raise ValueError(
            f"the config's thread_id {thread!r} is not --thread {args.thread!r}: name the "
            "thread once, with --thread"
        )
    return {**config, "configurable": configurable}


def _not_before(given: str | None) -> datetime | float | None:
    """``--not-before``: a delay in seconds, or an ISO 8601 time with its offset."""
    if given is None:
        return None
    try:
        return float(given)
    except ValueError:
        return iso_time("--not-before", given, "a delay in seconds (e.g. 300) or ")


def _shown(state: RunState) -> str:
    """A submitted run's status as ``submit`` prints it."""
    shown = run_status(state, time.time())
    return f"{shown} for {utc(state.not_before)}" if shown == "scheduled" else shown


async def submit(args: argparse.Namespace) -> int:
    from rich.console import Console

    from langgraph_fence.instance import Instance

    payload, config, options = run_request(args)
    checked_target(args, must_exist=False)
    async with Instance.open(args.db, schema=args.schema) as instance:
        run = await instance.submit(
            args.graph,
            payload,
            config,  # type: ignore[arg-type]
            tenant_id=args.tenant,
            execution_id=args.execution,
            on_busy=args.on_busy,
            not_before=_not_before(args.not_before),
            **options,
        )
        state = await run.state()
        if args.wait is None:
            Console().print(
                f"submitted {run.scope_key} (graph {args.graph}, thread {args.thread}, run "
                f"{run.run_id}): {_shown(state)} at token "
                f"{state.epoch}",
                markup=False,
                highlight=False,
                soft_wrap=True,
            )
            return 0
        output = await run.result(timeout=args.wait)
    sys.stdout.write(as_json(output) + "\n")
    return 0


def _resolve_key(args: argparse.Namespace) -> LeaseKey:
    from langgraph_fence.lease.scope import parse_scope_key

    if args.key is not None:
        if args.tenant is not None or args.execution is not None:
            raise ValueError("name the execution once: KEY, or --tenant and --execution")
        try:
            parts = parse_scope_key(args.key)
        except ValueError as exc:
            raise ValueError(f"KEY: {exc} (copy it from `langgraph-fence executions`)") from None
        if len(parts) != 2:
            raise ValueError(f"KEY {args.key!r} is not an execution's key 'tenant:execution'")
        return LeaseKey(*parts)
    if not args.tenant or not args.execution:
        raise ValueError(
            "name the execution: KEY (tenant:execution, as `langgraph-fence executions` "
            "lists it) or --tenant and --execution"
        )
    return LeaseKey(args.tenant, args.execution)


async def resolve(args: argparse.Namespace) -> int:
    from rich.console import Console
    from rich.text import Text
    from sqlalchemy import select

    from langgraph_fence.database import create_engine
    from langgraph_fence.lease.journal import resolve as resolve_as_operator
    from langgraph_fence.lease.schema import LEASES
    from langgraph_fence.lease.sql import SqlLeaseRepository

    key = _resolve_key(args)
    if args.abandon and (args.reason is None or not args.reason.strip()):
        raise ValueError("--abandon needs --reason TEXT: what was checked, and by whom")
    if args.retry and args.reason is not None:
        raise ValueError("--reason goes with --abandon only (a retry keeps no reason)")
    checked_target(args, must_exist=True)
    engine = create_engine(args.db, schema=args.schema)
    try:
        async with engine.connect() as conn:
            # Never migrated: say so (the table is not created on a database named by mistake).
            await conn.execute(select(LEASES.c.scope_key).limit(1))
        repo = SqlLeaseRepository(engine)
        await repo.setup()  # the budget's columns (lease migration 4) on an older database
        try:
            lease = await resolve_as_operator(
                repo, key, abandon=args.abandon, note=args.reason, actor=_operator(args)
            )
        except KeyError:
            raise ValueError(
                f"no execution {key.execution_id!r} of tenant {key.tenant_id!r}: see "
                "`langgraph-fence dead-letters --tenant ...`"
            ) from None
    finally:
        await engine.dispose()
    if args.abandon:
        said = (
            f"execution {lease.scope_key} is failed at token {lease.epoch} ({lease.reason}), "
            "its stamped writes cleared: nothing runs it again"
        )
    else:
        said = (
            f"execution {lease.scope_key} is pending again at token {lease.epoch}, its "
            "takeover budget reset: a worker serving its graph takes it at its next poll"
        )
    Console().print(Text(printable(said)))
    return 0


def _operator(args: argparse.Namespace) -> str:
    """Who resolves, as the journal records it: ``--actor``, else ``user@host`` of this
    process."""
    import getpass
    import socket

    if args.actor:
        return str(args.actor)
    try:
        user = getpass.getuser()
    except Exception:  # no login name (a container's uid without a passwd entry)
        user = f"uid {os.getuid()}"
    return f"{user}@{socket.gethostname()} (cli)"


def _metrics_endpoint(
    args: argparse.Namespace, instance: Any, stop: asyncio.Event
) -> asyncio.Task[None] | None:
    """``/metrics`` of the worker's database and instance on ``--metrics-port``, served
    until ``stop`` (``None``: no port asked for)."""
    import asyncio

    if args.metrics_port is None:
        return None
    try:
        from langgraph_fence.console import LocalFigures, metrics_app
        from langgraph_fence.console._serve import bind, serve_until
    except ImportError as exc:
        raise ValueError(f"--metrics-port: {exc}") from None
    sock = bind(args.metrics_host, args.metrics_port, option="--metrics-port")
    from langgraph_fence.queue import ANNOUNCE_EVERY

    keeper = instance.host.keeper
    journal = instance.journal

    def local() -> list[LocalFigures]:
        late = keeper.lateness(instance.clock() - ANNOUNCE_EVERY)
        dropped = 0 if journal is None else journal.dropped
        return [LocalFigures(instance.instance_id, keeper.held, keeper.max_held, late, dropped)]

    app = metrics_app(instance.repository.engine, local=local)
    return asyncio.create_task(serve_until(app, sock, stop), name="metrics endpoint")


async def ui(args: argparse.Namespace) -> int:
    import asyncio

    from rich.console import Console

    from langgraph_fence.execution.serve import on_signals

    try:
        from langgraph_fence.console import create_app
        from langgraph_fence.console._serve import bind, serve_until
    except ImportError as exc:
        raise ValueError(str(exc)) from None
    if args.tenant is not None and not args.tenant:
        raise ValueError("--tenant must be a non-empty tenant id (or left out for every tenant)")
    checked_target(args, must_exist=True)
    token = _operator_token(args)
    app = create_app(args.db, schema=args.schema, tenant=args.tenant, operator_token=token)
    sock = bind(args.host, args.port, option="--port")
    host = f"[{args.host}]" if ":" in args.host else args.host
    mode = "operators who sign in with the token may act" if token else "read-only"
    Console().print(
        f"the console serves http://{host}:{args.port}/ ({mode}); /metrics for Prometheus; "
        "Ctrl-C stops it",
        markup=False,
        highlight=False,
        soft_wrap=True,
    )
    stop = asyncio.Event()
    remove = on_signals(stop)
    try:
        await serve_until(app, sock, stop)
    finally:
        remove()
        await app.state.console.aclose()
    return 0


def _operator_token(args: argparse.Namespace) -> str | None:
    """The operator token: ``--operator-token-file``'s, else ``LANGGRAPH_FENCE_UI_TOKEN``."""
    if args.operator_token_file is not None:
        try:
            with open(args.operator_token_file, encoding="utf-8") as file:
                token = file.read().strip()
        except OSError as exc:
            raise ValueError(
                f"--operator-token-file: cannot read {args.operator_token_file!r} ({exc.strerror})"
            ) from None
        if not token:
            raise ValueError("--operator-token-file: the file is empty")
    else:
        token = os.environ.get("LANGGRAPH_FENCE_UI_TOKEN", "").strip()
    if token and len(token) < 16:
        raise ValueError(
            "the operator token must be at least 16 characters: make one with "
            "`python -c 'import secrets; print(secrets.token_urlsafe())'`"
        )
    return token or None

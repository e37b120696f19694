"""The ``langgraph-fence`` command: demo, worker, submit, runs, migrate, executions,
dead-letters, resolve, erase.

The only module that prints; it prints through rich. It imports what a command needs when
the command runs: ``--help`` and the listings never load LangGraph (see benchmarks/README.md).
Every error an operator can fix is one line on stderr naming the fix, exit status 2; the
traceback only with ``--debug``.
"""

from __future__ import annotations

import argparse
import logging
import os
import re
import sys
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any, NoReturn

from .lease import LeaseKey, LeaseStatus
from .transitions import DEFAULT_MAX_TAKEOVERS

if TYPE_CHECKING:
    import asyncio
    from collections.abc import Callable

    from rich.console import Console

    from .diagnosis import Target

#: The longest pause of a worker waiting for its database at the start, in seconds.
WORKER_MAX_BACKOFF = 10.0

__all__ = ["main"]

logger = logging.getLogger(__name__)

DB_HELP = "database URL: sqlite+aiosqlite:///path.db or postgresql+asyncpg://user@host/db"
SCHEMA_HELP = (
    "PostgreSQL schema the tables are in (the connections' search_path), created by the "
    "commands that set tables up (migrate, worker, submit, erase) when missing; default: "
    "the role's search_path. SQLite has none"
)

EXIT_OK = 0
#: The command ran and failed (the demo found a problem, an unexpected error).
EXIT_FAILED = 1
#: Bad usage or input, or a database error: one line on stderr saying the fix.
EXIT_INPUT = 2
#: Refused: another instance holds the execution.
EXIT_REFUSED = 3

EPILOG = f"""exit status:
  {EXIT_OK}  done
  {EXIT_FAILED}  the command ran and failed (the demo found a problem; an unexpected error)
  {EXIT_INPUT}  bad usage or input, or a database error (unreachable, no such database or
     role, never migrated): one line on stderr saying the fix
  {EXIT_REFUSED}  refused: another instance holds the execution (erase), or its run is busy
     with other input (submit)
Errors print no traceback unless --debug is given."""

#: The statuses an execution can be in (``executions --status`` accepts exactly these).
STATUSES = [status.value for status in LeaseStatus]

#: The fields of each object ``executions --json`` and ``dead-letters --json`` print.
JSON_FIELDS = (
    "scope_key",
    "tenant_id",
    "execution_id",
    "status",
    "holder",
    "epoch",
    "expires_at",
    "expires_in",
    "pending_effects",
    "reason",
    "takeovers",
    "parent",
)


#: The fields of each object ``runs --json`` prints.
RUNS_FIELDS = (
    "scope_key",
    "tenant_id",
    "execution_id",
    "graph",
    "thread_id",
    "status",
    "holder",
    "epoch",
    "submitted",
    "served_by",
    "unserved",
)


class _Parser(argparse.ArgumentParser):
    """An argparse parser whose usage errors are one line naming the help to read."""

    def error(self, message: str) -> NoReturn:
        self.exit(EXIT_INPUT, f"{self.prog}: error: {message} (see `{self.prog} --help`)\n")


class _Version(argparse.Action):
    """``--version``: the installed version, read only when asked for."""

    def __init__(self, option_strings: Sequence[str], dest: str, **kwargs: Any) -> None:
        super().__init__(
            option_strings,
            dest=argparse.SUPPRESS,
            default=argparse.SUPPRESS,
            nargs=0,
            help="print the installed version and exit",
        )

    def __call__(self, parser: argparse.ArgumentParser, *args: Any, **kwargs: Any) -> None:
        from . import __version__

        sys.stdout.write(f"{parser.prog} {__version__}\n")
        parser.exit(EXIT_OK)


def _positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a whole number >= 1, got {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected a whole number >= 1, got {value}")
    return value


def _positive_seconds(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected seconds > 0, got {text!r}") from None
    if not value > 0 or value == float("inf"):
        raise argparse.ArgumentTypeError(f"expected seconds > 0, got {text}")
    return value


def _output_options(parser: argparse.ArgumentParser, *, top: bool) -> None:
    # On the top level and on every command: a command's defaults are SUPPRESSed so they do
    # not overwrite what was given before the command's name.
    default: Any = False if top else argparse.SUPPRESS
    parser.add_argument(
        "--debug", action="store_true", default=default, help="print the traceback of an error"
    )
    volume = parser.add_mutually_exclusive_group()
    volume.add_argument(
        "-v",
        "--verbose",
        action="store_true",
        default=default,
        help="log the library's events down to DEBUG",
    )
    volume.add_argument(
        "-q",
        "--quiet",
        action="store_true",
        default=default,
        help="log warnings and errors only (the worker logs at INFO by default)",
    )


def _database_options(parser: argparse.ArgumentParser, *, db_help: str = DB_HELP) -> None:
    parser.add_argument("--db", required=True, help=db_help)
    parser.add_argument("--schema", default=None, help=SCHEMA_HELP)


def _parser() -> argparse.ArgumentParser:
    parser = _Parser(
        prog="langgraph-fence",
        description="Fencing tokens for LangGraph: stale workers never land a write.",
        epilog=EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--version", action=_Version)
    _output_options(parser, top=True)
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    def command(name: str, help: str, description: str | None = None) -> argparse.ArgumentParser:
        import textwrap

        sub = commands.add_parser(
            name,
            help=help,
            # Raw, for the epilog's table: the description is wrapped here.
            description=None if description is None else textwrap.fill(description, 79),
            epilog=EPILOG,
            formatter_class=argparse.RawDescriptionHelpFormatter,
        )
        _output_options(sub, top=False)
        return sub

    demo = command("demo", "two instances, a stall past the lease, the stale writes refused")
    demo.add_argument(
        "--db",
        default=None,
        help=DB_HELP + " (default: langgraph-fence-demo.db in the current folder); kept",
    )
    demo.add_argument(
        "--schema",
        default=None,
        help="PostgreSQL schema (search_path) to use, created if missing "
        "(default: langgraph_fence_demo)",
    )
    worker = command(
        "worker",
        "serve: take over expired executions and run them (until SIGTERM)",
        description="Serve the graphs a module's function returns: take over every expired "
        "or handed-back execution of them and run it, until SIGTERM or Ctrl-C. The module is "
        "imported from the current folder first (as `uvicorn app:app` does). Logs at INFO "
        "on stderr: what it serves, each takeover, each dead letter, each handed-back run.",
    )
    _database_options(worker)
    worker.add_argument(
        "--graphs",
        required=True,
        metavar="MODULE:FUNCTION",
        help="a function taking the Instance and returning {graph name: compiled graph}; "
        "MODULE is imported from the current folder or sys.path",
    )
    worker.add_argument(
        "--concurrency",
        type=_positive_int,
        default=4,
        metavar="N",
        help="how many executions this worker runs at once (default: 4)",
    )
    worker.add_argument(
        "--max-held",
        type=_positive_int,
        default=None,
        metavar="N",
        help="how many executions this worker's instance holds (renews) at once; it takes "
        "no more over until one ends, whatever --concurrency says (default: as many as it "
        "renews at 3 000 leases a second, at most 10 000: 10 000 at a 30 s TTL, 3 000 at 3 s; "
        "at most 1 000 on an in-memory SQLite database, where renewals run on its loop)",
    )
    worker.add_argument(
        "--poll-interval",
        type=_positive_seconds,
        default=1.0,
        metavar="SECONDS",
        help="seconds between two looks for executions to take over (default: 1.0)",
    )
    worker.add_argument(
        "--lease-ttl",
        type=_positive_seconds,
        default=30.0,
        metavar="SECONDS",
        help="seconds a lease holds unless renewed (renewed every third of it); a worker "
        "silent this long is taken over (default: 30.0)",
    )
    worker.add_argument(
        "--instance-id",
        default=None,
        help="this worker's name in the lease table (default: host:pid and a random suffix)",
    )
    worker.add_argument(
        "--max-takeovers",
        type=_positive_int,
        default=DEFAULT_MAX_TAKEOVERS,
        metavar="N",
        help="the takeover budget: an execution taken over more than this many times in a "
        "row from workers that died with no new checkpoint is dead-lettered "
        f"('crashed N workers') (default: {DEFAULT_MAX_TAKEOVERS})",
    )
    submit = command(
        "submit",
        "hand a run to any worker: record it pending, return at once",
        description="Submit a run of a graph on a thread: its execution is recorded pending "
        "and any worker serving the graph (`langgraph-fence worker`) claims it at the next "
        "token. The same input again while it is pending or running is the same run "
        "(nothing written); other input is refused (exit status 3) unless --on-busy "
        "enqueue, which runs this input after the thread's runs before it, in order, or "
        "--on-busy interrupt, which fences the run in flight and runs this input next. A "
        "graph no worker serves is accepted: `langgraph-fence runs` shows it unserved.",
    )
    _database_options(submit)
    submit.add_argument("--graph", required=True, help="the graph name a worker serves")
    submit.add_argument("--thread", required=True, help="the thread id")
    submit.add_argument(
        "--input", required=True, metavar="JSON", help="the graph's input, e.g. '{\"n\": 1}'"
    )
    submit.add_argument(
        "--config",
        default=None,
        metavar="JSON",
        help="the run config as a JSON object, as graph.ainvoke takes it, e.g. "
        '\'{"configurable": {"user_id": "u-7"}, "tags": ["cli"], "recursion_limit": 10}\'; '
        "recorded with the run, so a takeover runs with it too",
    )
    submit.add_argument(
        "--configurable",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="one config['configurable'] key, its value a string (repeatable; over --config's; "
        "other types go in --config)",
    )
    submit.add_argument(
        "--context",
        default=None,
        metavar="JSON",
        help="the run's runtime context (graph.ainvoke's context=) as JSON, e.g. "
        '\'{"currency": "EUR"}\'',
    )
    submit.add_argument(
        "--tenant", default="default", help="the tenant of the thread (default: default)"
    )
    submit.add_argument(
        "--execution", default=None, help="the execution id (default: the thread id)"
    )
    submit.add_argument(
        "--on-busy",
        default="reject",
        choices=("reject", "enqueue", "interrupt"),  # queue.ON_BUSY (not imported at start-up)
        help="what to do when the thread's run is pending or running, or runs are queued "
        "on it (default: reject)",
    )
    submit.add_argument(
        "--wait",
        type=_positive_seconds,
        default=None,
        metavar="SECONDS",
        help="wait this long for the run's end and print its output as JSON (LangChain "
        "messages as message_to_dict's dicts, other values JSON cannot hold as strings)",
    )
    runs = command(
        "runs",
        "list pending and running executions, with their workers",
        description="List every pending and running execution that has a record: scope "
        "key, graph, thread, status, the worker running it, its token, and the workers "
        "serving its graph (a pending run of a graph no live worker serves shows as "
        "unserved).",
    )
    _database_options(runs)
    runs.add_argument(
        "--tenant", default=None, help="only this tenant's runs (their graphs and threads too)"
    )
    runs.add_argument(
        "--limit", type=_positive_int, default=200, metavar="N", help="at most this many"
    )
    runs.add_argument(
        "--json",
        action="store_true",
        help="print a JSON list of objects with the fields " + ", ".join(RUNS_FIELDS),
    )
    migrate = command("migrate", "create or upgrade every table on a database")
    _database_options(migrate)
    erase = command(
        "erase",
        "erase one tenant's thread: every row of it (refused while a run holds it)",
        description=(
            "Erase a tenant's thread under its execution's lease (refused, naming the holder, "
            "while another instance runs it): its checkpoints, blobs and writes, the "
            "execution's record (the run's input), its submitted and queued runs, the "
            "thread's binding, the lease's reason and stamps, the store items its steps "
            "wrote, and the exactly-once sink's stored results; and the same for every "
            "ANY_INSTANCE child it spawned, recursively. What stays, holding no "
            "data of the run: the lease row (done, no reason: its token must never go back) "
            "and the sink's high-water mark row (the scope key and a token). Exit status 3 "
            "when refused."
        ),
    )
    _database_options(erase)
    erase.add_argument("--tenant", required=True, help="the thread's tenant")
    erase.add_argument("--thread", required=True, help="the thread id to erase")
    erase.add_argument(
        "--sink-db",
        default=None,
        help="database of the exactly-once sink's tables, when not --db (its results go too)",
    )
    executions = command(
        "executions",
        "list executions and their leases",
        description="List executions, the most recently changed first: scope key, status, "
        "holder, token (epoch), when the lease expires (judged by the store's clock), the "
        "stamped writes that may have happened, and the reason it ended.",
    )
    executions.add_argument(
        "--status", default=None, choices=STATUSES, help="only executions in this status"
    )
    dead = command(
        "dead-letters",
        "list dead-lettered executions and why",
        description="List dead-lettered executions (as `executions --status dead_lettered`); "
        "act on one with `langgraph-fence resolve KEY --retry | --abandon --reason TEXT`.",
    )
    for listing in (executions, dead):
        _database_options(listing)
        listing.add_argument(
            "--tenant", default=None, help="only this tenant's executions (their reasons too)"
        )
        listing.add_argument(
            "--limit",
            type=_positive_int,
            default=50,
            metavar="N",
            help="at most this many executions (default: 50)",
        )
        listing.add_argument(
            "--json",
            action="store_true",
            help="print a JSON list of objects, one per execution, with the fields "
            + ", ".join(JSON_FIELDS)
            + " (README: 'executions --json')",
        )
    resolve = command(
        "resolve",
        "act on one dead-lettered or cancelled execution: --retry it, or --abandon it",
        description="Act on one dead-lettered (or cancelled) execution, named by its scope key as "
        "`executions` lists it (or by --tenant and --execution), after a person checked what "
        "it may have done. --retry makes it pending again with its takeover budget reset: "
        "any worker serving its graph takes it at its next poll and resumes it from its last "
        "checkpoint at the next token (fix the step that killed its workers first); refused "
        "while a non-idempotent write stamped before it was dead-lettered stands, since a "
        "retry would repeat it. --abandon ends it failed with the reason 'abandoned by "
        "operator: TEXT' and clears its stamped writes (settled by hand); nothing runs it "
        "again. Both are refused for an execution that is neither dead-lettered nor "
        "cancelled.",
    )
    resolve.add_argument(
        "key",
        nargs="?",
        metavar="KEY",
        help="the execution's scope key, tenant:execution as `executions` lists it",
    )
    _database_options(resolve)
    resolve.add_argument(
        "--tenant", default=None, help="the execution's tenant id (with --execution)"
    )
    resolve.add_argument(
        "--execution", default=None, help="the execution id (the thread id unless set)"
    )
    action = resolve.add_mutually_exclusive_group(required=True)
    action.add_argument(
        "--retry",
        action="store_true",
        help="make it pending again, its takeover budget reset",
    )
    action.add_argument(
        "--abandon",
        action="store_true",
        help="end it failed with --reason (required): nothing runs it again",
    )
    resolve.add_argument(
        "--reason",
        default=None,
        metavar="TEXT",
        help="with --abandon: what was checked and by whom (stored as 'abandoned by operator: "
        "TEXT')",
    )
    return parser


def _log_level(args: argparse.Namespace) -> int:
    if args.verbose:
        return logging.DEBUG
    if args.quiet:
        return logging.WARNING
    if args.command == "demo":
        return logging.ERROR  # its timeline shows every warning the library would log
    return logging.INFO if args.command == "worker" else logging.WARNING


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the ``langgraph-fence`` console script; returns the exit code."""
    args = _parser().parse_args(argv)
    handler = logging.StreamHandler()
    handler.setFormatter(_PrintableFormatter("%(asctime)s %(levelname)s %(name)s: %(message)s"))
    logging.basicConfig(level=logging.WARNING, handlers=[handler])
    logging.getLogger("langgraph_fence").setLevel(_log_level(args))
    try:
        return _run(args)
    except Exception as exc:  # every error becomes one line (and its exit status)
        code, line = _explain(exc, args)
        if args.debug:
            import traceback

            traceback.print_exception(exc)
        _stderr().print(line, markup=False, highlight=False)
        return code


def _stderr() -> Console:
    from rich.console import Console

    # soft_wrap: an error is one line whatever the terminal's width.
    return Console(stderr=True, soft_wrap=True)


def _target(args: argparse.Namespace) -> Target | None:
    from .diagnosis import Target

    db = getattr(args, "db", None)
    return None if db is None else Target(db, getattr(args, "schema", None))


def _explain(exc: Exception, args: argparse.Namespace) -> tuple[int, str]:
    """The exit status and the one line printed for ``exc``."""
    from sqlalchemy.exc import SQLAlchemyError

    from .diagnosis import explain_database_error
    from .errors import ExecutionBusyError, ExecutionEndedError, ExecutionLeaseHeldError
    from .redact import failure_reason, mask_password

    if isinstance(exc, ExecutionLeaseHeldError | ExecutionEndedError | ExecutionBusyError):
        return EXIT_REFUSED, f"refused: {exc}"
    if isinstance(exc, ValueError):
        # One line: a message quoting several lines of input keeps them all, joined.
        return EXIT_INPUT, f"error: {mask_password(' '.join(str(exc).splitlines()))}"
    target = _target(args)
    known = None if target is None else explain_database_error(exc, target)
    if known is not None:
        return EXIT_INPUT, f"error: {known}"
    hint = "" if args.debug else " (--debug prints the traceback)"
    if isinstance(exc, SQLAlchemyError | OSError):
        # A database that cannot be reached or read: say so, without the driver's quoted
        # statement and parameters, and without the URL's password.
        return EXIT_INPUT, f"error: the database failed: {failure_reason(exc)}{hint}"
    return EXIT_FAILED, f"error: {failure_reason(exc)}{hint}"


def _run(args: argparse.Namespace) -> int:
    import asyncio

    if args.command == "demo":
        from rich.console import Console

        return asyncio.run(_demo(Console(), args.db, args.schema))
    if args.command == "worker":
        return asyncio.run(_worker(args))
    if args.command == "migrate":
        return asyncio.run(_migrate(args))
    if args.command == "erase":
        return asyncio.run(_erase(args))
    if args.command in ("executions", "dead-letters"):
        status = "dead_lettered" if args.command == "dead-letters" else args.status
        return asyncio.run(_executions(args, status))
    if args.command == "resolve":
        return asyncio.run(_resolve(args))
    if args.command == "submit":
        return asyncio.run(_submit(args))
    if args.command == "runs":
        return asyncio.run(_runs(args))
    raise AssertionError(f"unknown command {args.command!r}")


async def _demo(console: Console, db: str | None, schema: str | None) -> int:
    from rich.table import Table
    from rich.text import Text

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


def _checked_target(args: argparse.Namespace, *, must_exist: bool) -> Target:
    """``--db`` and ``--schema``, the URL parsed, a SQLite path checked and a schema with a
    SQLite URL refused before use."""
    from .diagnosis import check_sqlite_file

    target = _target(args)
    assert target is not None
    check_sqlite_file(target, must_exist=must_exist)
    if target.schema is not None:
        from .database import normalize_url

        if not target.schema:
            raise ValueError("--schema must name a schema, or be left out")
        if normalize_url(target.url).get_backend_name() != "postgresql":
            raise ValueError(
                "--schema: SQLite has no schemas: leave --schema out, or give a PostgreSQL "
                "URL in --db"
            )
    return target


async def _worker(args: argparse.Namespace) -> int:
    import asyncio

    from .serve import on_signals

    target = _checked_target(args, must_exist=False)
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

    from .instance import Instance
    from .redact import failure_reason
    from .retry import is_database_connection_error

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
                await instance.serve(
                    graphs,
                    concurrency=args.concurrency,
                    poll_interval=args.poll_interval,
                    stop=stop,
                    handle_signals=False,
                )
        except Exception as exc:
            # A database out of reach at the start (serve() itself rides out outages): wait
            # for it, as a worker started with its database mid-restart must.
            if serving or not is_database_connection_error(exc):
                raise
            failures += 1
            pause = min(WORKER_MAX_BACKOFF, 0.5 * float(1 << min(failures, 16)))
            _stderr().print(
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


async def _migrate(args: argparse.Namespace) -> int:
    from rich.console import Console

    from .checkpointers import SqlCheckpointer, SqlStore
    from .database import create_engine
    from .records import SqlExecutionRecords
    from .sinks import setup_sink
    from .stores.sql import SqlLeaseRepository

    _checked_target(args, must_exist=False)
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


async def _erase(args: argparse.Namespace) -> int:
    from rich.console import Console
    from rich.table import Table

    from .admin import ThreadAdmin, count_erasable
    from .database import create_engine, schema_options
    from .instance import Instance

    if not args.tenant:
        raise ValueError("--tenant must be the thread's tenant id (non-empty)")
    if not args.thread:
        raise ValueError("--thread must be the id of the thread to erase (non-empty)")
    _checked_target(args, must_exist=True)
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


# What a terminal would act on instead of showing: C0 and C1 controls (ESC starts every
# escape sequence: clear screen, set title, move the cursor), DEL, the line and paragraph
# separators, and the invisible format characters that reorder or hide text (bidi
# overrides and isolates, zero-width characters, the BOM).
_UNPRINTABLE = re.compile(
    "[\x00-\x1f\x7f-\x9f\u00ad\u061c\u180e\u200b-\u200f\u2028-\u202e\u2060-\u206f\ufeff]"
)


def printable(text: str) -> str:
    """``text`` with every control or invisible format character escaped as Python writes
    it (``\\x1b``, ``\\u202e``): what a listing prints of a stored field never acts on the
    terminal, and every character of it stays visible."""
    return _UNPRINTABLE.sub(lambda m: ascii(m.group())[1:-1], text)


class _PrintableFormatter(logging.Formatter):
    """A log line made :func:`printable` (a graph name or id it quotes is a tenant's); a
    traceback after it keeps its lines."""

    def formatMessage(self, record: logging.LogRecord) -> str:
        return printable(super().formatMessage(record))


def _expires(expires_at: float | None, now: float) -> str:
    """``in 12 s`` or ``expired 12 s ago`` (both against the store's clock), or empty."""
    if expires_at is None:
        return ""
    left = expires_at - now
    return f"in {left:.0f} s" if left >= 0 else f"expired {-left:.0f} s ago"


async def _executions(args: argparse.Namespace, status: str | None) -> int:
    import json

    from sqlalchemy import select

    from .database import create_engine, read_only
    from .schema import LEASES, effects_from_json
    from .stores.sql import SqlLeaseRepository

    if args.tenant is not None and not args.tenant:
        raise ValueError("--tenant must be a non-empty tenant id (or left out for every tenant)")
    _checked_target(args, must_exist=True)
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
    from .children import parse_child_execution_id

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


def _json_option(option: str, text: str, example: str) -> Any:
    """The JSON value of ``option``, or a ``ValueError`` naming it and the fix."""
    import json

    try:
        return json.loads(text)
    except json.JSONDecodeError as exc:
        raise ValueError(
            f"{option} must be JSON, e.g. {example} (quote it for the shell): {exc}"
        ) from None


def _submit_config(args: argparse.Namespace) -> dict[str, Any]:
    """The run config ``submit`` was given: ``--config``, each ``--configurable KEY=VALUE``
    over its ``configurable``, and ``--thread`` as the thread id."""
    config: Any = {}
    if args.config is not None:
        config = _json_option("--config", args.config, '\'{"configurable": {"user_id": "u-7"}}\'')
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


def as_json(value: Any) -> str:
    """``value`` (a run's output) as JSON a program can read: LangChain messages as
    ``message_to_dict`` makes them (``{"type": ..., "data": {...}}``), dataclasses (an
    ``Interrupt``) and pydantic models as their fields, sets as lists, and anything else
    JSON cannot hold as its ``str``."""
    import dataclasses
    import json

    from langchain_core.messages import BaseMessage, message_to_dict

    def plain(obj: Any) -> Any:
        if isinstance(obj, BaseMessage):
            return message_to_dict(obj)
        if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
            return {f.name: getattr(obj, f.name) for f in dataclasses.fields(obj)}
        model_dump = getattr(obj, "model_dump", None)
        if callable(model_dump) and not isinstance(obj, type):
            return model_dump(mode="json")
        if isinstance(obj, set | frozenset):
            return list(obj)
        return str(obj)

    return json.dumps(value, default=plain)


async def _submit(args: argparse.Namespace) -> int:
    from rich.console import Console

    from .instance import Instance

    payload = _json_option("--input", args.input, "'{\"n\": 1}'")
    config = _submit_config(args)
    options: dict[str, Any] = {}
    if args.context is not None:
        options["context"] = _json_option("--context", args.context, '\'{"currency": "EUR"}\'')
    _checked_target(args, must_exist=False)
    async with Instance.open(args.db, schema=args.schema) as instance:
        run = await instance.submit(
            args.graph,
            payload,
            config,  # type: ignore[arg-type]
            tenant_id=args.tenant,
            execution_id=args.execution,
            on_busy=args.on_busy,
            **options,
        )
        state = await run.state()
        if args.wait is None:
            Console().print(
                f"submitted {run.scope_key} (graph {args.graph}, thread {args.thread}, run "
                f"{run.run_id}): {'queued' if state.queued else state.status.value} at token "
                f"{state.epoch}",
                markup=False,
                highlight=False,
                soft_wrap=True,
            )
            return 0
        output = await run.result(timeout=args.wait)
    sys.stdout.write(as_json(output) + "\n")
    return 0


async def _runs(args: argparse.Namespace) -> int:
    import json

    from .database import create_engine, read_only
    from .queue import list_runs, served_graphs

    if args.tenant is not None and not args.tenant:
        raise ValueError("--tenant must be a non-empty tenant id (or left out for every tenant)")
    _checked_target(args, must_exist=True)
    engine = create_engine(args.db, schema=args.schema)
    try:
        reader = read_only(engine)
        found = await list_runs(reader, args.limit, tenant_id=args.tenant)
        served = await served_graphs(reader)
    finally:
        await engine.dispose()
    listed: list[dict[str, Any]] = [
        {
            "scope_key": r.key.scope_key,
            "tenant_id": r.key.tenant_id,
            "execution_id": r.key.execution_id,
            "graph": r.graph,
            "thread_id": r.thread_id,
            "status": "queued" if r.queued else r.status.value,
            "holder": r.holder,
            "epoch": r.epoch,
            "submitted": r.submitted,
            "run_id": r.run_id,
            "served_by": served.get(r.graph or "", []),
            "unserved": r.holder is None and not served.get(r.graph or ""),
        }
        for r in found
    ]
    if args.json:
        sys.stdout.write(json.dumps(listed, indent=2) + "\n")
        return 0
    from rich.console import Console
    from rich.table import Table
    from rich.text import Text

    title = "pending and running executions, and the runs queued behind them"
    if args.tenant is not None:
        title += f" of tenant {args.tenant}"
    table = Table(title=printable(title))
    table.add_column("scope key", overflow="fold")
    for column in ("graph", "thread", "status", "worker", "token", "served by"):
        table.add_column(column, overflow="fold")
    for entry in listed:
        serving = "UNSERVED" if entry["unserved"] else ", ".join(entry["served_by"])
        cells = (
            entry["scope_key"],
            entry["graph"] or "",
            entry["thread_id"] or "",
            entry["status"],
            entry["holder"] or "",
            str(entry["epoch"]),
            serving,
        )
        table.add_row(*(Text(printable(cell)) for cell in cells))
    Console().print(table)
    return 0


def _print_executions(
    args: argparse.Namespace, status: str | None, listed: list[dict[str, Any]], now: float
) -> None:
    from rich.console import Console
    from rich.table import Table
    from rich.text import Text

    title = "dead-lettered executions" if status == "dead_lettered" else "executions"
    if args.tenant is not None:
        title += f" of tenant {args.tenant}"
    table = Table(title=printable(title))
    # The scope key in full: the KEY that `resolve` takes.
    table.add_column("scope key", overflow="fold")
    for column in ("status", "holder", "token", "expires", "pending effects", "reason"):
        table.add_column(column, overflow="fold")
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
            _expires(entry["expires_at"], now),
            pending,
            printable(entry["reason"] or ""),
        )
        # Text, not markup: a stored reason or id is data ("[/b]" in a reason must not
        # break the listing or restyle it), and printable: no escape sequence of a tenant's
        # reaches the terminal.
        table.add_row(*(Text(cell) for cell in cells))
    Console().print(table)


def _resolve_key(args: argparse.Namespace) -> LeaseKey:
    from .scope import parse_scope_key

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


async def _resolve(args: argparse.Namespace) -> int:
    from rich.console import Console
    from rich.text import Text
    from sqlalchemy import select

    from .database import create_engine
    from .schema import LEASES
    from .stores.sql import SqlLeaseRepository

    key = _resolve_key(args)
    if args.abandon and (args.reason is None or not args.reason.strip()):
        raise ValueError("--abandon needs --reason TEXT: what was checked, and by whom")
    if args.retry and args.reason is not None:
        raise ValueError("--reason goes with --abandon only (a retry keeps no reason)")
    _checked_target(args, must_exist=True)
    engine = create_engine(args.db, schema=args.schema)
    try:
        async with engine.connect() as conn:
            # Never migrated: say so (the table is not created on a database named by mistake).
            await conn.execute(select(LEASES.c.scope_key).limit(1))
        repo = SqlLeaseRepository(engine)
        await repo.setup()  # the budget's columns (lease migration 4) on an older database
        try:
            lease = await (repo.abandon(key, args.reason) if args.abandon else repo.retry(key))
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


if __name__ == "__main__":
    sys.exit(main())

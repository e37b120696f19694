"""The command line's parser: every command, its options and its help."""

from __future__ import annotations

import argparse
import logging
import sys
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any, NoReturn

from langgraph_fence.lease.transitions import DEFAULT_MAX_TAKEOVERS

if TYPE_CHECKING:
    pass
from langgraph_fence.cli._common import (
    DB_HELP,
    EPILOG,
    EXIT_INPUT,
    EXIT_OK,
    JSON_FIELDS,
    RUNS_FIELDS,
    SCHEMA_HELP,
    STATUSES,
    positive_int,
    positive_seconds,
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
        from langgraph_fence import __version__

        sys.stdout.write(f"{parser.prog} {__version__}\n")
        parser.exit(EXIT_OK)


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


def _run_options(parser: argparse.ArgumentParser) -> None:
    """What a submitted run is (``submit``, ``schedules create``): graph, thread, input,
    config, context, tenant, execution."""
    parser.add_argument("--graph", required=True, help="the graph name a worker serves")
    parser.add_argument("--thread", required=True, help="the thread id")
    parser.add_argument(
        "--input", required=True, metavar="JSON", help="the graph's input, e.g. '{\"n\": 1}'"
    )
    parser.add_argument(
        "--config",
        default=None,
        metavar="JSON",
        help="the run config as a JSON object, as graph.ainvoke takes it, e.g. "
        '\'{"configurable": {"user_id": "u-7"}, "tags": ["cli"], "recursion_limit": 10}\'; '
        "recorded with the run, so a takeover runs with it too",
    )
    parser.add_argument(
        "--configurable",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="one config['configurable'] key, its value a string (repeatable; over --config's; "
        "other types go in --config)",
    )
    parser.add_argument(
        "--context",
        default=None,
        metavar="JSON",
        help="the run's runtime context (graph.ainvoke's context=) as JSON, e.g. "
        '\'{"currency": "EUR"}\'',
    )
    parser.add_argument(
        "--tenant", default="default", help="the tenant of the thread (default: default)"
    )
    parser.add_argument(
        "--execution", default=None, help="the execution id (default: the thread id)"
    )


def parser() -> argparse.ArgumentParser:
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
        type=positive_int,
        default=4,
        metavar="N",
        help="how many executions this worker runs at once (default: 4)",
    )
    worker.add_argument(
        "--max-held",
        type=positive_int,
        default=None,
        metavar="N",
        help="how many executions this worker's instance holds (renews) at once; it takes "
        "no more over until one ends, whatever --concurrency says (default: as many as it "
        "renews at 3 000 leases a second, at most 10 000: 10 000 at a 30 s TTL, 3 000 at 3 s; "
        "at most 1 000 on an in-memory SQLite database, where renewals run on its loop)",
    )
    worker.add_argument(
        "--poll-interval",
        type=positive_seconds,
        default=1.0,
        metavar="SECONDS",
        help="seconds between two looks for executions to take over (default: 1.0)",
    )
    worker.add_argument(
        "--lease-ttl",
        type=positive_seconds,
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
        type=positive_int,
        default=DEFAULT_MAX_TAKEOVERS,
        metavar="N",
        help="the takeover budget: an execution taken over more than this many times in a "
        "row from workers that died with no new checkpoint is dead-lettered "
        f"('crashed N workers') (default: {DEFAULT_MAX_TAKEOVERS})",
    )
    worker.add_argument(
        "--metrics-port",
        type=positive_int,
        default=None,
        metavar="PORT",
        help="serve /metrics (Prometheus) on this port of --metrics-host while it works: the "
        "database's figures and this worker's held leases and renewal lateness "
        "(default: none; needs the ui extra)",
    )
    worker.add_argument(
        "--metrics-host",
        default="127.0.0.1",
        help="the address /metrics listens on (default: 127.0.0.1)",
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
    _run_options(submit)
    submit.add_argument(
        "--on-busy",
        default="reject",
        choices=("reject", "enqueue", "interrupt"),  # queue.ON_BUSY (not imported at start-up)
        help="what to do when the thread's run is pending or running, or runs are queued "
        "on it (default: reject)",
    )
    submit.add_argument(
        "--not-before",
        default=None,
        metavar="WHEN",
        help="no worker starts the run before WHEN: a delay in seconds (e.g. 300) or an ISO "
        "8601 time with its offset (e.g. 2026-12-24T09:00:00+01:00), on the database's clock",
    )
    submit.add_argument(
        "--wait",
        type=positive_seconds,
        default=None,
        metavar="SECONDS",
        help="wait this long for the run's end and print its output as JSON (LangChain "
        "messages as message_to_dict's dicts, other values JSON cannot hold as strings)",
    )
    schedules = command(
        "schedules",
        "create, list, pause, resume and delete schedules (cron ticks that submit runs)",
        description="A schedule submits one run of a graph on a thread at each tick of a "
        "cron expression in a time zone, judged by the database's clock; whichever worker "
        "(`langgraph-fence worker`) looks first fires a tick, exactly once.",
    )
    actions = schedules.add_subparsers(dest="action", required=True, metavar="ACTION")
    create = actions.add_parser("create", help="create a schedule (or --replace one)")
    create.add_argument("schedule_id", metavar="ID", help="the schedule's id in its tenant")
    _database_options(create)
    _run_options(create)
    create.add_argument(
        "--cron",
        required=True,
        help="5 fields ('0 9 * * MON-FRI'), or 6 with seconds last ('* * * * * */10')",
    )
    create.add_argument("--timezone", default="UTC", help="an IANA time zone name (default: UTC)")
    create.add_argument(
        "--overlap",
        default="skip",
        choices=("skip", "enqueue", "cancel_previous"),  # queue.OVERLAP
        help="a tick while the previous run is pending or running (default: skip)",
    )
    create.add_argument(
        "--missed",
        default="skip",
        choices=("skip", "run_one"),  # queue.MISSED
        help="ticks found more than --grace seconds late (default: skip)",
    )
    create.add_argument(
        "--grace",
        type=float,
        default=60.0,
        metavar="SECONDS",
        help="how late a tick may fire (default: 60)",
    )
    create.add_argument(
        "--end-at",
        default=None,
        metavar="TIME",
        help="no tick after this ISO 8601 time with its offset",
    )
    create.add_argument(
        "--replace", action="store_true", help="replace the schedule of that id if it exists"
    )
    listing = actions.add_parser("list", help="list the schedules")
    _database_options(listing)
    listing.add_argument("--tenant", default=None, help="of this tenant only")
    listing.add_argument("--json", action="store_true", help="print JSON")
    for name, what in (
        ("pause", "fire no tick until resumed"),
        ("resume", "fire again from the next tick after now"),
        ("delete", "delete the schedule (its runs stay)"),
    ):
        one = actions.add_parser(name, help=what)
        one.add_argument("schedule_id", metavar="ID", help="the schedule's id")
        _database_options(one)
        one.add_argument(
            "--tenant", default="default", help="the schedule's tenant (default: default)"
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
        "--limit", type=positive_int, default=200, metavar="N", help="at most this many"
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
            type=positive_int,
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
    resolve.add_argument(
        "--actor",
        default=None,
        metavar="NAME",
        help="who resolves, as the journal records it (default: user@host of this shell)",
    )
    ui = command(
        "ui",
        "the operator's console: a web page of executions, tokens and dead letters, /metrics",
        description="Serve the operator's console on the database: executions (their lease, "
        "stamps, token timeline, children, input), dead letters, the run queue and the "
        "serving instances, and /metrics in Prometheus' format. Read-only unless an operator "
        "token is given (the environment variable LANGGRAPH_FENCE_UI_TOKEN, or "
        "--operator-token-file): then an operator who signs in with it can retry or abandon "
        "a dead letter, each action journaled with their name and note. Binds to loopback "
        "unless --host says otherwise. Needs the ui extra: pip install 'langgraph-fence[ui]'.",
    )
    _database_options(ui)
    ui.add_argument(
        "--host",
        default="127.0.0.1",
        help="the address to listen on (default: 127.0.0.1, this machine only)",
    )
    ui.add_argument(
        "--port", type=positive_int, default=8765, help="the port to listen on (default: 8765)"
    )
    ui.add_argument(
        "--tenant",
        default=None,
        help="show this tenant only (every page, /metrics included); default: every tenant",
    )
    ui.add_argument(
        "--operator-token-file",
        default=None,
        metavar="PATH",
        help="a file holding the operator token that unlocks the actions (default: the "
        "environment variable LANGGRAPH_FENCE_UI_TOKEN; neither: read-only)",
    )
    return parser


def log_level(args: argparse.Namespace) -> int:
    if args.verbose:
        return logging.DEBUG
    if args.quiet:
        return logging.WARNING
    if args.command == "demo":
        return logging.ERROR  # its timeline shows every warning the library would log
    return logging.INFO if args.command == "worker" else logging.WARNING

"""The ``langgraph-fence`` command: demo, worker, submit, runs, schedules, migrate,
executions, dead-letters, resolve, erase, ui.

The only module that prints; it prints through rich. It imports what a command needs when
the command runs: ``--help`` and the listings never load LangGraph (see benchmarks/README.md).
Every error an operator can fix is one line on stderr naming the fix, exit status 2; the
traceback only with ``--debug``.
"""

from __future__ import annotations

import argparse
import logging
from collections.abc import Callable, Coroutine, Sequence
from typing import Any

from langgraph_fence.cli._commands import demo, erase, migrate, resolve, submit, ui, worker
from langgraph_fence.cli._common import (
    EXIT_FAILED,
    EXIT_INPUT,
    EXIT_REFUSED,
    PrintableFormatter,
    db_target,
    stderr,
)
from langgraph_fence.cli._listings import executions, runs
from langgraph_fence.cli._parser import log_level, parser
from langgraph_fence.cli._schedules import schedules


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the ``langgraph-fence`` console script; returns the exit code."""
    args = parser().parse_args(argv)
    handler = logging.StreamHandler()
    handler.setFormatter(PrintableFormatter("%(asctime)s %(levelname)s %(name)s: %(message)s"))
    logging.basicConfig(level=logging.WARNING, handlers=[handler])
    logging.getLogger("langgraph_fence").setLevel(log_level(args))
    try:
        return _run(args)
    except Exception as exc:  # every error becomes one line (and its exit status)
        code, line = _explain(exc, args)
        if args.debug:
            import traceback

            traceback.print_exception(exc)
        stderr().print(line, markup=False, highlight=False)
        return code


def _explain(exc: Exception, args: argparse.Namespace) -> tuple[int, str]:
    """The exit status and the one line printed for ``exc``."""
    from sqlalchemy.exc import SQLAlchemyError

    from langgraph_fence.database.diagnosis import explain_database_error
    from langgraph_fence.errors import (
        ExecutionBusyError,
        ExecutionEndedError,
        ExecutionLeaseHeldError,
    )
    from langgraph_fence.redact import failure_reason, mask_password

    if isinstance(exc, ExecutionLeaseHeldError | ExecutionEndedError | ExecutionBusyError):
        return EXIT_REFUSED, f"refused: {exc}"
    if isinstance(exc, ValueError):
        # One line: a message quoting several lines of input keeps them all, joined.
        return EXIT_INPUT, f"error: {mask_password(' '.join(str(exc).splitlines()))}"
    target = db_target(args)
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

        return asyncio.run(demo(Console(), args.db, args.schema))
    if args.command in ("executions", "dead-letters"):
        status = "dead_lettered" if args.command == "dead-letters" else args.status
        return asyncio.run(executions(args, status))
    command = _COMMANDS.get(args.command)
    if command is None:
        raise AssertionError(f"unknown command {args.command!r}")
    return asyncio.run(command(args))


#: The commands that take their arguments only, by name.
_COMMANDS: dict[str, Callable[[argparse.Namespace], Coroutine[Any, Any, int]]] = {
    "worker": worker,
    "migrate": migrate,
    "erase": erase,
    "resolve": resolve,
    "submit": submit,
    "runs": runs,
    "schedules": schedules,
    "ui": ui,
}


__all__ = ["main"]

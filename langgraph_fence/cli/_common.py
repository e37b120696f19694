"""What the commands share: exit statuses, help texts, the fields of the JSON listings,
argument checks, and text made safe for a terminal."""

from __future__ import annotations

import argparse
import logging
import re
from datetime import UTC, datetime
from typing import TYPE_CHECKING, Any

from langgraph_fence.lease import LeaseStatus

if TYPE_CHECKING:
    from rich.console import Console

    from langgraph_fence.database.diagnosis import Target
    from langgraph_fence.queue import RunState


#: The longest pause of a worker waiting for its database at the start, in seconds.
WORKER_MAX_BACKOFF = 10.0


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


def positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a whole number >= 1, got {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected a whole number >= 1, got {value}")
    return value


def positive_seconds(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected seconds > 0, got {text!r}") from None
    if not value > 0 or value == float("inf"):
        raise argparse.ArgumentTypeError(f"expected seconds > 0, got {text}")
    return value


def stderr() -> Console:
    from rich.console import Console

    # soft_wrap: an error is one line whatever the terminal's width.
    return Console(stderr=True, soft_wrap=True)


def db_target(args: argparse.Namespace) -> Target | None:
    from langgraph_fence.database.diagnosis import Target

    db = getattr(args, "db", None)
    return None if db is None else Target(db, getattr(args, "schema", None))


def checked_target(args: argparse.Namespace, *, must_exist: bool) -> Target:
    """``--db`` and ``--schema``, the URL parsed, a SQLite path checked and a schema with a
    SQLite URL refused before use."""
    from langgraph_fence.database.diagnosis import check_sqlite_file

    target = db_target(args)
    assert target is not None
    check_sqlite_file(target, must_exist=must_exist)
    if target.schema is not None:
        from langgraph_fence.database import normalize_url

        if not target.schema:
            raise ValueError("--schema must name a schema, or be left out")
        if normalize_url(target.url).get_backend_name() != "postgresql":
            raise ValueError(
                "--schema: SQLite has no schemas: leave --schema out, or give a PostgreSQL "
                "URL in --db"
            )
    return target


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


class PrintableFormatter(logging.Formatter):
    """A log line made :func:`printable` (a graph name or id it quotes is a tenant's); a
    traceback after it keeps its lines."""

    def formatMessage(self, record: logging.LogRecord) -> str:
        return printable(super().formatMessage(record))


def expires(expires_at: float | None, now: float) -> str:
    """``in 12 s`` or ``expired 12 s ago`` (both against the store's clock), or empty."""
    if expires_at is None:
        return ""
    left = expires_at - now
    return f"in {left:.0f} s" if left >= 0 else f"expired {-left:.0f} s ago"


def json_option(option: str, text: str, example: str) -> Any:
    """The JSON value of ``option``, or a ``ValueError`` naming it and the fix."""
    import json

    try:
        return json.loads(text)
    except json.JSONDecodeError as exc:
        raise ValueError(
            f"{option} must be JSON, e.g. {example} (quote it for the shell): {exc}"
        ) from None


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


def run_status(run: RunState, now: float) -> str:
    """``queued`` (behind the thread's run), ``held`` (waiting for its flow key's limits),
    ``scheduled`` (pending, not to start before a time still ahead of this process's
    clock), or the lease's status."""
    if run.queued:
        return "queued"
    if run.held_back:
        return "held"
    if run.not_before is not None and run.not_before > now:
        return "scheduled"
    return run.status.value


def utc(at: float | None) -> str | None:
    """``at`` (epoch seconds) as an ISO 8601 time in UTC, to the second."""
    if at is None:
        return None
    return datetime.fromtimestamp(at, UTC).isoformat(timespec="seconds")


def iso_time(option: str, given: str, other: str = "") -> datetime:
    """``given`` as an ISO 8601 time, or ``ValueError`` naming ``option`` (which also takes
    ``other``, e.g. "a delay in seconds or ")."""
    try:
        return datetime.fromisoformat(given)
    except ValueError:
        raise ValueError(
            f"{option} must be {other}an ISO 8601 time with its offset (e.g. "
            f"2026-12-24T09:00:00+01:00), got {given!r}"
        ) from None

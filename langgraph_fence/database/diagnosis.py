"""What a database error means to the operator who typed the command, and the fix.

A driver's error is a chain (SQLAlchemy's wrapper, the adapter's, asyncpg's or sqlite3's)
whose text quotes statements and says nothing of what to do. :func:`explain_database_error`
turns the errors an operator meets on the first day (server unreachable, no such database
or role, a SQLite file that cannot be opened, a database never migrated, a schema that does
not exist) into one line naming the fix; :func:`check_sqlite_file` refuses a SQLite path
before any driver touches it (a connection that fails in aiosqlite's thread prints a
traceback of its own).
"""

from __future__ import annotations

import os
import socket
from dataclasses import dataclass

from langgraph_fence.database import check_sqlite_folder, normalize_url
from langgraph_fence.errors import linked_errors
from langgraph_fence.redact import mask_password

__all__ = ["Target", "check_sqlite_file", "explain_database_error"]

#: PostgreSQL SQLSTATE codes an operator can act on.
_UNDEFINED_TABLE = "42P01"
_INVALID_CATALOG = "3D000"  # database does not exist
_INVALID_SCHEMA = "3F000"  # no schema selected / schema does not exist
_AUTH = ("28000", "28P01")  # role does not exist, password failed


@dataclass(frozen=True, slots=True)
class Target:
    """Where the command was pointed: the ``--db`` URL as typed and its ``--schema``."""

    url: str
    schema: str | None = None

    @property
    def masked(self) -> str:
        """The URL as it may be printed: its password masked."""
        return mask_password(self.url)

    def migrate_command(self) -> str:
        """The command that creates the tables here."""
        schema = f" --schema {self.schema}" if self.schema else ""
        return f"langgraph-fence migrate --db {self.masked}{schema}"


def check_sqlite_file(target: Target, *, must_exist: bool) -> None:
    """Refuse a SQLite ``--db`` whose folder is missing (or file, when ``must_exist``).

    Raises:
        ValueError: ``--db`` is not a supported URL, or names a SQLite file whose folder
            (or the file itself) is missing, saying what to do. A PostgreSQL URL, or an
            in-memory SQLite one, passes.
    """
    try:
        parsed = normalize_url(target.url)
    except ValueError as exc:
        raise ValueError(f"--db: {exc}") from None
    check_sqlite_folder(parsed, name="--db")
    path = parsed.database or ""
    if parsed.get_backend_name() != "sqlite" or path in ("", ":memory:"):
        return
    if path.startswith("file:"):
        return  # a URI filename: SQLite parses it, we do not guess
    if must_exist and not os.path.exists(path):
        raise ValueError(
            f"--db: there is no SQLite file {path}: fix the path in --db, or create the "
            f"database first with `{target.migrate_command()}`"
        )


def explain_database_error(exc: BaseException, target: Target) -> str | None:
    """One line saying what went wrong with the database at ``target`` and how to fix it,
    or ``None`` when ``exc`` is none of the errors this module knows."""
    # Every link is looked at: the driver's own error, innermost, carries the SQLSTATE.
    for error in linked_errors(exc):
        found = _explain_one(error, target)
        if found is not None:
            return found
    return None


def _explain_one(error: BaseException, target: Target) -> str | None:
    url = normalize_url(target.url)
    where = f"{url.host or 'localhost'}:{url.port or 5432}"
    sqlstate = getattr(error, "sqlstate", None)
    text = str(error).splitlines()[0] if str(error) else ""
    if isinstance(error, socket.gaierror):
        return (
            f"cannot resolve the host {url.host!r} of --db {target.masked} ({error.strerror}): "
            "fix the host name in --db"
        )
    if isinstance(error, ConnectionRefusedError):
        what = "it refused the connection"
    elif isinstance(error, TimeoutError):
        what = "the connection timed out"
    elif isinstance(error, ConnectionError) or (
        type(error) is OSError and "Connect call failed" in text
    ):
        what = text  # "rejected SSL upgrade", or every address of a name refused
    else:
        what = ""
    if what:
        return (
            f"cannot connect to PostgreSQL at {where}: {what}; is the server running, and "
            "are the host and port in --db right?"
        )
    if sqlstate == _INVALID_CATALOG:
        return (
            f"PostgreSQL at {where} has no database {url.database!r} ({text}): create it "
            f"(createdb -h {url.host or 'localhost'} {url.database}) or fix the database name "
            "in --db"
        )
    if sqlstate in _AUTH:
        return (
            f"PostgreSQL at {where} refused the login of {url.username!r} ({text}): create "
            "the role or fix the user and password in --db"
        )
    if sqlstate == _INVALID_SCHEMA:
        if target.schema is None:
            return (
                f"no schema of the role's search_path exists in the database {target.masked} "
                f"({text}): create one (CREATE SCHEMA ...) or name one with --schema"
            )
        return (
            f"schema {target.schema!r} does not exist in the database {target.masked} "
            f"({text}): create it (CREATE SCHEMA ...) or fix --schema"
        )
    if (sqlstate == _UNDEFINED_TABLE or text.startswith("no such table:")) and "fence_" in text:
        schema = f" (schema {target.schema})" if target.schema else ""
        return (
            f"the database {target.masked}{schema} has no langgraph-fence tables ({text}): "
            f"create them with `{target.migrate_command()}`, or fix --db / --schema"
        )
    if text in ("unable to open database file", "file is not a database"):
        return (
            f"cannot open the SQLite database {url.database} ({text}): check it is a SQLite "
            "file this user may read and write, and its folder exists"
        )
    return None

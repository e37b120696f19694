"""What langgraph-fence lets out of an error: stored reasons and echoed URLs, redacted.

A lease's ``reason`` is read by whoever can run ``langgraph-fence executions``, and kept
until the execution is erased. An exception's text is not fit for that as it is: a
SQLAlchemy error carries the statement and its bound parameters (``[SQL: ...]``,
``[parameters: {'card': '4111...'}]``), a driver's message quotes the value it refused
(asyncpg's ``invalid input for query argument $1: '4111-...'``, PostgreSQL's ``invalid input
syntax for type bigint: "4111-..."``), a message may quote a DSN with its password, and it
can be megabytes long. :func:`failure_reason` is the one place where an exception becomes a
stored reason; :func:`mask_password` the one place a URL's password is masked in text that
is not a parsed URL.

Everything here runs in time linear in the length of its input, and a reason's work is
bounded before anything is redacted: whatever a failure's message, making its reason reads
at most :data:`REASON_WINDOW_CHARS` characters past its first non-blank one.
"""

from __future__ import annotations

import re

__all__ = [
    "REASON_MAX_CHARS",
    "REASON_WINDOW_CHARS",
    "bounded_reason",
    "failure_reason",
    "mask_password",
    "redacted_text",
]

#: The longest reason :func:`failure_reason` returns (longer ones end with "...").
REASON_MAX_CHARS = 500

#: How much of a message a reason is made from, from its first non-blank character on: the
#: bound applied before any redaction (so a message of any length costs the same).
REASON_WINDOW_CHARS = 4 * REASON_MAX_CHARS

# SQLAlchemy appends these to a DBAPIError's message, each on a line of its own; a part is
# cut to the end of its line (over-cutting a reason is safe, leaking a parameter is not).
_SQLALCHEMY_PARTS = re.compile(
    r"\[(?:SQL|parameters|generated in|cached since)\b[^\n]*"
    r"|\(Background on this error at:[^)\n]*\)?"
)
# user:password@ anywhere (a URL, or a mistyped one that no parser accepts): the user stays,
# it says which account; over-masking "a:b@c" in other text is the safe way to be wrong.
# The look-behind starts a match only where a user part can start (the text's start, or
# after a character neither part may hold): a user part always runs from there, so no
# match is lost, and each character is scanned a bounded number of times (linear time; the
# unanchored form rescanned the rest of a word from each of its characters: quadratic).
_URL_PASSWORD = re.compile(r"(?<![^\s/@'\"])(?P<head>[^\s:/@'\"]*:)[^\s@'\"/]*(?P<at>@)")
# Text a database driver wrote: its quoted values are the refused parameters or row values.
_DRIVER_TEXT = re.compile(
    r"\((?:sqlalchemy|sqlite3|asyncpg|psycopg)[\w.]*\)|asyncpg\.|psycopg|query argument \$\d"
    r"|invalid input (?:syntax|value)|for type \w+:",
    re.IGNORECASE,
)
# asyncpg names the bad argument, then its value, quoted (a str) or not (a number).
_QUERY_ARGUMENT = re.compile(r"(query argument \$\d+:)[^\n]*")
# A quoted span, or an unclosed quote to the end of the text.
_QUOTED = re.compile(r"'[^'\n]*(?:'|\Z)|\"[^\"\n]*(?:\"|\Z)")
# SQLAlchemy names the driver's class as "<class 'asyncpg.exceptions.DataError'>".
_CLASS_NAME = re.compile(r"<class '(?:[\w]+\.)*(\w+)'>")
# A card number's shape: 13 or more digits, each pair at most one space or dash apart.
_CARD_SHAPED = re.compile(r"\d(?:[ -]?\d){12,}")
_SQLSTATE = re.compile(r"[0-9A-Z]{5}|SQLITE_[A-Z_]+")
# Modules whose errors are a database driver's (their messages quote values).
_DRIVER_MODULES = ("sqlite3", "_sqlite3", "aiosqlite", "asyncpg", "psycopg", "psycopg2")


def mask_password(text: str) -> str:
    """``text`` with the password of every ``user:password@host`` in it masked (``***``).

    Linear in the length of ``text``.
    """
    return _URL_PASSWORD.sub(r"\g<head>***\g<at>", text)


def _cut_driver_values(line: str) -> str:
    """``line`` without the values a driver quoted (each becomes ``'?'``)."""
    line = _CLASS_NAME.sub(r"\1", line)
    line = _QUERY_ARGUMENT.sub(r"\1 (value not kept)", line)
    return _QUOTED.sub("'?'", line)


def _first_line(text: str) -> tuple[str, bool]:
    """The first non-blank line of ``text`` read within the window, SQLAlchemy's parts cut,
    and whether the line went on past the window."""
    start = re.search(r"\S", text)
    if start is None:
        return "", False
    window = text[start.start() : start.start() + REASON_WINDOW_CHARS]
    cut_off = len(text) - start.start() > len(window)
    lines = _SQLALCHEMY_PARTS.sub("", window).splitlines()
    for index, line in enumerate(lines):
        if line.strip():
            return line.strip(), cut_off and index == len(lines) - 1
    return "", cut_off


def bounded_reason(text: str, *, driver: bool = False) -> str:
    """``text`` as a stored reason: its first line, SQLAlchemy's quoted parts cut, URL
    passwords masked, card-number-shaped digits masked, at most :data:`REASON_MAX_CHARS`
    characters.

    Bounded first (at most :data:`REASON_WINDOW_CHARS` characters are read past the first
    non-blank one), then redacted, in linear time: a message of any length costs the same.
    Where ``driver`` is true, or the line reads as a database driver's message, every quoted
    value in it is cut (``'?'``), and so is the value after asyncpg's ``query argument $N:``.
    """
    line, cut_off = _first_line(text)
    if driver or _DRIVER_TEXT.search(line):
        line = _cut_driver_values(line)
    reason = _CARD_SHAPED.sub("[number]", mask_password(line))
    if cut_off and len(reason) <= REASON_MAX_CHARS:
        # Redaction shortened the line enough to show its end, which the window cut: its
        # last word may be the start of a secret whose end (the "@" of a password, more
        # digits) lay past the window. Keep whole words only.
        reason = reason[: max(reason.rfind(" "), 0)].rstrip() + "..."
    if len(reason) > REASON_MAX_CHARS:
        reason = reason[: REASON_MAX_CHARS - 3].rstrip() + "..."
    return reason


def redacted_text(text: str, *, limit: int) -> str:
    """``text`` as an operator may see it (a recorded input, a config): at most ``limit``
    characters of it (``...`` where it was cut), URL passwords and card-number-shaped
    digits masked, as :func:`bounded_reason` masks them, in linear time."""
    cut = len(text) > limit
    shown = text[:limit]
    shown = _CARD_SHAPED.sub("[number]", mask_password(shown))
    return shown + ("..." if cut else "")


def _is_driver_error(exc: BaseException) -> bool:
    """Whether ``exc`` is a database driver's error, or SQLAlchemy's around one (whose
    message repeats the driver's)."""
    for cls in type(exc).__mro__:
        module = cls.__module__
        if module.split(".")[0] in _DRIVER_MODULES or module.startswith(
            ("sqlalchemy.dialects", "sqlalchemy.connectors")
        ):
            return True
        if module == "sqlalchemy.exc" and cls.__name__ == "StatementError":
            return True
    return False


def _sqlstate(exc: BaseException) -> str | None:
    """The SQLSTATE (PostgreSQL) or error name (SQLite) a driver gave ``exc``, if any."""
    seen: list[BaseException] = []
    todo: list[BaseException | None] = [exc]
    while todo and len(seen) < 8:
        error = todo.pop(0)
        if error is None or any(error is s for s in seen):
            continue
        seen.append(error)
        for name in ("sqlstate", "pgcode", "sqlite_errorname"):
            code = getattr(error, name, None)
            if isinstance(code, str) and _SQLSTATE.fullmatch(code):
                return code
        orig = getattr(error, "orig", None)
        todo.extend([orig if isinstance(orig, BaseException) else None, error.__cause__])
    return None


def failure_reason(exc: BaseException, *, prefix: str = "") -> str:
    """The reason stored for a failure: bounded, and free of what the driver quoted.

    ``"<ExceptionType>: <first line of the message>"`` (see :func:`bounded_reason`). For a
    database driver's error (or SQLAlchemy's around one) every quoted value of the message
    is cut and its SQLSTATE (PostgreSQL) or error name (SQLite) is named:
    ``"DataError (SQLSTATE 22P02): ... for type bigint: '?'"``. Never holds a driver's quoted
    parameter or value, a URL's password or a card-number-shaped run of digits.

    Args:
        exc: the error.
        prefix: what failed, put before the type (e.g. "the record cannot be decoded: ").
    """
    driver = _is_driver_error(exc)
    first = bounded_reason(str(exc), driver=driver)
    code = _sqlstate(exc) if driver else None
    if code is not None and not code.startswith("SQLITE_"):
        code = f"SQLSTATE {code}"
    kind = type(exc).__name__ + (f" ({code})" if code else "")
    return bounded_reason(f"{prefix}{kind}" + (f": {first}" if first else ""), driver=driver)

"""What langgraph-fence lets out of an error: stored reasons and echoed URLs, redacted.

A lease's ``reason`` is read by whoever can run ``langgraph-fence executions``, and kept
until the execution is erased. An exception's text is not fit for that as it is: a
SQLAlchemy error carries the statement and its bound parameters (``[SQL: ...]``,
``[parameters: {'card': '4111...'}]``), a driver error may quote a DSN with its password,
and a message can be megabytes long. :func:`failure_reason` is the one place where an
exception becomes a stored reason; :func:`mask_password` the one place a URL's password is
masked in text that is not a parsed URL.
"""

from __future__ import annotations

import re

__all__ = ["REASON_MAX_CHARS", "bounded_reason", "failure_reason", "mask_password"]

#: The longest reason :func:`failure_reason` returns (longer ones end with "...").
REASON_MAX_CHARS = 500

# SQLAlchemy appends these to a DBAPIError's message, each on a line of its own; a part is
# cut to the end of its line (over-cutting a reason is safe, leaking a parameter is not).
_SQLALCHEMY_PARTS = re.compile(
    r"\[(?:SQL|parameters|generated in|cached since)\b[^\n]*|\(Background on this error at:[^)]*\)"
)
# user:password@ anywhere (a URL, or a mistyped one that no parser accepts): the user stays,
# it says which account; over-masking "a:b@c" in other text is the safe way to be wrong.
_URL_PASSWORD = re.compile(r"(?P<head>[^\s:/@'\"]*:)[^\s@'\"/]*(?P<at>@)")


def mask_password(text: str) -> str:
    """``text`` with the password of every ``user:password@host`` in it masked (``***``)."""
    return _URL_PASSWORD.sub(r"\g<head>***\g<at>", text)


def bounded_reason(text: str) -> str:
    """``text`` as a stored reason: its first line, SQLAlchemy's quoted parts cut, URL
    passwords masked, at most :data:`REASON_MAX_CHARS` characters."""
    cut = _SQLALCHEMY_PARTS.sub("", text)
    first = next((line.strip() for line in cut.splitlines() if line.strip()), "")
    reason = mask_password(first)
    if len(reason) > REASON_MAX_CHARS:
        reason = reason[: REASON_MAX_CHARS - 3].rstrip() + "..."
    return reason


def failure_reason(exc: BaseException, *, prefix: str = "") -> str:
    """The reason stored for a failure: bounded, and free of what the driver quoted.

    ``"<ExceptionType>: <first line of the message>"`` (see :func:`bounded_reason`).

    Args:
        exc: the error.
        prefix: what failed, put before the type (e.g. "the record cannot be decoded: ").
    """
    first = bounded_reason(str(exc))
    return bounded_reason(f"{prefix}{type(exc).__name__}" + (f": {first}" if first else ""))

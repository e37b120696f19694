"""Checks of the ids, names and numbers the public API takes, made before anything is written.

Every entry point (``Instance``, ``Instance.open``, ``ainvoke``/``astream``, ``serve``, the
stores, the sink) checks its arguments here, so a value is accepted or refused the same way
on every store: what SQLite would keep but PostgreSQL refuses (a NUL character in text), and
what no driver can encode (a lone surrogate), is refused up front with a ``ValueError`` that
names the argument and the fix, never a driver error after a first row was written.
"""

from __future__ import annotations

import math

__all__ = [
    "MAX_COUNT",
    "MAX_ID_BYTES",
    "MAX_SECONDS",
    "MAX_STORE_KEY_BYTES",
    "MAX_STORE_NAMESPACE_BYTES",
    "positive_int",
    "positive_seconds",
    "storable_text",
    "store_key",
    "store_namespace",
    "text_id",
]

#: The longest duration accepted (about 31 years): beyond it a deadline is no deadline, and
#: timers and the databases' interval arithmetic overflow.
MAX_SECONDS = 1e9
#: The largest count accepted: it fits a 32-bit INTEGER column on every store.
MAX_COUNT = 2**31 - 1
#: The longest tenant, execution or thread id, in bytes of UTF-8: a lease's key, its scope
#: key (each byte of a non-ASCII character percent-encoded: up to three characters) and a
#: checkpoint's key then fit PostgreSQL's B-tree entry limit (2,704 bytes) with room.
MAX_ID_BYTES = 256
#: The longest store namespace (its labels joined by ".") and item key, in bytes of UTF-8:
#: an item's primary key (tenant, namespace, key) fits PostgreSQL's B-tree entry limit.
MAX_STORE_NAMESPACE_BYTES = 512
MAX_STORE_KEY_BYTES = 1024


def text_id(name: str, value: object, *, what: str = "an id", max_bytes: int | None = None) -> str:
    """``value`` if it is a non-empty ``str`` every store can keep, else ``ValueError``.

    Refused: a non-``str``, the empty string, what :func:`storable_text` refuses, and
    (with ``max_bytes``) a value longer than that in UTF-8.

    Args:
        name: the argument's name, as the caller wrote it (``"config['configurable']
            ['thread_id']"``), for the message.
        value: the value given.
        what: what the value is, for the message (``"the tenant the run belongs to"``).
        max_bytes: the longest value accepted, in bytes of UTF-8 (e.g. :data:`MAX_ID_BYTES`).
    """
    if not isinstance(value, str) or not value:
        raise ValueError(f"{name} must be a non-empty str ({what}), got {value!r}")
    storable_text(name, value)
    if max_bytes is not None:
        _at_most(name, value, max_bytes, what)
    return value


def _at_most(name: str, value: str, max_bytes: int, what: str) -> None:
    # Only a value that could be too long is encoded (at most 4 bytes per character).
    if len(value) * 4 > max_bytes and len(value.encode("utf-8")) > max_bytes:
        raise ValueError(
            f"{name} must be at most {max_bytes} bytes of UTF-8 ({what}), got "
            f"{len(value.encode('utf-8'))} bytes starting {value[:40]!r}: use a shorter id "
            "(e.g. a hash of it)"
        )


def store_namespace(name: str, namespace: object) -> tuple[str, ...]:
    """``namespace`` if it is a tuple of labels every store can keep, else ``ValueError``.

    Refused: a non-tuple, a label that is not a ``str``, is empty or holds a period
    (LangGraph's own rules), what :func:`storable_text` refuses, and labels joined longer
    than :data:`MAX_STORE_NAMESPACE_BYTES`. The empty tuple is accepted (a search of
    everything).
    """
    if not isinstance(namespace, tuple):
        raise ValueError(f"{name} must be a tuple of str labels, got {type(namespace).__name__}")
    for label in namespace:
        if not isinstance(label, str) or not label or "." in label:
            raise ValueError(
                f"{name} labels must be non-empty str without a period, got {label!r} in {name}"
            )
        storable_text(name, label)
    _at_most(name, ".".join(namespace), MAX_STORE_NAMESPACE_BYTES, "its labels joined by '.'")
    return namespace


def store_key(name: str, key: object) -> str:
    """``key`` if it is a ``str`` every store can keep, at most
    :data:`MAX_STORE_KEY_BYTES` long, else ``ValueError`` naming ``name`` and the limit."""
    if not isinstance(key, str):
        raise ValueError(f"{name} must be a str, got {type(key).__name__}")
    storable_text(name, key)
    _at_most(name, key, MAX_STORE_KEY_BYTES, "an item's key")
    return key


def storable_text(name: str, value: str) -> str:
    """``value`` if every store can keep it (the empty string too), else ``ValueError``:
    a NUL character (PostgreSQL's TEXT cannot hold it, SQLite would cut the value there)
    or a lone surrogate (no UTF-8 encoder can write it)."""
    if "\x00" in value:
        raise ValueError(
            f"{name} must not contain a NUL byte (PostgreSQL text cannot hold it), "
            f"got {value!r}: remove it, or encode the id (e.g. hex or base64) first"
        )
    try:
        value.encode("utf-8")
    except UnicodeEncodeError as exc:
        raise ValueError(
            f"{name} contains a lone surrogate ({exc.object[exc.start : exc.end]!r}), which "
            f"no database driver can store: pass valid unicode text, got {value!r}"
        ) from None
    return value


def positive_seconds(name: str, value: object, *, what: str = "") -> float:
    """``value`` as a float of seconds if it is a finite number in (0, :data:`MAX_SECONDS`].

    Args:
        name: the argument's name, for the message.
        value: an ``int`` or ``float`` (not a ``bool``).
        what: what the duration is, for the message.
    """
    about = f" ({what})" if what else ""
    wanted = f"{name} must be a positive number of seconds{about}, at most {MAX_SECONDS:g}"
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise ValueError(f"{wanted}, got {value!r}")
    try:
        seconds = float(value)
    except OverflowError:  # an int too large for a float
        raise ValueError(f"{wanted}, got an int of {len(str(value))} digits") from None
    if not math.isfinite(seconds) or not 0 < seconds <= MAX_SECONDS:
        raise ValueError(f"{wanted}, got {value!r}")
    return seconds


def positive_int(name: str, value: object, *, what: str = "") -> int:
    """``value`` if it is an ``int`` (not a ``bool``) in [1, 2**31 - 1], else ``ValueError``.

    Args:
        name: the argument's name, for the message.
        value: the value given.
        what: what it counts, for the message.
    """
    if isinstance(value, bool) or not isinstance(value, int) or not 1 <= value <= MAX_COUNT:
        about = f" ({what})" if what else ""
        shown = repr(value) if not isinstance(value, int) or value < 10**12 else "a huge int"
        raise ValueError(f"{name} must be an int >= 1{about}, at most {MAX_COUNT}, got {shown}")
    return value

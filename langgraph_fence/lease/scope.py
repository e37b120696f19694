"""Scope keys: one string per execution that names its tenant and id without collisions.

Each part is encoded exactly as JavaScript's ``encodeURIComponent`` encodes it (UTF-8,
everything but ``A-Z a-z 0-9 - _ . ! ~ * ' ( )`` percent-escaped) and the parts are joined by
``:``. Plain and UUID ids come out unchanged, a ``:`` inside a part is always escaped, and no
key ever contains a NUL byte (PostgreSQL refuses NUL in TEXT).
"""

from __future__ import annotations

from urllib.parse import quote, unquote

__all__ = [
    "CHILD_ID_PREFIX",
    "encode_part",
    "parse_scope_key",
    "refuse_child_ids",
    "scope_key",
]

# The characters encodeURIComponent leaves alone, beyond ASCII letters and digits
# (which urllib.parse.quote never escapes).
_UNRESERVED = "-_.!~*'()"


def encode_part(value: str, *, name: str = "part") -> str:
    """Encode one part as ``encodeURIComponent`` does; refuse empty and non-string parts."""
    if not isinstance(value, str):
        raise ValueError(f"{name} must be a non-empty str, got {type(value).__name__}")
    if not value:
        raise ValueError(f"{name} must be a non-empty str, got ''")
    try:
        return quote(value, safe=_UNRESERVED, encoding="utf-8", errors="strict")
    except UnicodeEncodeError as exc:
        raise ValueError(
            f"{name} contains a lone surrogate ({exc.object[exc.start : exc.end]!r}); "
            "encodeURIComponent refuses it too: pass valid unicode text"
        ) from None


def scope_key(tenant_id: str, execution_id: str, *more: str) -> str:
    """Return the scope key of ``(tenant_id, execution_id, *more)``.

    Raises:
        ValueError: a part is empty or not a ``str`` (the message names the argument).
    """
    parts = [
        encode_part(tenant_id, name="tenant_id"),
        encode_part(execution_id, name="execution_id"),
    ]
    parts.extend(encode_part(p, name=f"more[{i}]") for i, p in enumerate(more))
    return ":".join(parts)


def parse_scope_key(key: str) -> tuple[str, ...]:
    """Decode a scope key back into its parts: ``parse_scope_key(scope_key(*p)) == p``.

    Raises:
        ValueError: ``key`` is not a scope key (not a ``str``, fewer than two parts, an empty
            part, or an invalid escape).
    """
    if not isinstance(key, str) or not key:
        raise ValueError(f"key must be a non-empty str, got {key!r}")
    raw_parts = key.split(":")
    if len(raw_parts) < 2 or any(not p for p in raw_parts):
        raise ValueError(f"key {key!r} is not a scope key: expected 'tenant:execution[:...]'")
    parts: list[str] = []
    for raw in raw_parts:
        try:
            decoded = unquote(raw, encoding="utf-8", errors="strict")
        except UnicodeDecodeError:
            raise ValueError(f"key {key!r} has an invalid percent-escape in {raw!r}") from None
        if encode_part(decoded) != raw:
            raise ValueError(f"key {key!r} is not canonically encoded at {raw!r}")
        parts.append(decoded)
    return tuple(parts)


#: Every child execution id starts with this, and no id of a run of your own may: a thread
#: named like a child is refused, never adopted as one.
CHILD_ID_PREFIX = "lgf-child:"


def refuse_child_ids(thread_id: str, execution_id: str | None) -> None:
    """Refuse a run of your own (``ainvoke``, ``submit``, ...) whose thread id or
    ``execution_id`` is in the namespace of child execution ids.

    Raises:
        ValueError: one starts with :data:`CHILD_ID_PREFIX`, naming the argument and the fix.
    """
    given = [("config['configurable']['thread_id']", thread_id), ("execution_id", execution_id)]
    for name, value in given:
        if isinstance(value, str) and value.startswith(CHILD_ID_PREFIX):
            raise ValueError(
                f"{name} is {value!r}: ids starting with {CHILD_ID_PREFIX!r} are reserved "
                "for child executions (ctx.spawn_child names them): choose another id for a "
                "run of your own"
            )

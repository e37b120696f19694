"""Scope keys: one string per execution that names its tenant and id without collisions.

Each part is encoded exactly as JavaScript's ``encodeURIComponent`` encodes it (UTF-8,
everything but ``A-Z a-z 0-9 - _ . ! ~ * ' ( )`` percent-escaped) and the parts are joined by
``:``. Plain and UUID ids come out unchanged, a ``:`` inside a part is always escaped, and no
key ever contains a NUL byte (PostgreSQL refuses NUL in TEXT).
"""

from __future__ import annotations

from urllib.parse import quote, unquote

__all__ = ["encode_part", "parse_scope_key", "scope_key"]

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

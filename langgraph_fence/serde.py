"""Safe loading: what a stored payload may construct when it is decoded.

LangGraph's ``JsonPlusSerializer`` decodes msgpack extension types by importing and calling
the ``module.name`` the payload names; by default (langgraph-checkpoint 4.3) it does so for
ANY name, with a warning. A row written by anyone who can write to the database (a crafted
execution record, a crafted checkpoint blob) then runs code on the worker that loads it.

Here every serializer langgraph-fence makes is LangGraph's strict mode whatever
``LANGGRAPH_STRICT_MSGPACK`` says: only LangGraph's ``SAFE_MSGPACK_TYPES`` are constructed,
plus what a caller allows (``allowed_msgpack_modules``) and what LangGraph's
``compile()`` derives from the graph's schemas in strict mode (``with_allowlist``). A name
outside the list is never imported or called.

Checkpoints keep LangGraph's behaviour for a refused name (the raw payload is returned in
the object's place). Execution records are stricter (:func:`loads_checked`): a record that
names a refused type, or cannot be decoded at all, is an error, so the execution is
dead-lettered with that reason instead of run on garbage input.
"""

from __future__ import annotations

from collections.abc import Collection, Iterable
from contextvars import ContextVar
from typing import Any

from langgraph.checkpoint.serde.base import SerializerProtocol
from langgraph.checkpoint.serde.event_hooks import SerdeEvent, register_serde_event_listener
from langgraph.checkpoint.serde.jsonplus import JsonPlusSerializer

__all__ = [
    "graph_allowlist",
    "loads_checked",
    "safe_serializer",
    "strict_serde",
    "with_allowlist",
]

_BLOCKED_KINDS = frozenset({"msgpack_blocked", "msgpack_method_blocked"})
#: The names refused while the current :func:`loads_checked` call decodes (None elsewhere).
_refused: ContextVar[list[str] | None] = ContextVar("langgraph_fence_refused", default=None)


def _on_serde_event(event: SerdeEvent) -> None:
    refused = _refused.get()
    if refused is not None and event.get("kind") in _BLOCKED_KINDS:
        parts = [event.get("module", "?"), event.get("name", "?")]
        if "method" in event:
            parts.append(event["method"])
        refused.append(".".join(str(part) for part in parts))


# Process-wide and never removed: it does nothing outside a loads_checked() call.
register_serde_event_listener(_on_serde_event)


def safe_serializer(
    allowed_msgpack_modules: Iterable[tuple[str, ...] | type] | None = None,
) -> JsonPlusSerializer:
    """LangGraph's serializer in strict msgpack mode, whatever the environment says.

    Args:
        allowed_msgpack_modules: ``(module, name)`` pairs (or classes) a payload may
            construct besides LangGraph's ``SAFE_MSGPACK_TYPES``.
    """
    allowed = tuple(allowed_msgpack_modules) if allowed_msgpack_modules is not None else ()
    return JsonPlusSerializer(allowed_msgpack_modules=allowed or None)


def strict_serde(serde: SerializerProtocol) -> SerializerProtocol:
    """``serde`` made to decode as :func:`safe_serializer` does: what a foreign saver wrapped
    by :class:`~langgraph_fence.FencedCheckpointer` decodes with.

    A LangGraph ``JsonPlusSerializer`` that would construct any ``module.name`` a payload
    names (``allowed_msgpack_modules=True``, LangGraph's default without
    ``LANGGRAPH_STRICT_MSGPACK``), unpickle (``pickle_fallback=True``) or load any JSON
    constructor (``allowed_json_modules=True``) is replaced by one in strict mode that keeps
    its explicit allow-lists; an ``EncryptedSerializer`` keeps its cipher over a strict
    inner serializer. It encodes as before, so what the saver stored stays readable. Any
    other serializer (your own class, a ``JsonPlusSerializer`` with a custom ext hook) is
    returned as it is: its decoding is its own.
    """
    from langgraph.checkpoint.serde.encrypted import EncryptedSerializer

    from langgraph_fence._compat import jsonplus_settings

    if isinstance(serde, EncryptedSerializer):
        inner = strict_serde(serde.serde)
        return serde if inner is serde.serde else EncryptedSerializer(serde.cipher, inner)
    if not isinstance(serde, JsonPlusSerializer):
        return serde
    custom_hook, msgpack, json_modules = jsonplus_settings(serde)
    if custom_hook:
        return serde
    if msgpack is not True and json_modules is not True and not serde.pickle_fallback:
        return serde  # strict already
    return JsonPlusSerializer(
        allowed_msgpack_modules=None if msgpack is True else (tuple(msgpack or ()) or None),
        allowed_json_modules=None if json_modules is True else json_modules,
    )


def with_allowlist(
    serde: SerializerProtocol, allow: Collection[tuple[str, ...]]
) -> SerializerProtocol:
    """``serde`` allowing ``allow`` too (a LangGraph ``JsonPlusSerializer``; any other
    serializer has no msgpack allow-list and is returned as it is)."""
    if allow and isinstance(serde, JsonPlusSerializer):
        return serde.with_msgpack_allowlist(allow)
    return serde


def graph_allowlist(graph: Any) -> frozenset[tuple[str, ...]]:
    """The types LangGraph's ``compile()`` allowed for ``graph``'s state under strict msgpack.

    ``compile()`` derives them from the graph's schemas when ``LANGGRAPH_STRICT_MSGPACK`` is
    set and keeps them on the compiled graph (``_serde_allowlist``, not a public name: empty
    when absent, so a change in LangGraph makes this stricter, never looser).
    """
    from langgraph_fence._compat import compiled_serde_allowlist

    found = compiled_serde_allowlist(graph)
    if not isinstance(found, set | frozenset):
        return frozenset()
    return frozenset(item for item in found if isinstance(item, tuple))


def loads_checked(serde: SerializerProtocol, typed: tuple[str, bytes], *, what: str) -> Any:
    """Decode ``typed`` with ``serde``; refuse a payload the serializer would not fully rebuild.

    Args:
        serde: the serializer (its allow-list decides what may be constructed).
        typed: ``(type, bytes)`` as ``dumps_typed`` made them.
        what: what the payload is, for the message (e.g. "the record of execution 'a:b'").

    Raises:
        ValueError: the payload names a type or method outside the serializer's allow-list
            (nothing of it was imported or called), or cannot be decoded at all (an unknown
            serialization type such as ``pickle``, corrupt bytes).
    """
    refused: list[str] = []
    reset = _refused.set(refused)
    try:
        value = serde.loads_typed(typed)
    except Exception as exc:
        raise ValueError(
            f"{what} cannot be decoded ({typed[0]!r}): {type(exc).__name__}: {exc}"
        ) from exc
    finally:
        _refused.reset(reset)
    if refused:
        names = ", ".join(sorted(set(refused)))
        raise ValueError(
            f"{what} names {names}, which the serializer's allow-list does not admit; nothing "
            "of it was imported or called. If the type is yours and the row trusted, allow it: "
            "serde=JsonPlusSerializer(allowed_msgpack_modules=[(module, name)])"
        )
    return value

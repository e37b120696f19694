"""Whether a value fulfils one of the contracts (``typing.Protocol`` classes) the package takes.

``isinstance(value, SomeProtocol)`` answers differently across the Pythons the package supports:
from 3.12 on it looks members up with ``inspect.getattr_static``, so a wrapper that delegates
to the object it wraps through ``__getattr__`` (an instrumenting or retrying wrapper around a
lease store) is refused on 3.12 and 3.13 and accepted on 3.11. The package checks its
arguments with :func:`require_implements` instead: a contract's members are looked up with
``getattr``, the way the package will call them, so the answer is the same on every Python
and a delegating wrapper is as good as the object it delegates to.
"""

from __future__ import annotations

import inspect
from typing import Any, Generic, Protocol

__all__ = ["missing_members", "require_implements"]

_NOT_MEMBERS = (object, Protocol, Generic)


def _members(protocol: type) -> list[str]:
    """The public members ``protocol`` declares (methods, properties, annotated attributes),
    its own and those of the protocols it extends."""
    names: set[str] = set()
    for cls in protocol.__mro__:
        if cls in _NOT_MEMBERS:
            continue
        names.update(vars(cls))
        names.update(getattr(cls, "__annotations__", {}))
    return sorted(name for name in names if not name.startswith("_"))


def missing_members(value: object, protocol: type) -> list[str]:
    """The members of ``protocol`` that ``value`` lacks, found with ``getattr``.

    A member is missing when ``getattr(value, name)`` raises ``AttributeError``, or when the
    contract declares a method there and the value's attribute is not callable. An empty list:
    ``value`` can be used wherever ``protocol`` is expected, on every supported Python.
    """
    missing: list[str] = []
    for name in _members(protocol):
        try:
            found = getattr(value, name)
        except AttributeError:
            missing.append(name)
            continue
        declared: Any = inspect.getattr_static(protocol, name, None)
        if inspect.isfunction(declared) and not callable(found):
            missing.append(name)
    return missing


def require_implements(value: object, protocol: type, *, argument: str) -> None:
    """Refuse ``value`` for ``argument`` unless it has every member of ``protocol``.

    Raises:
        ValueError: naming ``argument``, the contract, and each member ``value`` lacks.
    """
    missing = missing_members(value, protocol)
    if missing:
        raise ValueError(
            f"{argument} must implement {protocol.__name__}, got {type(value).__name__} "
            f"without {', '.join(missing)}: implement {'them' if len(missing) > 1 else 'it'}, "
            "or delegate to an object that does (a wrapper's __getattr__ counts)"
        )

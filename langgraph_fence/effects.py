"""What a step does to the world, and whether repeating it is safe."""

from __future__ import annotations

import enum
from collections.abc import Iterable
from typing import Literal, Protocol, TypeAlias, TypeVar

__all__ = ["EFFECT_ATTRIBUTE", "Effect", "EffectLike", "as_effect", "standing_non_idempotent"]

#: Set on a function wrapped by ``fenced`` and on the class of a fenced tool: its declared
#: :class:`Effect`. ``fence_graph`` and ``fence_tools`` read it to keep what was declared.
EFFECT_ATTRIBUTE = "__langgraph_fence_effect__"


class Effect(enum.StrEnum):
    """The side effect a node or tool may have.

    ``READ_ONLY`` steps are never stamped (repeating them is always safe). Before an
    ``IDEMPOTENT_WRITE`` or ``NON_IDEMPOTENT_WRITE`` step's body runs, the instance adds an
    entry for it to the lease's stamp set and renews, in one guarded write; a run found with
    any ``NON_IDEMPOTENT_WRITE`` entry standing is dead-lettered, never repeated.
    """

    READ_ONLY = "read_only"
    IDEMPOTENT_WRITE = "idempotent_write"
    NON_IDEMPOTENT_WRITE = "non_idempotent_write"

    @property
    def is_write(self) -> bool:
        """True for the effects that are stamped before they run."""
        return self is not Effect.READ_ONLY


#: What the public API takes where it asks for an effect: an :class:`Effect` or its value.
EffectLike: TypeAlias = "Effect | Literal['read_only', 'idempotent_write', 'non_idempotent_write']"


def as_effect(value: object, *, name: str = "effect") -> Effect:
    """``value`` as an :class:`Effect`: an ``Effect`` or its name as a string
    (``"non_idempotent_write"``); anything else is refused naming the valid ones."""
    if isinstance(value, Effect):
        return value
    if isinstance(value, str):
        try:
            return Effect(value)
        except ValueError:
            pass
    valid = ", ".join(f"Effect.{e.name} ({e.value!r})" for e in Effect)
    raise ValueError(f"{name} must be an Effect: one of {valid}; got {value!r}")


class Stamped(Protocol):
    """What the rule reads of a stamp entry (:class:`~langgraph_fence.lease.PendingEffect`)."""

    @property
    def task_id(self) -> str:
        """The task (or tool call) that made it."""

    @property
    def effect(self) -> Effect:
        """What the stamped write does."""


S = TypeVar("S", bound=Stamped)


def standing_non_idempotent(stamps: Iterable[S], task_id: str) -> S | None:
    """The refuse-to-repeat rule: of the entries a run stamped and has not seen cleared
    (``stamps``), a non-idempotent one of ``task_id``, if one stands. A step (or tool call)
    of that task must not run again: the write may have happened."""
    for stamp in stamps:
        if stamp.task_id == task_id and stamp.effect is Effect.NON_IDEMPOTENT_WRITE:
            return stamp
    return None

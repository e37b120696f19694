"""What a step does to the world, and whether repeating it is safe."""

from __future__ import annotations

import enum

__all__ = ["Effect", "may_retry_after_fence"]


class Effect(enum.StrEnum):
    """The side effect a node or tool may have.

    ``READ_ONLY`` steps are never stamped (repeating them is always safe). Before an
    ``IDEMPOTENT_WRITE`` or ``NON_IDEMPOTENT_WRITE`` step's body runs, the instance stamps the
    lease's ``pending_effect`` and renews it in one guarded write; a run found with a
    ``NON_IDEMPOTENT_WRITE`` stamp standing is dead-lettered, never repeated.
    """

    READ_ONLY = "read_only"
    IDEMPOTENT_WRITE = "idempotent_write"
    NON_IDEMPOTENT_WRITE = "non_idempotent_write"

    @property
    def is_write(self) -> bool:
        """True for the effects that are stamped before they run."""
        return self is not Effect.READ_ONLY


def may_retry_after_fence(effect: Effect | str | None) -> bool:
    """Whether a run found with this ``pending_effect`` stamp standing may be run again.

    Only a standing ``NON_IDEMPOTENT_WRITE`` forbids it: the write may already have happened.
    An unset or unknown value is retryable (the fail-safe default of an un-migrated row).
    """
    if effect is None:
        return True
    try:
        return Effect(effect) is not Effect.NON_IDEMPOTENT_WRITE
    except ValueError:
        return True

"""A submit's rules: what it may do on a busy thread (``on_busy``), the check that its input
can be recorded, and the refusals of a busy or dead-lettered thread."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Final, Literal

from langgraph_fence.errors import ExecutionBusyError, ExecutionEndedError
from langgraph_fence.lease import LeaseKey, LeaseStatus

if TYPE_CHECKING:
    from langgraph.checkpoint.serde.base import SerializerProtocol

__all__ = [
    "ON_BUSY",
    "OnBusy",
    "busy_error",
    "dead_lettered_error",
    "stored_input",
    "waiting_error",
]

OnBusy = Literal["reject", "enqueue", "interrupt"]
#: What a submit may do when the thread's execution is pending or running.
ON_BUSY: Final = ("reject", "enqueue", "interrupt")


def stored_input(serde: SerializerProtocol, input: Any, *, whose: str) -> tuple[str, bytes]:
    """``input`` as it is recorded (its type and bytes), checked to read back: a worker in
    another process runs it from the record.

    Raises:
        ValueError: it cannot be recorded (``whose`` names it); nothing was written.
    """
    from langgraph_fence.serde import loads_checked

    try:
        typed = serde.dumps_typed(input)
        loads_checked(serde, typed, what="the input")
    except Exception as exc:
        raise ValueError(
            f"{whose} cannot be recorded with the execution ({type(exc).__name__}: {exc}): "
            "a worker in another process runs it from the record, so it must be storable "
            "data (str, numbers, lists, dicts, or types LANGGRAPH_STRICT_MSGPACK allows). "
            "Refused before anything was written"
        ) from exc
    return typed[0], bytes(typed[1])


def busy_error(key: LeaseKey, status: str, holder: str | None, queued: int) -> ExecutionBusyError:
    """The refusal of a submit of other input to a busy thread (``on_busy="reject"``)."""
    who = f"running on {holder}" if status == "running" and holder else status
    if queued:
        who += f" with {queued} run(s) queued behind"
    return ExecutionBusyError(
        f"execution {key.scope_key!r} is {who}, with other input: refused (on_busy='reject'), "
        "nothing written. Wait for it (await instance.get_run(...).result()), submit with "
        "on_busy='enqueue' to run the new input after it, or with on_busy='interrupt' to "
        "fence it and run the new input next",
        scope_key=key.scope_key,
        status=status,
    )


def waiting_error(key: LeaseKey, status: str, *, pending: bool) -> ExecutionBusyError:
    """The refusal of a start of a thread on which submitted runs wait (one ``pending``, or
    some queued)."""
    what = "a submitted run waiting for a worker" if pending else "submitted runs queued"
    return ExecutionBusyError(
        f"execution {key.scope_key!r} has {what}: the start is refused, nothing written. "
        "Wait for it (await instance.get_run(...).result()), or submit the new input "
        "with on_busy='enqueue' or on_busy='interrupt'",
        scope_key=key.scope_key,
        status=status,
    )


def dead_lettered_error(key: LeaseKey, reason: str | None) -> ExecutionEndedError:
    """The refusal of a submit to a dead-lettered execution."""
    extra = f" ({reason})" if reason else ""
    return ExecutionEndedError(
        f"execution {key.scope_key!r} was dead-lettered{extra}: nothing was submitted. Inspect "
        "it with `langgraph-fence dead-letters`; `langgraph-fence resolve` decides it",
        status=LeaseStatus.DEAD_LETTERED.value,
        reason=reason,
    )

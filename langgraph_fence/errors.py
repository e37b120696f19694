"""Every error langgraph-fence raises on purpose, each with a stable ``code``.

A subclass's code extends its parent's with one more dot-segment, so a caller can match on
a prefix (``code.startswith("execution.lease-lost")``) as well as on the class.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any, ClassVar, TypeVar

E = TypeVar("E", bound=BaseException)

__all__ = [
    "ChildFailedError",
    "ExecutionBusyError",
    "ExecutionContextUnavailableError",
    "ExecutionDeadLetteredError",
    "ExecutionEndedError",
    "ExecutionFencedError",
    "ExecutionLeaseHeldError",
    "ExecutionLeaseLostError",
    "ExecutionSupersededError",
    "ExecutionThreadBoundError",
    "LangGraphFenceError",
    "RunFailedError",
    "WriteDeadLetteredError",
    "find_error",
    "find_fence_error",
    "linked_errors",
]


class LangGraphFenceError(Exception):
    """Base of every langgraph-fence error; ``code`` names the class in logs and APIs."""

    code: ClassVar[str] = "fence"
    #: The keyword-only attributes ``__init__`` takes besides the message: kept, with the
    #: instance dict (notes added on the way, attributes the runtime set), when the error
    #: crosses a process boundary (pickle).
    fields: ClassVar[tuple[str, ...]] = ()

    def __reduce__(self) -> str | tuple[Any, ...]:
        if not self.fields:
            return super().__reduce__()
        values = {name: getattr(self, name) for name in self.fields}
        return (_rebuild_two, (type(self), str(self), values), self.__dict__ or None)


class ExecutionLeaseLostError(LangGraphFenceError, RuntimeError):
    """The lease of an execution can no longer be proven held by this worker.

    Raised when renewals failed until the lease's confirmed window ran out: another worker may
    take the execution over at any moment, so nothing more may be written under this token.
    It is a ``RuntimeError`` so LangGraph's default ``RetryPolicy`` never retries it.

    Attributes:
        scope_key: the execution's scope key (see :func:`langgraph_fence.scope_key`).
        token_held: the epoch this worker held, or ``None`` if it held none.
        token_seen: the epoch the store reported, or ``None`` if it could not be read.
    """

    code: ClassVar[str] = "execution.lease-lost"
    fields = ("scope_key", "token_held", "token_seen")

    def __init__(
        self,
        message: str,
        *,
        scope_key: str | None = None,
        token_held: int | None = None,
        token_seen: int | None = None,
    ) -> None:
        super().__init__(message)
        self.scope_key = scope_key
        self.token_held = token_held
        self.token_seen = token_seen


class ExecutionFencedError(ExecutionLeaseLostError):
    """A write or a step was refused because the lease was taken over (a newer token exists).

    The holder of ``token_held`` must stop: another worker holds ``token_seen`` (or the lease
    moved on in a way this worker cannot outlive). It is never retried and never replaced by
    a cancellation: langgraph-fence re-raises this very object to the caller of the run.
    """

    code: ClassVar[str] = "execution.lease-lost.fenced"


class ExecutionContextUnavailableError(LangGraphFenceError, RuntimeError):
    """No held lease covers the caller: a fence used outside its step, or a node run bare."""

    code: ClassVar[str] = "execution.context-unavailable"


class ExecutionLeaseHeldError(LangGraphFenceError, RuntimeError):
    """Another live instance holds the execution's lease: nothing was run or written.

    Wait for that run to end (or for its lease to expire, if that instance died), then run
    again; the message names the holder and its token.
    """

    code: ClassVar[str] = "execution.lease-held"


class ExecutionSupersededError(ExecutionLeaseHeldError):
    """An Agent Server run attempt older than the newest attempt of its run that started:
    it never takes the thread's lease, now or later, and nothing of it is written.

    The server re-dispatches a run whose worker it stopped hearing from (attempt 2 while
    attempt 1 may still run); the latest attempt holds the thread. Nothing to fix: the later
    attempt's result stands.
    """

    code: ClassVar[str] = "execution.lease-held.superseded"


class ServerAttemptSuperseded(BaseException):
    """How an Agent Server attempt ends when a newer attempt of its run started: a
    ``BaseException``, so that the server records no status for it (an ``Exception`` would
    mark the run failed over the newer attempt's result, a retriable one would start yet
    another attempt). Raised only in runs the Agent Server started, and only when a newer
    attempt of the same run is recorded (it writes the run's status); ``__cause__`` is the
    refusal or the fencing error."""


class ExecutionEndedError(LangGraphFenceError, RuntimeError):
    """The execution has ended in a way no run may reopen: nothing was run or written.

    A ``done`` or ``failed`` execution is never refused (new input starts a new turn, ``None``
    or a ``Command`` resumes it from the checkpoint the config names, each at the next
    token); a ``dead_lettered`` one is, until an operator decides
    (``langgraph-fence resolve``): repeating it could repeat a non-idempotent write.

    Attributes:
        status: the execution's status (``"dead_lettered"``).
        reason: why it ended, as the lease records it, or ``None``.
    """

    code: ClassVar[str] = "execution.ended"
    fields = ("status", "reason")

    def __init__(
        self, message: str, *, status: str | None = None, reason: str | None = None
    ) -> None:
        super().__init__(message)
        self.status = status
        self.reason = reason


class InstanceFullError(LangGraphFenceError, RuntimeError):
    """The instance takes on no more executions now: nothing was run or written.

    An instance takes on no more executions than its keeper renews in time; past that, a
    lease would lapse for want of a renewal. Two cases, each named in the message:

    * it holds as many as it may (its ``max_held``): start the run on another instance, or
      again once one of this instance's runs has ended (``serve()`` defers its takeovers the
      same way, leaving them to other instances), or give the instance a higher
      ``max_held``;
    * the renewals of those it holds run late, and the start waited a lease TTL for them
      to catch up: start it on another instance or again later; if it lasts, hold fewer
      executions there (a lower ``max_held``) or use a longer ``lease_ttl``.
    """

    code: ClassVar[str] = "instance.full"


class ExecutionThreadBoundError(LangGraphFenceError, ValueError):
    """The thread belongs to another execution key of the same tenant; nothing was run.

    A thread is bound to the first ``(tenant_id, execution_id)`` that runs it; a run of it
    under another execution id would hold another lease and fork the thread. Raised before
    the lease is taken or anything is recorded. Another tenant's thread of the same id is
    another thread and never raises this.

    Attributes:
        bound_execution_id: the execution id the thread is bound to.
    """

    code: ClassVar[str] = "execution.thread-bound"
    fields = ("bound_execution_id",)

    def __init__(self, message: str, *, bound_execution_id: str | None = None) -> None:
        super().__init__(message)
        self.bound_execution_id = bound_execution_id


class ExecutionDeadLetteredError(LangGraphFenceError, RuntimeError):
    """The execution was dead-lettered: repeating it could repeat a non-idempotent write."""

    code: ClassVar[str] = "execution.dead-lettered"


class ExecutionBusyError(LangGraphFenceError, RuntimeError):
    """A submit found the thread's execution pending or running with other input, and its
    ``on_busy`` said ``"reject"``: nothing was written.

    Wait for that run (``await instance.get_run(...).result()``), or submit with
    ``on_busy="interrupt"`` (the run in flight is fenced and the new input runs next).

    Attributes:
        scope_key: the execution's scope key.
        status: where the run in flight stands (``"pending"`` or ``"running"``).
    """

    code: ClassVar[str] = "execution.busy"
    fields = ("scope_key", "status")

    def __init__(self, message: str, *, scope_key: str | None = None, status: str | None = None):
        super().__init__(message)
        self.scope_key = scope_key
        self.status = status


class RunFailedError(LangGraphFenceError, RuntimeError):
    """A submitted run ended without an output: ``failed`` (its error), ``cancelled`` (on
    purpose, by :meth:`SubmittedRun.cancel <langgraph_fence.queue.SubmittedRun.cancel>`) or
    ``dead_lettered`` (a non-idempotent write may have happened and is not repeated).

    Raised by :meth:`SubmittedRun.result <langgraph_fence.queue.SubmittedRun.result>`; the
    message names the execution, its end and the reason the lease records.

    Attributes:
        scope_key: the execution's scope key.
        status: ``"failed"``, ``"dead_lettered"`` or ``"cancelled"``.
        reason: why, as the lease records it, or ``None``.
    """

    code: ClassVar[str] = "execution.run-failed"
    fields = ("scope_key", "status", "reason")

    def __init__(
        self,
        message: str,
        *,
        scope_key: str | None = None,
        status: str | None = None,
        reason: str | None = None,
    ) -> None:
        super().__init__(message)
        self.scope_key = scope_key
        self.status = status
        self.reason = reason


class ChildFailedError(RunFailedError):
    """A child execution a step waited for ended without an output: ``failed`` (its error),
    ``cancelled`` or ``dead_lettered``.

    Raised (or, with ``return_exceptions=True``, returned in its place) by
    :meth:`ExecutionContext.wait_children <langgraph_fence.ExecutionContext.wait_children>`
    within one poll of the child's end, never a hang. The message names the child
    execution, its graph, its end and the reason its lease records.

    Attributes:
        scope_key: the child execution's scope key.
        status: ``"failed"``, ``"dead_lettered"`` or ``"cancelled"``.
        reason: why, as the child's lease records it, or ``None``.
    """

    code: ClassVar[str] = "execution.run-failed.child"


_WRITE_DEAD_LETTERED_DOC = """A step's non-idempotent write failed, or would have been
    repeated: dead-lettered.

    Raised inside the step (by a fenced node or a fenced tool). It is also a LangGraph
    ``GraphBubbleUp``: no ``RetryPolicy`` retries it, ``ToolNode`` re-raises it whatever its
    ``handle_tool_errors`` says (the model never sees it as a tool error it could answer by
    calling the tool again), and LangGraph saves no error write for the task, so the
    ``pending_effect`` stamp stays standing until the execution is dead-lettered: a crash
    in between still dead-letters it on takeover. ``Instance`` dead-letters the execution
    and raises this error.
    """

if TYPE_CHECKING:
    from langgraph.errors import GraphBubbleUp

    class WriteDeadLetteredError(ExecutionDeadLetteredError, GraphBubbleUp):
        __doc__ = _WRITE_DEAD_LETTERED_DOC
        code: ClassVar[str] = "execution.dead-lettered.write"

else:

    def __getattr__(name: str) -> Any:
        # WriteDeadLetteredError is defined on first use (PEP 562): its base, LangGraph's
        # GraphBubbleUp, costs a second of imports that the CLI's listings and `--help`
        # never need. Defined once: every importer gets the same class (pickle too, by
        # its qualified name).
        if name != "WriteDeadLetteredError":
            raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
        from langgraph.errors import GraphBubbleUp

        class WriteDeadLetteredError(ExecutionDeadLetteredError, GraphBubbleUp):
            __doc__ = _WRITE_DEAD_LETTERED_DOC
            __qualname__ = "WriteDeadLetteredError"
            code: ClassVar[str] = "execution.dead-lettered.write"

        return globals().setdefault(name, WriteDeadLetteredError)


# The rebuild functions of pickles: ``_rebuild_two`` makes every error with fields; the
# other three made them in earlier versions and stay, so an error pickled by a worker not
# yet upgraded still loads.
def _rebuild(
    cls: type[ExecutionLeaseLostError],
    message: str,
    scope_key: str | None,
    token_held: int | None,
    token_seen: int | None,
) -> ExecutionLeaseLostError:
    return cls(message, scope_key=scope_key, token_held=token_held, token_seen=token_seen)


def _rebuild_bound(
    cls: type[ExecutionThreadBoundError], message: str, bound_execution_id: str | None
) -> ExecutionThreadBoundError:
    return cls(message, bound_execution_id=bound_execution_id)


def _rebuild_ended(
    cls: type[ExecutionEndedError], message: str, status: str | None, reason: str | None
) -> ExecutionEndedError:
    return cls(message, status=status, reason=reason)


def _rebuild_two(cls: type[E], message: str, fields: dict[str, Any]) -> E:
    return cls(message, **fields)


def linked_errors(exc: BaseException) -> Iterator[BaseException]:
    """``exc``, its ``__cause__``/``__context__`` chains and nested groups, breadth first.

    Each error is yielded once, so a cycle in the links ends the walk.
    """
    seen: set[int] = set()
    queue: deque[BaseException] = deque([exc])
    while queue:
        current = queue.popleft()
        if id(current) in seen:
            continue
        seen.add(id(current))
        yield current
        if isinstance(current, BaseExceptionGroup):
            queue.extend(current.exceptions)
        if current.__cause__ is not None:
            queue.append(current.__cause__)
        if current.__context__ is not None:
            queue.append(current.__context__)


def find_error(exc: BaseException | None, kind: type[E]) -> E | None:
    """The first error of ``kind`` linked to ``exc`` (see :func:`linked_errors`), or ``None``."""
    if exc is None:
        return None
    return next((e for e in linked_errors(exc) if isinstance(e, kind)), None)


def find_fence_error(exc: BaseException | None) -> ExecutionLeaseLostError | None:
    """Return the fencing error inside ``exc``, or ``None``.

    Looks at ``exc`` itself, its ``__cause__`` and ``__context__`` chains and every nested
    ``BaseExceptionGroup``, breadth first and cycle-safe. An :class:`ExecutionFencedError`
    wins over a plain :class:`ExecutionLeaseLostError` wherever both occur; otherwise the
    first one found (nearest to ``exc``) is returned.
    """
    return find_error(exc, ExecutionFencedError) or find_error(exc, ExecutionLeaseLostError)

"""Fencing errors: found anywhere in a chain or group, coded, picklable, and self-explaining."""

from __future__ import annotations

import pickle

import pytest

from langgraph_fence import errors as errors_module
from langgraph_fence.errors import (
    ChildFailedError,
    ExecutionContextUnavailableError,
    ExecutionEndedError,
    ExecutionFencedError,
    ExecutionLeaseHeldError,
    ExecutionLeaseLostError,
    LangGraphFenceError,
    find_fence_error,
)
from langgraph_fence.fence import RunHandle
from langgraph_fence.lease import LeaseKey
from langgraph_fence.lease.stores import MemoryLeaseRepository
from langgraph_fence.lease.transitions import fenced_error
from langgraph_fence.testing import ManualClock


def fenced(held: int = 1, seen: int = 2) -> ExecutionFencedError:
    return ExecutionFencedError("fenced", scope_key="t:e", token_held=held, token_seen=seen)


def lost() -> ExecutionLeaseLostError:
    return ExecutionLeaseLostError("lost", scope_key="t:e", token_held=1)


# -- find_fence_error


def test_absent_is_none() -> None:
    assert find_fence_error(None) is None
    assert find_fence_error(ValueError("x")) is None
    assert find_fence_error(ExecutionContextUnavailableError("no step")) is None


def test_the_error_itself() -> None:
    error = fenced()
    assert find_fence_error(error) is error
    plain = lost()
    assert find_fence_error(plain) is plain


def test_in_cause_and_context() -> None:
    error = fenced()
    outer = RuntimeError("outer")
    outer.__cause__ = error
    assert find_fence_error(outer) is error
    other = fenced()
    deeper = ValueError("deeper")
    deeper.__context__ = other
    top = KeyError("top")
    top.__context__ = deeper
    assert find_fence_error(top) is other


def _fail_while_handling(error: ExecutionFencedError) -> None:
    try:
        raise error
    except ExecutionFencedError:
        raise ValueError("handling it failed")  # noqa: B904 (implicit __context__)


def _wrap(error: ExecutionFencedError) -> None:
    try:
        raise error
    except ExecutionFencedError as exc:
        raise RuntimeError("wrapped") from exc


def test_in_a_real_raise_chain() -> None:
    error = fenced()
    with pytest.raises(ValueError, match="handling it failed") as handling:
        _fail_while_handling(error)
    assert handling.value.__context__ is error
    assert find_fence_error(handling.value) is error
    with pytest.raises(RuntimeError, match="wrapped") as wrapping:
        _wrap(error)
    assert find_fence_error(wrapping.value) is error


def test_in_nested_exception_groups() -> None:
    error = fenced()
    inner_cause = ValueError("tool failed")
    inner_cause.__cause__ = error
    group = ExceptionGroup(
        "outer",
        [
            ValueError("a"),
            ExceptionGroup("middle", [KeyError("b"), ExceptionGroup("in", [inner_cause])]),
        ],
    )
    assert find_fence_error(group) is error
    base_group = BaseExceptionGroup("base", [KeyboardInterrupt(), error])
    assert find_fence_error(base_group) is error
    wrapper = RuntimeError("after the group")
    wrapper.__context__ = group
    assert find_fence_error(wrapper) is error


def test_cycles_terminate() -> None:
    a, b = ValueError("a"), ValueError("b")
    a.__context__ = b
    b.__context__ = a
    assert find_fence_error(a) is None
    a.__cause__ = a
    assert find_fence_error(a) is None
    error = fenced()
    error.__context__ = a
    b.__cause__ = error
    assert find_fence_error(a) is error
    group = ExceptionGroup("g", [a])
    a.__cause__ = group  # a cycle through the group: group -> a -> group
    assert find_fence_error(group) is error


def test_fenced_wins_over_a_plain_loss_wherever_it_is() -> None:
    plain, error = lost(), fenced()
    assert find_fence_error(ExceptionGroup("g", [plain, error])) is error
    plain.__context__ = ValueError("between")
    assert plain.__context__ is not None
    plain.__context__.__cause__ = error
    # The plain loss is the error itself, the fencing error three links down: fenced wins.
    assert find_fence_error(plain) is error


def test_nearest_plain_loss_when_no_fence() -> None:
    near, far = lost(), lost()
    near.__context__ = ValueError("x")
    near.__context__.__context__ = far
    outer = RuntimeError("outer")
    outer.__cause__ = near
    assert find_fence_error(outer) is near


# -- codes


FENCE_ERRORS = [
    cls
    for cls in vars(errors_module).values()
    if isinstance(cls, type) and issubclass(cls, LangGraphFenceError)
]


def test_codes_of_the_public_errors() -> None:
    assert ExecutionLeaseLostError.code == "execution.lease-lost"
    assert ExecutionFencedError.code == "execution.lease-lost.fenced"
    assert ExecutionContextUnavailableError.code == "execution.context-unavailable"
    # A live holder (wait, then run again) and an ended execution (an operator decides)
    # are told apart by class and code; neither is a kind of the other.
    assert ExecutionLeaseHeldError.code == "execution.lease-held"
    assert ExecutionEndedError.code == "execution.ended"
    assert not issubclass(ExecutionEndedError, ExecutionLeaseHeldError)
    assert not issubclass(ExecutionLeaseHeldError, ExecutionEndedError)
    assert issubclass(ExecutionLeaseLostError, RuntimeError)
    assert issubclass(ExecutionFencedError, ExecutionLeaseLostError)


@pytest.mark.parametrize("cls", FENCE_ERRORS, ids=lambda c: c.__name__)
def test_a_subclass_code_extends_its_parents_by_one_segment(cls: type[LangGraphFenceError]) -> None:
    codes = {c.code for c in FENCE_ERRORS}
    assert len(codes) == len(FENCE_ERRORS), "every class has a code of its own"
    parent = next((p for p in cls.__mro__[1:] if issubclass(p, LangGraphFenceError)), None)
    if parent is None or parent is LangGraphFenceError:
        # The root's code ("fence") is no prefix: the concrete families start below it.
        assert cls is LangGraphFenceError or "." in cls.code
        return
    prefix, _, segment = cls.code.rpartition(".")
    assert prefix == parent.code
    assert segment
    assert "." not in segment


# -- pickling (errors cross process boundaries: chaos tests, worker pools)


@pytest.mark.parametrize(
    "error",
    [
        fenced(3, 4),
        ExecutionFencedError("no row", scope_key="a%3Ab:c", token_held=7, token_seen=None),
        lost(),
        ExecutionContextUnavailableError("used after its step"),
        ExecutionEndedError("dead-lettered", status="dead_lettered", reason="stamped"),
        ChildFailedError("child failed", scope_key="t:t%3Ap%3Ac", status="failed", reason="x"),
    ],
    ids=lambda e: type(e).__name__,
)
def test_pickle_round_trip(error: LangGraphFenceError) -> None:
    error.add_note("seen by worker 2")
    copy = pickle.loads(pickle.dumps(error))
    assert type(copy) is type(error)
    assert str(copy) == str(error)
    assert copy.code == error.code
    assert getattr(copy, "__notes__", None) == ["seen by worker 2"]
    for field in ("scope_key", "token_held", "token_seen", "status", "reason"):
        assert getattr(copy, field, None) == getattr(error, field, None)


# -- messages


def test_store_refusal_names_scope_key_and_both_tokens() -> None:
    store = MemoryLeaseRepository(clock=ManualClock())
    from langgraph_fence.lease import Lease, LeaseStatus

    key = LeaseKey("acme", "thread:1")
    mine = Lease(key, "A", 4, 10.0, None, LeaseStatus.RUNNING, store_id=store.store_id)
    theirs = Lease(key, "B", 5, 20.0, None, LeaseStatus.RUNNING, store_id=store.store_id)
    error = fenced_error(mine, theirs, action="renew")
    message = str(error)
    assert "acme:thread%3A1" in message
    assert "token 4" in message
    assert "epoch 5" in message
    assert (error.scope_key, error.token_held, error.token_seen) == ("acme:thread%3A1", 4, 5)
    gone = fenced_error(mine, None, action="renew")
    assert "no lease row" in str(gone)
    assert gone.token_seen is None


async def test_handle_fence_message_names_scope_key_and_both_tokens() -> None:
    clock = ManualClock()
    store = MemoryLeaseRepository(clock=clock)
    lease = await store.acquire(LeaseKey("acme", "t-1"), "A", 10)
    assert lease is not None
    error = RunHandle(store, lease, 10, clock=clock).fenced(9, source="the payments sink")
    assert "acme:t-1" in str(error)
    assert "9" in str(error)
    assert "token 1" in str(error)
    assert (error.token_held, error.token_seen) == (1, 9)

"""The outcome decision keeps its order, for any error a run can end with.

``decide_outcome`` is pure: hypothesis builds errors as LangGraph and the runtime raise them
(chains through ``__cause__`` and ``__context__``, nested exception groups, a drain, a
cancellation, a database connection error, a dead letter, the graph's own error) and checks
what DESIGN.md promises: a fencing error wins wherever it is (guarantee 5), a dead letter
comes next, and an infrastructure error never ends a run ``failed`` (guarantee 6).
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable

import pytest
from hypothesis import given
from hypothesis import strategies as st
from langgraph.errors import GraphDrained
from sqlalchemy.exc import InterfaceError

from langgraph_fence import ExecutionFencedError, ExecutionLeaseLostError
from langgraph_fence.errors import ExecutionDeadLetteredError, linked_errors
from langgraph_fence.execution.outcome import Settle, decide_outcome


def lost() -> ExecutionLeaseLostError:
    return ExecutionLeaseLostError("lost", scope_key="t:e", token_held=3, token_seen=None)


def fenced() -> ExecutionFencedError:
    return ExecutionFencedError("fenced", scope_key="t:e", token_held=3, token_seen=4)


def dead() -> ExecutionDeadLetteredError:
    return ExecutionDeadLetteredError("a charge may have happened")


def store_down() -> InterfaceError:
    """A database connection error as SQLAlchemy raises it (an infrastructure error)."""
    return InterfaceError("SELECT 1", {}, ConnectionResetError("connection reset by peer"))


#: Errors a run may end with that are neither fencing errors nor dead letters.
PLAIN: dict[str, Callable[[], BaseException]] = {
    "graph": lambda: ValueError("the graph's own bug"),
    "http": lambda: ConnectionError("an HTTP client's, not the store's"),
    "drained": lambda: GraphDrained("shutdown"),
    "cancelled": asyncio.CancelledError,
    "store": store_down,
}
KINDS = {**PLAIN, "lost": lost, "fenced": fenced, "dead": dead}


@st.composite
def error_trees(draw: st.DrawFn, kinds: list[str]) -> BaseException:
    """An error of one of ``kinds``, linked to more of them by causes, contexts and groups."""
    made = KINDS[draw(st.sampled_from(kinds))]()
    link = draw(st.sampled_from(["none", "cause", "context", "group"]))
    if link == "none" or draw(st.integers(0, 3)) == 0:
        return made
    inner = draw(error_trees(kinds))
    if link == "cause":
        made.__cause__ = inner
    elif link == "context":
        made.__context__ = inner
    else:
        siblings = [inner, *draw(st.lists(error_trees(kinds), max_size=2))]
        return BaseExceptionGroup("steps failed", [made, *siblings])
    return made


def kinds_in(exc: BaseException) -> set[type[BaseException]]:
    return {type(e) for e in linked_errors(exc)}


def with_one(exc: BaseException, placed: BaseException, where: str) -> BaseException:
    """``exc`` with ``placed`` linked in at ``where`` (as its cause, its context, in a group
    beside it, or at the end of its cause chain)."""
    if where == "cause":
        exc.__cause__ = placed
        return exc
    if where == "context":
        exc.__context__ = placed
        return exc
    if where == "group":
        return BaseExceptionGroup("steps failed", [exc, placed])
    tail = exc
    while tail.__cause__ is not None:
        tail = tail.__cause__
    tail.__cause__ = placed
    return exc


@given(
    error_trees([*list(PLAIN), "dead", "lost"]),
    st.sampled_from(["fenced", "lost"]),
    st.sampled_from(["cause", "context", "group", "deep"]),
    st.booleans(),
)
def test_a_fencing_error_always_wins_wherever_it_is(
    exc: BaseException, kind: str, where: str, dead_on_handle: bool
) -> None:
    placed = KINDS[kind]()
    exc = with_one(exc, placed, where)
    outcome = decide_outcome(exc, fence_error=None, dead_letter=dead() if dead_on_handle else None)
    assert outcome.settle is Settle.FENCED
    assert outcome.fence_error is not None
    if kind == "fenced":
        # A takeover wins over a plain loss anywhere in the same tree.
        assert isinstance(outcome.fence_error, ExecutionFencedError)


@given(error_trees(list(KINDS)), st.sampled_from([lost, fenced]))
def test_a_fencing_error_on_the_handle_wins_over_anything_the_graph_raised(
    exc: BaseException, recorded: Callable[[], ExecutionLeaseLostError]
) -> None:
    assert decide_outcome(exc, fence_error=recorded(), dead_letter=dead()).settle is Settle.FENCED
    assert decide_outcome(None, fence_error=recorded(), dead_letter=None).settle is Settle.FENCED


@given(error_trees([*list(PLAIN), "dead"]))
def test_an_infrastructure_error_never_yields_failed(exc: BaseException) -> None:
    exc = with_one(exc, store_down(), "group")
    outcome = decide_outcome(exc, fence_error=None, dead_letter=None)
    assert outcome.settle is not Settle.FAILED
    if ExecutionDeadLetteredError not in kinds_in(exc):
        assert outcome.settle in (Settle.LOST_TO_STORE, Settle.HAND_BACK)


@given(error_trees(list(PLAIN)), st.sampled_from(["cause", "context", "group", "deep"]))
def test_a_dead_letter_comes_before_drains_store_errors_and_the_graphs_error(
    exc: BaseException, where: str
) -> None:
    letter = dead()
    exc = with_one(exc, letter, where)
    outcome = decide_outcome(exc, fence_error=None, dead_letter=None)
    assert outcome.settle is Settle.DEAD_LETTER
    assert outcome.dead_letter is letter
    assert outcome.raise_dead_letter  # not the run's exception itself: raised in its place


def test_a_dead_letter_that_is_the_runs_error_propagates_as_it_is() -> None:
    letter = dead()
    outcome = decide_outcome(letter, fence_error=None, dead_letter=None)
    assert outcome.settle is Settle.DEAD_LETTER
    assert not outcome.raise_dead_letter
    # A graph that returned after something caught the dead letter is dead all the same.
    caught = decide_outcome(None, fence_error=None, dead_letter=letter)
    assert caught.settle is Settle.DEAD_LETTER
    assert caught.raise_dead_letter
    assert caught.reason is not None
    assert "a charge may have happened" in caught.reason


@given(error_trees(["graph", "http", "cancelled"]))
def test_only_the_graphs_own_error_yields_failed(exc: BaseException) -> None:
    outcome = decide_outcome(exc, fence_error=None, dead_letter=None)
    # A run that was itself cancelled (Ctrl-C, SIGTERM) is handed back, whatever it holds.
    cancelled = isinstance(exc, asyncio.CancelledError)
    assert outcome.settle is (Settle.HAND_BACK if cancelled else Settle.FAILED)
    assert outcome.reason


@pytest.mark.parametrize(
    ("exc", "settle", "reason"),
    [
        (None, Settle.ENDED, None),
        (GraphDrained("shutdown"), Settle.HAND_BACK, "drained: shutdown"),
        (asyncio.CancelledError(), Settle.HAND_BACK, "cancelled"),
        (ValueError("boom"), Settle.FAILED, "ValueError: boom"),
    ],
)
def test_each_plain_end_settles_as_documented(
    exc: BaseException | None, settle: Settle, reason: str | None
) -> None:
    outcome = decide_outcome(exc, fence_error=None, dead_letter=None)
    assert outcome.settle is settle
    if reason is None:
        assert outcome.reason is None
    else:
        assert outcome.reason is not None
        assert reason in outcome.reason


def test_a_cancellation_the_graph_raised_by_itself_is_its_own_failure() -> None:
    """Handed back only when the run's own task is being cancelled (Ctrl-C, SIGTERM, its
    caller); a CancelledError the graph raised while nobody cancelled the run would be
    taken and raised again for ever, so it ends the run failed."""
    exc = asyncio.CancelledError("an inner task was cancelled")
    handed = decide_outcome(exc, fence_error=None, dead_letter=None, stopped=True)
    assert handed.settle is Settle.HAND_BACK
    failed = decide_outcome(exc, fence_error=None, dead_letter=None, stopped=False)
    assert failed.settle is Settle.FAILED
    assert failed.reason

"""failure_reason() and mask_password(): what a stored reason or an echoed URL may reveal."""

from __future__ import annotations

import gc
import re
import time
from collections.abc import Callable
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from langgraph_fence.redact import REASON_MAX_CHARS, bounded_reason, failure_reason, mask_password


def test_sqlalchemy_statement_parameters_and_link_are_cut() -> None:
    message = (
        "(sqlite3.IntegrityError) UNIQUE constraint failed: charges.id\n"
        "[SQL: INSERT INTO charges (id, card) VALUES (?, ?)]\n"
        "[parameters: ('c-1', '4111111111111111')]\n"
        "(Background on this error at: https://sqlalche.me/e/20/gkpj)"
    )
    assert failure_reason(ValueError(message)) == (
        "ValueError: (sqlite3.IntegrityError) UNIQUE constraint failed: charges.id"
    )


def test_parameters_on_the_first_line_are_cut_too() -> None:
    reason = failure_reason(RuntimeError("insert failed [parameters: {'card': '4111'}] end"))
    assert reason == "RuntimeError: insert failed"


def test_a_reason_without_message_is_its_type() -> None:
    assert failure_reason(TimeoutError()) == "TimeoutError"


def test_prefix_comes_first() -> None:
    assert failure_reason(KeyError("x"), prefix="loading: ") == "loading: KeyError: 'x'"


@pytest.mark.parametrize(
    ("text", "masked"),
    [
        (
            "postgresql+asyncpg://app:hunter2@db:5432/prod",
            "postgresql+asyncpg://app:***@db:5432/prod",
        ),
        ("postgresql//app:hunter2@db/prod", "postgresql//app:***@db/prod"),
        # An unencoded "@" in the password: every part that looks like user:password@ is masked.
        ("url 'postgres://app:p@ss:w@db/x'", "url 'postgres://app:***@ss:***@db/x'"),
        ("postgresql://app@db/prod", "postgresql://app@db/prod"),
        ("sqlite+aiosqlite:///tmp/x.db", "sqlite+aiosqlite:///tmp/x.db"),
    ],
)
def test_mask_password(text: str, masked: str) -> None:
    assert mask_password(text) == masked


# A URL's password: unreserved and sub-delimiter characters, or percent-encoded ones.
URL_PASSWORD = st.text(
    alphabet=st.sampled_from("abcXYZ019-._~!$&()*+,;=%"), min_size=1, max_size=40
)


@given(st.text(), URL_PASSWORD)
def test_reasons_are_bounded_one_line_and_never_hold_the_password(head: str, secret: str) -> None:
    reason = failure_reason(RuntimeError(f"{head} postgresql://u:{secret}PW@h/db\nmore"))
    assert len(reason) <= REASON_MAX_CHARS
    assert "\n" not in reason
    assert f"{secret}PW@" not in reason


def test_a_reason_of_our_own_text_is_bounded_the_same_way() -> None:
    long = "drained: " + "y" * 2000 + "\n[parameters: secret]"
    reason = bounded_reason(long)
    assert reason.startswith("drained: y")
    assert reason.endswith("...")
    assert len(reason) == REASON_MAX_CHARS


# -- issue 32: driver values, card numbers, and a message of any length in linear time

CARD = "4111-1111-1111-1111"


@pytest.mark.parametrize(
    "message",
    [
        # asyncpg (through SQLAlchemy), a str where an integer was expected
        "(sqlalchemy.dialects.postgresql.asyncpg.Error) <class 'asyncpg.exceptions.DataError'>: "
        f"invalid input for query argument $1: '{CARD}' ('str' object cannot be interpreted "
        "as an integer)",
        # the same value unquoted (a number asyncpg could not fit)
        "invalid input for query argument $1: 41111111 (value out of int32 range)",
        # PostgreSQL's own words
        f'invalid input syntax for type bigint: "{CARD}"',
    ],
)
def test_a_drivers_quoted_value_is_cut(message: str) -> None:
    reason = failure_reason(RuntimeError(message))
    assert "4111" not in reason
    assert reason.startswith("RuntimeError: ")
    assert "invalid input" in reason  # what went wrong is kept, the value is not


def test_a_card_number_in_any_message_is_masked() -> None:
    reason = failure_reason(ValueError("charge of card 4111 1111 1111 1111 declined"))
    assert reason == "ValueError: charge of card [number] declined"


# A card number as people write it: 13 to 19 digits, grouped by spaces or dashes, or not.
CARD_NUMBERS = st.builds(
    lambda digits, sep, group: sep.join(
        digits[i : i + group] for i in range(0, len(digits), group)
    ),
    st.text(alphabet="0123456789", min_size=13, max_size=19),
    st.sampled_from(["", " ", "-"]),
    st.integers(min_value=1, max_value=6),
)
# Anything the tests below must not find in a reason.
CARD_SHAPED = re.compile(r"\d(?:[ -]?\d){12}")
PASSWORD_SHAPED = re.compile(r"[^\s:/@'\"]*:(?!\*\*\*@)[^\s@'\"/]+@")
FILLERS = st.sampled_from(["", "x", " ", "a:", "'", '"', "[SQL", "\n", "9", "@", "é\u2028"])


@settings(max_examples=300, deadline=None)
@given(
    parts=st.lists(
        st.one_of(
            st.text(),
            CARD_NUMBERS,
            CARD_NUMBERS.map(lambda card: f"query argument $1: '{card}'"),
            CARD_NUMBERS.map(lambda card: f'for type bigint: "{card}"'),
            URL_PASSWORD.map(lambda secret: f"postgresql://u:{secret}PW@h/db"),
            st.tuples(FILLERS, st.integers(0, 200_000)).map(lambda t: t[0] * t[1]),
        ),
        max_size=8,
    ),
    sep=st.sampled_from(["", " ", "\n", ": "]),
)
def test_any_failure_message_becomes_a_bounded_reason_with_no_card_or_password(
    parts: list[str], sep: str
) -> None:
    message = sep.join(parts)
    for reason in (failure_reason(RuntimeError(message)), bounded_reason(message)):
        assert len(reason) <= REASON_MAX_CHARS
        assert "\n" not in reason
        assert CARD_SHAPED.search(reason) is None, reason
        assert PASSWORD_SHAPED.search(reason) is None, reason
        assert "PW@" not in reason


def _best_of(repeat: int, call: Callable[[], object]) -> float:
    """The fastest of ``repeat`` calls, in seconds of this process's CPU (other processes on
    a busy machine do not count; nor do garbage collections, held off while it measures)."""
    best = float("inf")
    collecting = gc.isenabled()
    gc.disable()
    try:
        for _ in range(repeat):
            start = time.process_time()
            call()
            best = min(best, time.process_time() - start)
    finally:
        if collecting:
            gc.enable()
    return best


# Shapes that made the old masking rescan the rest of the text from each of its characters.
ADVERSARIAL = ["a:", ":", "a", "[SQL", "(Background on this error at:", "'a", "4111 ", "@a:"]


@pytest.mark.parametrize("unit", ADVERSARIAL)
@pytest.mark.parametrize("redact", [failure_reason, mask_password], ids=["reason", "mask"])
def test_redaction_is_linear_in_the_length(unit: str, redact: Callable[[Any], str]) -> None:
    def run(size: int) -> float:
        text = unit * (size // len(unit))
        arg: Any = RuntimeError(text) if redact is failure_reason else text
        return _best_of(5, lambda: redact(arg))

    # A linear redaction takes 4 times as long for 4 times the text (a bounded one, the
    # same); the quadratic one 16 times. The 40 KB check comes first: it fails in seconds
    # where the 1 MB one would take hours.
    small = run(10_000)
    assert run(40_000) <= 8 * small + 0.005
    # 1 MB against 10 KB scaled by 100, with room for a busy machine (x4, + 20 ms).
    megabyte = run(1_000_000)
    print(f"\n[{unit!r}] 10 KB: {small * 1000:.2f} ms, 1 MB: {megabyte * 1000:.2f} ms")
    assert megabyte <= 4 * 100 * small + 0.02

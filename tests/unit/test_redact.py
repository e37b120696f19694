"""failure_reason() and mask_password(): what a stored reason or an echoed URL may reveal."""

from __future__ import annotations

import pytest
from hypothesis import given
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

"""Scope keys: ``encodeURIComponent`` per part, joined by ``:``, decodable, never a NUL."""

from __future__ import annotations

import re
import uuid

import pytest
from hypothesis import given
from hypothesis import strategies as st

from langgraph_fence import parse_scope_key, scope_key
from langgraph_fence.lease.scope import encode_part

# Surrogate-free text, with the characters that matter drawn often.
TRICKY = ["\x00", ":", "%", "%25", "%3A", "/", " ", "😀", "é", "\U0010ffff", "\ufeff"]
part = st.lists(
    st.one_of(st.characters(exclude_categories=("Cs",)), st.sampled_from(TRICKY)), min_size=1
).map("".join)
ENCODED_PART = re.compile(r"(?:[A-Za-z0-9\-_.!~*'()]|%[0-9A-F]{2})+")
UNRESERVED = set("ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789-_.!~*'()")


def reference_encode(text: str) -> str:
    """encodeURIComponent as ECMA-262 states it: UTF-8 octets of every reserved code point."""
    return "".join(
        ch if ch in UNRESERVED else "".join(f"%{octet:02X}" for octet in ch.encode("utf-8"))
        for ch in text
    )


@given(tenant=part, execution=part, more=st.lists(part, max_size=3))
def test_round_trip(tenant: str, execution: str, more: list[str]) -> None:
    key = scope_key(tenant, execution, *more)
    assert parse_scope_key(key) == (tenant, execution, *more)
    assert "\x00" not in key
    raw_parts = key.split(":")
    # A ':' inside a part is always escaped, so the key splits into exactly its parts.
    assert len(raw_parts) == 2 + len(more)
    for raw, original in zip(raw_parts, (tenant, execution, *more), strict=True):
        assert ENCODED_PART.fullmatch(raw), raw
        assert raw == reference_encode(original)


@given(tenant=part, execution=part)
def test_distinct_pairs_never_collide(tenant: str, execution: str) -> None:
    # The classic collision of a naive join: ("a:b", "c") against ("a", "b:c").
    assert scope_key(tenant + ":" + execution, "x") != scope_key(tenant, execution + ":x")


# Written by hand from the ECMAScript specification of encodeURIComponent (what
# `encodeURIComponent(s)` prints in a browser), not computed.
JS_TABLE = [
    ("abc", "abc"),
    ("ABCxyz0189", "ABCxyz0189"),
    ("-_.!~*'()", "-_.!~*'()"),
    ("a b", "a%20b"),
    ("a:b", "a%3Ab"),
    ("100%", "100%25"),
    ("%3A", "%253A"),
    ("a/b?c=d&e#f", "a%2Fb%3Fc%3Dd%26e%23f"),
    ("+@$,;", "%2B%40%24%2C%3B"),
    ('[]{}|\\^`"<>', "%5B%5D%7B%7D%7C%5C%5E%60%22%3C%3E"),
    ("\x00", "%00"),
    ("\n\t\x7f", "%0A%09%7F"),
    ("é", "%C3%A9"),
    ("€", "%E2%82%AC"),
    ("😀", "%F0%9F%98%80"),
    ("\U0010ffff", "%F4%8F%BF%BF"),
    ("日本", "%E6%97%A5%E6%9C%AC"),
]


@pytest.mark.parametrize(("text", "expected"), JS_TABLE)
def test_equals_encode_uri_component(text: str, expected: str) -> None:
    assert encode_part(text) == expected
    assert scope_key(text, text) == f"{expected}:{expected}"
    assert parse_scope_key(f"{expected}:{expected}") == (text, text)


def test_plain_and_uuid_ids_unchanged() -> None:
    ident = str(uuid.UUID("6f1c0c52-3e7b-4a4e-9d8f-0a1b2c3d4e5f"))
    assert scope_key("acme", ident) == f"acme:{ident}"
    assert scope_key("tenant_1", "thread-42", "child.3") == "tenant_1:thread-42:child.3"


@pytest.mark.parametrize(
    ("args", "name"),
    [
        (("", "e"), "tenant_id"),
        (("t", ""), "execution_id"),
        ((None, "e"), "tenant_id"),
        (("t", 5), "execution_id"),
        (("t", b"e"), "execution_id"),
        (("t", "e", ""), r"more\[0\]"),
        (("t", "e", "x", 1), r"more\[1\]"),
        (("t\ud800", "e"), "tenant_id"),
        (("t", "\udfff"), "execution_id"),
    ],
)
def test_bad_parts_are_refused_by_name(args: tuple[object, ...], name: str) -> None:
    with pytest.raises(ValueError, match=name):
        scope_key(*args)  # type: ignore[arg-type]


def test_lone_surrogate_is_named() -> None:
    with pytest.raises(ValueError, match="surrogate"):
        scope_key("t", "a\ud83d")


@pytest.mark.parametrize(
    "bad",
    [
        "",
        "single",
        "a::b",
        ":a",
        "a:",
        "a:%ZZ",  # not an escape
        "a:%2f",  # not canonical (encodeURIComponent writes upper case)
        "a:b c",  # an unescaped space
        "a:%C3",  # a truncated UTF-8 sequence
        "a:%ED%A0%80",  # an encoded surrogate
        "a:%41",  # 'A' needs no escape
        5,
        None,
    ],
)
def test_parse_refuses_what_is_not_a_scope_key(bad: object) -> None:
    with pytest.raises(ValueError, match="key"):
        parse_scope_key(bad)  # type: ignore[arg-type]

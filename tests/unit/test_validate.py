"""The one validation module: what is refused, and that the message names the argument."""

from __future__ import annotations

import math

import pytest
from hypothesis import given
from hypothesis import strategies as st
from langgraph.checkpoint.memory import InMemorySaver

from langgraph_fence import Instance, LeaseKey, MemoryLeaseRepository
from langgraph_fence.database import schema_options
from langgraph_fence.lease.records import MemoryExecutionRecords
from langgraph_fence.validate import (
    MAX_COUNT,
    MAX_SECONDS,
    positive_int,
    positive_seconds,
    storable_text,
    text_id,
)


@pytest.mark.parametrize("bad", ["", None, 7, b"id", "a\x00b", "a\ud800b", "\udfff"])
def test_text_id_refuses_what_a_store_cannot_keep_naming_the_argument(bad: object) -> None:
    with pytest.raises(ValueError, match=r"^thread_id ") as refused:
        text_id("thread_id", bad)
    assert type(refused.value) is ValueError


@given(st.text(st.characters(exclude_categories=["Cs"], exclude_characters="\x00"), min_size=1))
def test_text_id_keeps_every_storable_text(value: str) -> None:
    assert text_id("x", value) is value
    assert storable_text("x", value) is value


def test_storable_text_takes_the_empty_string() -> None:
    assert storable_text("checkpoint_ns", "") == ""


@pytest.mark.parametrize(
    "bad", [10**400, -(10**400), 0, -1, 0.0, math.inf, -math.inf, math.nan, True, "3", None]
)
def test_positive_seconds_refuses_naming_the_argument(bad: object) -> None:
    with pytest.raises(ValueError, match=r"^lease_ttl must be a positive number of seconds"):
        positive_seconds("lease_ttl", bad)


def test_positive_seconds_takes_ints_and_floats_up_to_the_maximum() -> None:
    assert positive_seconds("t", 3) == 3.0
    assert positive_seconds("t", 0.001) == 0.001
    assert positive_seconds("t", MAX_SECONDS) == MAX_SECONDS
    with pytest.raises(ValueError, match=r"^t must be a positive number of seconds"):
        positive_seconds("t", MAX_SECONDS * 2)


@pytest.mark.parametrize("bad", [0, -1, MAX_COUNT + 1, 10**400, True, 1.0, "2", None])
def test_positive_int_refuses_naming_the_argument(bad: object) -> None:
    with pytest.raises(ValueError, match=r"^concurrency must be an int >= 1"):
        positive_int("concurrency", bad)


@pytest.mark.parametrize(
    ("options", "argument"),
    [
        ({"lease_ttl": 10**400}, "lease_ttl"),
        ({"lease_ttl": math.nan}, "lease_ttl"),
        ({"renew_interval": 10**400}, "renew_interval"),
        ({"instance_id": "a\x00b"}, "instance_id"),
        ({"instance_id": "a\ud800b"}, "instance_id"),
        ({"instance_id": ""}, "instance_id"),
        ({"max_takeovers": 10**400}, "max_takeovers"),
        ({"max_held": 0}, "max_held"),
        ({"max_held": 2.5}, "max_held"),
        ({"max_held": True}, "max_held"),
    ],
)
def test_instance_refuses_bad_settings_naming_them(
    options: dict[str, object], argument: str
) -> None:
    with pytest.raises(ValueError, match=argument) as refused:
        Instance(MemoryLeaseRepository(), InMemorySaver(), **options)  # type: ignore[arg-type]
    assert type(refused.value) is ValueError, "never an OverflowError or UnicodeEncodeError"


@pytest.mark.parametrize("part", ["tenant_id", "execution_id"])
@pytest.mark.parametrize("bad", ["a\x00b", "a\ud800b"])
def test_a_lease_key_refuses_unstorable_parts(part: str, bad: str) -> None:
    parts = {"tenant_id": "t", "execution_id": "e", part: bad}
    with pytest.raises(ValueError, match=part):
        LeaseKey(**parts)


@pytest.mark.parametrize("bad", ["a\x00b", "a\ud800b"])
def test_schema_options_refuse_an_unstorable_schema(bad: str) -> None:
    with pytest.raises(ValueError, match="schema"):
        schema_options(bad)


def test_records_are_in_memory_only_over_the_memory_store() -> None:
    instance = Instance(MemoryLeaseRepository(), InMemorySaver())
    assert isinstance(instance.records, MemoryExecutionRecords)


def test_a_store_of_another_kind_needs_records_passed() -> None:
    class Wrapped:
        """A repository of the user's own around the memory store, hiding it."""

        def __init__(self) -> None:
            self._store = MemoryLeaseRepository()

        def __getattr__(self, name: str) -> object:
            return getattr(self._store, name)

    with pytest.raises(ValueError, match="records is required"):
        Instance(Wrapped(), InMemorySaver())  # type: ignore[arg-type]

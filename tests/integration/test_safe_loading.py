"""Issue 32, item 9: safe loading through ``FencedCheckpointer`` over a foreign saver.

A crafted checkpoint blob in an official saver's storage (LangGraph's ``InMemorySaver``;
the official ``AsyncPostgresSaver`` on PostgreSQL) ran its code when read through the
wrapper, which kept the saver's permissive decoding.
"""

from __future__ import annotations

import urllib.parse
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest
from langgraph.checkpoint.base import BaseCheckpointSaver, empty_checkpoint
from langgraph.checkpoint.memory import InMemorySaver
from langgraph.checkpoint.serde.encrypted import EncryptedSerializer
from langgraph.checkpoint.serde.jsonplus import JsonPlusSerializer

from langgraph_fence import FencedCheckpointer
from tests.support.databases import unique
from tests.support.hardening import crafted

SAVERS = ["memory", "postgres"]


@pytest.fixture(params=SAVERS)
async def saver(request: pytest.FixtureRequest) -> AsyncIterator[BaseCheckpointSaver[Any]]:
    """An official saver, built as its docs say: LangGraph's default, permissive serializer."""
    if request.param == "memory":
        yield InMemorySaver()
        return
    from langgraph.checkpoint.postgres.aio import AsyncPostgresSaver

    url, schema = request.getfixturevalue("pg_schema")
    options = urllib.parse.quote(f"-csearch_path={schema}")
    async with AsyncPostgresSaver.from_conn_string(f"{url}?options={options}") as official:
        await official.setup()
        yield official


async def craft_blob(saver: BaseCheckpointSaver[Any], thread: str, blob: bytes) -> None:
    """Store ``blob`` as the thread's ``log`` channel value, in the saver's own storage."""
    if isinstance(saver, InMemorySaver):
        keys = [k for k in saver.blobs if k[2] == "log"]
        assert keys
        for key in keys:
            saver.blobs[key] = ("msgpack", blob)
        return
    async with saver.conn.cursor() as cur:  # type: ignore[attr-defined]
        await cur.execute(
            "UPDATE checkpoint_blobs SET type = 'msgpack', blob = %s WHERE channel = 'log' "
            "AND thread_id LIKE %s",
            (blob, f"%{thread}%"),
        )
        assert cur.rowcount >= 1


async def test_a_crafted_checkpoint_in_a_foreign_saver_runs_no_code(
    saver: BaseCheckpointSaver[Any], tmp_path: Path
) -> None:
    marker = tmp_path / "ran"
    fenced = FencedCheckpointer(saver)

    thread = unique("thread")
    config: Any = {"configurable": {"thread_id": thread, "checkpoint_ns": ""}}
    checkpoint = empty_checkpoint()
    checkpoint["channel_values"] = {"log": ["step"]}
    checkpoint["channel_versions"] = {"log": 1}
    metadata: Any = {"source": "loop", "step": 0}
    await fenced.aput(config, checkpoint, metadata, {"log": 1})  # no fenced run: as it is
    await craft_blob(saver, thread, crafted(marker))
    found = await fenced.aget_tuple(config)
    assert found is not None
    assert not marker.exists(), "reading the crafted checkpoint through the wrapper ran its code"


class Plain:
    """A cipher that leaves the bytes as they are (what is tested is the serializer under)."""

    def encrypt(self, plaintext: bytes) -> tuple[str, bytes]:
        return "plain", plaintext

    def decrypt(self, ciphername: str, ciphertext: bytes) -> bytes:
        return ciphertext


def test_strict_serde_keeps_what_is_strict_and_reads_what_the_permissive_one_wrote() -> None:
    from langgraph_fence.serde import strict_serde

    strict = JsonPlusSerializer(allowed_msgpack_modules=None)
    assert strict_serde(strict) is strict
    permissive = JsonPlusSerializer(allowed_msgpack_modules=True, pickle_fallback=True)
    made = strict_serde(permissive)
    assert isinstance(made, JsonPlusSerializer)
    assert made._allowed_msgpack_modules is None
    assert not made.pickle_fallback
    value = {"log": ["a", "b"], "n": 1}
    assert made.loads_typed(permissive.dumps_typed(value)) == value
    encrypted = strict_serde(EncryptedSerializer(Plain(), permissive))
    assert isinstance(encrypted, EncryptedSerializer)
    assert isinstance(encrypted.serde, JsonPlusSerializer)
    assert encrypted.serde._allowed_msgpack_modules is None

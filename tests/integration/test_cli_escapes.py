"""Issue 32 item 8: the listings print a tenant's stored text, never its escape sequences.

A tenant names its graphs and threads and, through its errors, writes reasons: any of them
may hold ESC sequences (clear the screen, set the terminal's title) or bidi overrides. Every
field `executions`, `dead-letters` and `runs` print is shown escaped, and `runs` lists one
tenant's runs with `--tenant`, as the other listings do. On both databases.
"""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from langgraph_fence import Instance, LeaseKey
from langgraph_fence.database import schema_options
from tests.support.databases import Database, unique

#: The CLI runs in processes of its own.
pytestmark = pytest.mark.processes

ROOT = Path(__file__).parents[2]
CLEAR = "\x1b[2J\x1b[H"  # clear the screen, cursor home
TITLE = "\x1b]0;pwned\x07"  # set the window's title
BIDI = "\u202e"  # right-to-left override


def cli(database: Database, *args: str) -> subprocess.CompletedProcess[str]:
    target = ["--db", database.url] + (["--schema", database.schema] if database.schema else [])
    done = subprocess.run(
        [sys.executable, "-m", "langgraph_fence.cli", *args, *target],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=ROOT,
        env={**os.environ, "PYTHONPATH": str(ROOT), "COLUMNS": "250"},
    )
    assert done.returncode == 0, done.stdout + done.stderr
    return done


def assert_inert(output: str) -> None:
    """Nothing a terminal would act on: no ESC, BEL or bidi override, in any form."""
    for raw in ("\x1b", "\x07", BIDI):
        assert raw not in output, repr(output)


async def test_listings_escape_every_field_and_runs_takes_tenant(database: Database) -> None:
    mine, theirs = unique("mine"), unique("theirs")
    graph, thread = f"graph{CLEAR}", f"thread{TITLE}{BIDI}"
    options = schema_options(database.schema)
    async with Instance.open(database.url, engine_options=options) as instance:
        for tenant in (mine, theirs):
            # A run no worker serves stays pending: `runs` lists it with its graph and thread.
            await instance.submit(
                graph, {"n": 1}, {"configurable": {"thread_id": thread}}, tenant_id=tenant
            )
            key = LeaseKey(tenant, unique("failed"))
            lease = await instance.repository.acquire(key, "A", 30.0)
            assert lease is not None
            await instance.repository.dead_letter(
                key, f"boom{CLEAR}{TITLE}{BIDI} of {tenant}", epoch=lease.epoch
            )

    listed = await asyncio.to_thread(cli, database, "runs", "--tenant", mine)
    assert_inert(listed.stdout)
    assert "graph\\x1b[2J\\x1b[H" in listed.stdout  # shown, escaped
    assert "thread\\x1b]0;pwned\\x07\\u202e" in listed.stdout
    assert mine in listed.stdout
    assert theirs not in listed.stdout
    as_json = await asyncio.to_thread(cli, database, "runs", "--tenant", mine, "--json")
    assert_inert(as_json.stdout)
    entries = json.loads(as_json.stdout)
    assert [(e["tenant_id"], e["graph"], e["thread_id"]) for e in entries] == [
        (mine, graph, thread)
    ]
    for command in ("executions", "dead-letters"):
        done = await asyncio.to_thread(cli, database, command, "--tenant", mine)
        assert_inert(done.stdout)
        assert "boom\\x1b[2J\\x1b[H\\x1b]0;pwned\\x07\\u202e" in done.stdout
        assert theirs not in done.stdout

"""The README's quickstart, as written: started, SIGKILLed mid-node, taken over by
``langgraph-fence worker``, resumed with its configurable keys, context, recursion limit and
tags (issue 9).

The program is the README's first Python block under "Using it", extracted (not copied);
on SQLite (a file) and on PostgreSQL (a database of the test's own on the shared server,
dropped after: the quickstart takes a URL, not a schema).
"""

from __future__ import annotations

import asyncio
import os
import re
import signal
import sys
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest

from langgraph_fence import LeaseKey, LeaseStatus
from langgraph_fence.database import create_engine, normalize_url
from langgraph_fence.stores import SqlLeaseRepository
from tests.support.databases import SQL_BACKENDS, pg_admin
from tests.support.polling import eventually

#: The CLI or Python run in processes of their own (CI's lowest run leaves them to the newest).
pytestmark = pytest.mark.processes

README = Path(__file__).resolve().parents[2] / "README.md"
KEY = LeaseKey("acme", "order-42")
# What the quickstart's charge step prints when it runs with the config it was started with.
CHARGED = "charging order 42 for u-7 in EUR at token 2 (tags ['checkout'], recursion limit 10)"


def quickstart() -> str:
    """The README's quickstart program: the first Python block of "## Using it"."""
    text = README.read_text()
    section = text[text.index("\n## Using it\n") :]
    found = re.search(r"```python\n(.*?)```\n", section, re.S)
    assert found is not None, "the README's 'Using it' section has no python block"
    return found.group(1)


@pytest.fixture(params=SQL_BACKENDS)
def orders_db(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[str]:
    """The URL the quickstart runs on: a SQLite file, or a PostgreSQL database of its own."""
    if request.param == "sqlite":
        yield f"sqlite+aiosqlite:///{tmp_path / 'orders.db'}"
        return
    url, _ = request.getfixturevalue("pg_schema")  # skips (or fails) without PostgreSQL
    name = f"lgf_quickstart_{uuid.uuid4().hex[:12]}"
    pg_admin(url, f'CREATE DATABASE "{name}"')
    try:
        yield normalize_url(url).set(database=name).render_as_string(hide_password=False)
    finally:
        pg_admin(url, f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')


async def line_with(stream: asyncio.StreamReader, wanted: str, *, within: float) -> str:
    """The first line of ``stream`` that contains ``wanted`` (AssertionError after ``within``)."""
    seen: list[str] = []

    async def scan() -> str:
        while True:
            raw = await stream.readline()
            if not raw:
                raise AssertionError(f"{wanted!r} never came; the output was {seen}")
            line = raw.decode().rstrip("\n")
            seen.append(line)
            if wanted in line:
                return line

    try:
        return await asyncio.wait_for(scan(), within)
    except TimeoutError:
        raise AssertionError(f"{wanted!r} did not come in {within} s: {seen}") from None


def env_importing(directory: Path) -> dict[str, str]:
    """This process's environment, with modules in ``directory`` importable (and the ones
    this test imports, first)."""
    path = [str(directory), *filter(None, os.environ.get("PYTHONPATH", "").split(os.pathsep))]
    return {**os.environ, "PYTHONPATH": os.pathsep.join(path)}


async def start_worker(
    db: str, graphs: str, *options: str, cwd: Path, env: dict[str, str]
) -> asyncio.subprocess.Process:
    """``langgraph-fence worker --db DB --graphs GRAPHS`` polling every 0.2 s, without ``-v``;
    its stdout and stderr are piped."""
    return await asyncio.create_subprocess_exec(
        sys.executable,
        "-m",
        "langgraph_fence.cli",
        "worker",
        "--db",
        db,
        "--graphs",
        graphs,
        "--poll-interval",
        "0.2",
        *options,
        cwd=cwd,
        env=env,
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE,
    )


async def until_done(repository: SqlLeaseRepository, key: LeaseKey, *, within: float) -> None:
    """Wait (with a deadline) until the execution of ``key`` has ended ``done``."""

    async def done() -> bool:
        lease = await repository.get(key)
        return lease is not None and lease.status is LeaseStatus.DONE

    await eventually(done, timeout=within, what=f"{key.scope_key} to end done")


async def test_the_readme_quickstart_killed_mid_node_is_taken_over_by_the_worker(
    tmp_path: Path, orders_db: str
) -> None:
    (tmp_path / "orders.py").write_text(quickstart())
    env = {**env_importing(tmp_path), "ORDERS_DB": orders_db}
    # A slow model call in plan: the program is killed in it.
    program = await asyncio.create_subprocess_exec(
        sys.executable,
        "orders.py",
        cwd=tmp_path,
        env={**env, "PLAN_SECONDS": "600"},
        stdout=asyncio.subprocess.PIPE,
    )
    assert program.stdout is not None
    try:
        await line_with(program.stdout, "planning order 42", within=120)
    finally:
        program.send_signal(signal.SIGKILL)
        killed_output, _ = await program.communicate()
    assert "charging" not in killed_output.decode()

    worker = await start_worker(
        orders_db, "orders:graphs", cwd=tmp_path, env={**env, "PLAN_SECONDS": "0"}
    )
    assert worker.stdout is not None
    engine = create_engine(orders_db)
    try:
        # The lease lapses 10 s after the kill; the worker takes it at its next poll.
        charged = await line_with(worker.stdout, "charging order 42", within=180)
        repository = SqlLeaseRepository(engine)
        await until_done(repository, KEY, within=60)
        lease = await repository.get(KEY)
        assert lease is not None
        assert lease.epoch == 2  # one takeover, no other run
    finally:
        worker.send_signal(signal.SIGTERM)
        _, stderr = await asyncio.wait_for(worker.communicate(), 60)
        await engine.dispose()
    assert charged == CHARGED, stderr.decode()


async def test_the_readme_quickstart_stopped_with_ctrl_c_is_handed_back_at_once(
    tmp_path: Path, orders_db: str
) -> None:
    """Ctrl-C (SIGINT) mid-node: the run is handed back as it stops (``pending``, no holder),
    so a worker takes it at its next poll, not once the 10 s lease has run out; the order
    is charged once, by the worker. (It used to end ``failed``, "cancelled", and nothing
    resumed it.)"""
    (tmp_path / "orders.py").write_text(quickstart())
    env = {**env_importing(tmp_path), "ORDERS_DB": orders_db}
    program = await asyncio.create_subprocess_exec(
        sys.executable,
        "orders.py",
        cwd=tmp_path,
        env={**env, "PLAN_SECONDS": "600"},
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE,
    )
    assert program.stdout is not None
    try:
        await line_with(program.stdout, "planning order 42", within=120)
    finally:
        program.send_signal(signal.SIGINT)
        stopped_output, stopped_err = await asyncio.wait_for(program.communicate(), 60)
    assert "charging" not in stopped_output.decode()
    assert "KeyboardInterrupt" in stopped_err.decode()

    engine = create_engine(orders_db)
    try:
        repository = SqlLeaseRepository(engine)
        handed_back = await repository.get(KEY)
        assert handed_back is not None
        assert handed_back.status is LeaseStatus.PENDING, handed_back
        assert handed_back.holder is None  # released: nothing to wait out
        worker = await start_worker(
            orders_db, "orders:graphs", cwd=tmp_path, env={**env, "PLAN_SECONDS": "0"}
        )
        assert worker.stdout is not None
        try:
            charged = await line_with(worker.stdout, "charging order 42", within=180)
            await until_done(repository, KEY, within=60)
            lease = await repository.get(KEY)
            assert lease is not None
            assert lease.epoch == 2  # one take by the worker, no other run
        finally:
            worker.send_signal(signal.SIGTERM)
            rest, stderr = await asyncio.wait_for(worker.communicate(), 60)
    finally:
        await engine.dispose()
    assert charged == CHARGED, stderr.decode()
    assert "charging" not in rest.decode()  # once

"""The quickstart of docs/getting-started.md, as written: started, SIGKILLed mid-node, taken over by
``langgraph-fence worker``, resumed with its configurable keys, context, recursion limit and
tags (issue 9).

The program is the page's first Python block under "Using it", extracted (not copied);
on SQLite (a file) and on PostgreSQL (a database of the test's own on the shared server,
dropped after: the quickstart takes a URL, not a schema).
"""

from __future__ import annotations

import asyncio
import signal
import sys
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest

from langgraph_fence import LeaseKey, LeaseStatus
from langgraph_fence.database import create_engine, normalize_url
from langgraph_fence.lease.stores import SqlLeaseRepository
from tests.support.databases import SQL_BACKENDS, pg_admin
from tests.support.quickstart import env_importing, quickstart, start_worker, until_done

#: The CLI or Python run in processes of their own (CI's lowest run leaves them to the newest).
pytestmark = pytest.mark.processes

KEY = LeaseKey("acme", "order-42")
# What the quickstart's charge step prints when it runs with the config it was started with.
CHARGED = "charging order 42 for u-7 in EUR at token 2 (tags ['checkout'], recursion limit 10)"


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


async def planning(
    tmp_path: Path, orders_db: str
) -> tuple[asyncio.subprocess.Process, dict[str, str]]:
    """The README's quickstart, saved as ``orders.py`` and run as a program whose model
    call in plan is slow: returned (with the environment it runs in) once it is planning
    order 42, for the test to stop it there; killed if it never gets there."""
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
    except BaseException:
        program.kill()
        await program.communicate()
        raise
    return program, env


async def test_the_quickstart_killed_mid_node_is_taken_over_by_the_worker(
    tmp_path: Path, orders_db: str
) -> None:
    program, env = await planning(tmp_path, orders_db)  # the program is killed in plan
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


async def test_the_quickstart_stopped_with_ctrl_c_is_handed_back_at_once(
    tmp_path: Path, orders_db: str
) -> None:
    """Ctrl-C (SIGINT) mid-node: the run is handed back as it stops (``pending``, no holder),
    so a worker takes it at its next poll, not once the 10 s lease has run out; the order
    is charged once, by the worker. (It used to end ``failed``, "cancelled", and nothing
    resumed it.)"""
    program, env = await planning(tmp_path, orders_db)  # Ctrl-C in plan
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

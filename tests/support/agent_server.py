"""The real Agent Server for tests: ``langgraph dev`` (langgraph-cli[inmem]) started as a user
starts it, in a project folder of the test's own whose ``langgraph.json`` names
``langgraph_fence.server.checkpointer``, on a free port; and reads of the database it writes."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import sqlalchemy as sa

from tests.support.databases import sync_engine_for
from tests.support.polling import eventually_sync
from tests.support.processes import free_port
from tests.support.write_steps import Database

__all__ = ["agent_server", "rows", "serving"]

LANGGRAPH = str(Path(sys.executable).with_name("langgraph"))


def _async_url(database: Database) -> str:
    url = database.url
    if url.startswith("postgresql://"):
        return url.replace("postgresql://", "postgresql+asyncpg://", 1)
    return url


@contextmanager
def agent_server(
    database: Database,
    folder: Path,
    files: Mapping[str, str],
    graphs: Mapping[str, str],
    *,
    config: Mapping[str, Any] | None = None,
    args: tuple[str, ...] = (),
) -> Iterator[tuple[str, Path]]:
    """``langgraph dev`` serving ``graphs`` (``{"agent": "./agent.py:graph"}``) from a
    project in ``folder`` made of ``files``, with ``config`` merged into its
    ``langgraph.json``, on ``database``: its URL and its log, until the block ends (then
    SIGTERM, SIGKILL after 30 s)."""
    project = folder / "project"
    project.mkdir()
    for name, text in files.items():
        (project / name).write_text(text)
    spec = {
        "dependencies": ["."],
        "graphs": dict(graphs),
        "checkpointer": {"path": "langgraph_fence.server.checkpointer"},
        **(config or {}),
    }
    (project / "langgraph.json").write_text(json.dumps(spec))
    env = {"LANGGRAPH_FENCE_URL": _async_url(database)}
    if database.schema:
        env["LANGGRAPH_FENCE_SCHEMA"] = database.schema
    with serving(project, folder / "server.log", env, args) as url:
        yield url, folder / "server.log"


@contextmanager
def serving(
    project: Path, log: Path, env: Mapping[str, str], args: tuple[str, ...] = ()
) -> Iterator[str]:
    """``langgraph dev`` run in ``project`` as it is, with ``env`` added to an environment
    that holds no ``LANGGRAPH_FENCE_*`` variable of the test run's: its URL."""
    port = free_port()
    inherited = {
        k: v
        for k, v in os.environ.items()
        if k != "PYTHONPATH" and not k.startswith("LANGGRAPH_FENCE_")
    }
    env = {**inherited, **env}
    with log.open("wb") as out:
        proc = subprocess.Popen(
            [LANGGRAPH, "dev", "--no-browser", "--no-reload", "--port", str(port), *args],
            cwd=project,
            env=env,
            stdout=out,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
    try:

        def up() -> bool:
            assert proc.poll() is None, log.read_text()
            try:
                socket.create_connection(("127.0.0.1", port), timeout=1).close()
            except OSError:
                return False
            return "Using custom checkpointer: FencedCheckpointer" in log.read_text()

        eventually_sync(up, timeout=120.0, interval=0.2, what=log.read_text)
        yield f"http://127.0.0.1:{port}"
    finally:
        os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()


def rows(database: Database, sql: str, **params: Any) -> list[tuple[Any, ...]]:
    """The rows of ``sql`` on the database the server writes (a sync engine of its own)."""
    sqlite = database.url.startswith("sqlite")
    engine = sync_engine_for(
        "sqlite" if sqlite else "postgresql",
        database.url.split("///", 1)[-1] if sqlite else database.url,
        database.schema,
    )
    try:
        with engine.connect() as conn:
            return [tuple(row) for row in conn.execute(sa.text(sql), params)]
    finally:
        engine.dispose()

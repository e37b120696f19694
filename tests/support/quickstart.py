"""The quickstart (docs/getting-started.md) as a test runs it: its code, an environment
importing it, a worker process serving it, and a wait for its run to end."""

from __future__ import annotations

import asyncio
import os
import re
import sys
from pathlib import Path

from langgraph_fence import LeaseKey, LeaseStatus
from langgraph_fence.lease.stores import SqlLeaseRepository
from tests.support.polling import eventually


def quickstart() -> str:
    """The quickstart program: the first Python block of "## Using it" in getting-started.md
    (the README links to it)."""
    text = PAGE.read_text()
    section = text[text.index("\n## Using it\n") :]
    found = re.search(r"```python\n(.*?)```\n", section, re.S)
    assert found is not None, "getting-started.md's 'Using it' section has no python block"
    return found.group(1)


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


PAGE = Path(__file__).resolve().parents[2] / "docs" / "getting-started.md"

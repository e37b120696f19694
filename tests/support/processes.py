"""The processes a test starts: a worker or a script of its own, its output kept in files.

``start_process`` starts ``python <args>`` with this tree importable, stdout and stderr in
``<name>.out`` / ``<name>.err``; ``wait_ready`` waits (with a deadline) until the process
says or shows it is ready, and fails naming the tail of its stderr when it exits first or
the deadline passes; ``start_worker`` is both, for ``langgraph-fence worker``;
``stop_process`` leaves no process behind. The chaos tests and ``benchmarks/`` use them.
"""

from __future__ import annotations

import asyncio
import inspect
import json
import os
import signal
import socket
import sys
from collections.abc import Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

from tests.support.polling import DEFAULT_INTERVAL, eventually

T = TypeVar("T")

ROOT = Path(__file__).parents[2]
#: Where the chaos scripts leave their marks, when set: a test's processes start without it.
MARK_DIR_ENV = "LGF_CHAOS_MARK_DIR"
STARTUP_TIMEOUT = 60.0  # imports take seconds on a busy 2-core machine


def free_port() -> int:
    """A TCP port on 127.0.0.1 nothing listens on now (for a server a test starts)."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def tail(path: Path, limit: int = 3000) -> str:
    """The last ``limit`` characters of ``path`` (``<none>`` when it was never written)."""
    return path.read_text(errors="replace")[-limit:] if path.exists() else "<none>"


def read_json(path: Path) -> Any:
    """The JSON in ``path``, or ``None`` while it does not exist (written by one rename)."""
    return json.loads(path.read_text()) if path.exists() else None


def process_env(extra: Mapping[str, str] | None = None) -> dict[str, str]:
    """This process's environment with the tree importable, no mark directory, and ``extra``."""
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    env.pop(MARK_DIR_ENV, None)
    env.update(extra or {})
    return env


@dataclass(eq=False)
class Started:
    """A process a test started, and the files its output goes to."""

    name: str
    proc: asyncio.subprocess.Process
    out: Path
    err: Path

    @property
    def pid(self) -> int:
        return self.proc.pid

    @property
    def returncode(self) -> int | None:
        return self.proc.returncode

    def said(self) -> str:
        """Everything it printed so far, stdout then stderr."""
        return tail(self.out, 10**7) + tail(self.err, 10**7)

    async def wait(self) -> int:
        return await self.proc.wait()

    def post_mortem(self) -> str:
        return f"{self.name} (exit {self.proc.returncode}) stderr: {tail(self.err)}"


async def start_process(
    args: Sequence[str],
    directory: Path,
    name: str,
    *,
    env: Mapping[str, str] | None = None,
    stdin: bool = False,
    merge_output: bool = False,
) -> Started:
    """Start ``python *args`` in ``directory``'s files ``name.out``/``name.err`` (one file,
    ``name.log``, when ``merge_output``), from the tree's root, with :func:`process_env`
    and ``env`` on top. ``stdin`` gives it a pipe to write to."""
    out = directory / (f"{name}.log" if merge_output else f"{name}.out")
    err = out if merge_output else directory / f"{name}.err"
    with out.open("wb") as out_file, out_file if merge_output else err.open("wb") as err_file:
        proc = await asyncio.create_subprocess_exec(
            sys.executable,
            *args,
            stdin=asyncio.subprocess.PIPE if stdin else None,
            stdout=out_file,
            stderr=err_file,
            cwd=ROOT,
            env=process_env(env),
        )
    return Started(name, proc, out, err)


async def continued_report(worker: Started, within: float) -> dict[str, Any]:
    """SIGCONT a SIGSTOPped ``worker`` and wait up to ``within`` seconds for it to exit; the
    last line it printed: the JSON report of how its run ended."""
    os.kill(worker.pid, signal.SIGCONT)
    try:
        await asyncio.wait_for(worker.wait(), within)
    except TimeoutError:
        raise AssertionError(
            f"worker {worker.name} did not stop after SIGCONT: {worker.said()[-3000:]}"
        ) from None
    lines = worker.out.read_text().strip().splitlines()
    assert lines, f"worker {worker.name} printed nothing: {tail(worker.err)}"
    report: dict[str, Any] = json.loads(lines[-1])
    return report


async def wait_ready(
    started: Started,
    ready: Callable[[], Awaitable[T | None] | T | None] | str,
    *,
    timeout: float | None = None,  # noqa: ASYNC109 (as eventually's: checked between probes)
    deadline: float | None = None,
    interval: float = DEFAULT_INTERVAL,
    what: str = "",
) -> T:
    """Until ``ready`` holds: a probe (its answer returned), or a text the process prints.

    Fails (``AssertionError``) naming the process and the tail of its stderr when it exits
    first or the deadline passes (``STARTUP_TIMEOUT`` unless ``timeout``/``deadline``).
    """
    what = what or f"{started.name} to be ready"

    def probe_text() -> bool:
        return isinstance(ready, str) and ready in started.said()

    async def probe() -> T | None:
        if isinstance(ready, str):
            found: object = probe_text()
        else:
            found = ready()
            if inspect.isawaitable(found):
                found = await found
        if found is None or found is False:
            if started.proc.returncode is not None:
                raise AssertionError(f"{what}: it exited first. {started.post_mortem()}")
            return None
        return found  # type: ignore[return-value]

    if timeout is None and deadline is None:
        timeout = STARTUP_TIMEOUT
    try:
        return await eventually(
            probe, timeout=timeout, deadline=deadline, interval=interval, what=what
        )
    except AssertionError as exc:
        if "it exited first" in str(exc):
            raise
        raise AssertionError(f"{exc}. {started.post_mortem()}") from None


def worker_args(
    url: str,
    schema: str,
    graphs: str,
    *,
    ttl: float,
    poll: float,
    instance_id: str,
    extra: Sequence[str] = (),
    verbose: bool = False,
) -> list[str]:
    """``python`` arguments of ``langgraph-fence worker`` serving ``graphs`` (``module:f``)."""
    return [
        "-m",
        "langgraph_fence.cli",
        *(["-v"] if verbose else []),
        "worker",
        "--db",
        url,
        *(["--schema", schema] if schema else []),
        "--graphs",
        graphs,
        "--lease-ttl",
        str(ttl),
        "--poll-interval",
        str(poll),
        "--instance-id",
        instance_id,
        *extra,
    ]


async def start_worker(
    directory: Path,
    name: str,
    url: str,
    schema: str,
    graphs: str,
    *,
    ttl: float,
    poll: float,
    instance_id: str | None = None,
    extra: Sequence[str] = (),
    verbose: bool = False,
    env: Mapping[str, str] | None = None,
    merge_output: bool = False,
    wait: bool = True,
    timeout: float | None = None,  # noqa: ASYNC109 (as eventually's: checked between probes)
) -> Started:
    """Start ``langgraph-fence worker`` and (``wait``) return once it says it serves."""
    args = worker_args(
        url,
        schema,
        graphs,
        ttl=ttl,
        poll=poll,
        instance_id=instance_id or name,
        extra=extra,
        verbose=verbose,
    )
    started = await start_process(args, directory, name, env=env, merge_output=merge_output)
    if wait:
        await wait_ready(started, "serves", timeout=timeout, what=f"worker {name} to serve")
    return started


async def stop_process(proc: asyncio.subprocess.Process | Started, *, grace: float) -> None:
    """Continue, SIGTERM, and SIGKILL after ``grace`` seconds: the process is gone after."""
    if isinstance(proc, Started):
        proc = proc.proc
    if proc.returncode is not None:
        return
    try:
        os.kill(proc.pid, signal.SIGCONT)
        proc.terminate()
        await asyncio.wait_for(proc.wait(), grace)
    except (TimeoutError, ProcessLookupError):
        if proc.returncode is None:
            proc.kill()
            await proc.wait()

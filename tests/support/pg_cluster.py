"""Database faults for tests: a private PostgreSQL cluster a test may restart, stop and
kill (never the shared server), and a proxy that cuts one client off.

``PgCluster.create()`` runs ``initdb`` into a temporary folder (trust auth) and ``pg_ctl``
starts it on a free port of 127.0.0.1. Run as root, the server programs run as the
``postgres`` OS user (``runuser``), which owns the folder. :meth:`PgCluster.remove` stops it
and deletes the folder; the session fixture ``pg_cluster`` (``tests/conftest.py``) calls it
even when a test fails.
"""

from __future__ import annotations

import asyncio
import glob
import os
import shutil
import subprocess
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

from tests.support.processes import free_port

__all__ = ["CuttableProxy", "PgCluster", "find_bindir"]

#: Seconds pg_ctl waits for a start or a stop (a busy 2-core box).
PG_CTL_TIMEOUT = 60


def find_bindir() -> Path | None:
    """The newest ``/usr/lib/postgresql/*/bin`` that has initdb and pg_ctl, or ``None``."""
    found = []
    for bindir in glob.glob("/usr/lib/postgresql/*/bin"):
        path = Path(bindir)
        if (path / "initdb").exists() and (path / "pg_ctl").exists():
            found.append(path)

    def version(path: Path) -> float:
        try:
            return float(path.parent.name)
        except ValueError:
            return 0.0

    return max(found, key=version) if found else None


def _as_postgres() -> list[str]:
    """The prefix that runs a program as the ``postgres`` OS user (none if not root)."""
    if os.geteuid() != 0:
        return []
    runuser = shutil.which("runuser")
    if runuser is None:
        raise RuntimeError("running as root, and runuser is missing: cannot run initdb")
    return [runuser, "-u", "postgres", "--"]


@dataclass
class PgCluster:
    """One private cluster: its binaries, its folder and its port."""

    bindir: Path
    root: Path
    port: int

    @property
    def data(self) -> Path:
        return self.root / "data"

    @property
    def url(self) -> str:
        """The URL of its ``postgres`` database (user ``postgres``, trust auth)."""
        return f"postgresql://postgres@127.0.0.1:{self.port}/postgres"

    @classmethod
    def create(cls, bindir: Path) -> PgCluster:
        """initdb into a new temporary folder, then start on a free port."""
        root = Path(tempfile.mkdtemp(prefix="lgf-pg-"))
        cluster = cls(bindir, root, free_port())
        try:
            if os.geteuid() == 0:
                shutil.chown(root, "postgres", "postgres")
            cluster._run(
                "initdb", "-D", str(cluster.data), "-U", "postgres", "-A", "trust", "--no-sync"
            )
            cluster.start()
        except BaseException:
            cluster.remove()
            raise
        return cluster

    def _run(self, program: str, *args: str) -> str:
        done = subprocess.run(
            [*_as_postgres(), str(self.bindir / program), *args],
            capture_output=True,
            text=True,
            timeout=PG_CTL_TIMEOUT + 30,
            cwd=self.root,
        )
        if done.returncode != 0:
            raise RuntimeError(
                f"{program} {' '.join(args)} exited {done.returncode}: {done.stderr or done.stdout}"
            )
        return done.stdout

    def start(self) -> None:
        """Start the server and wait until it accepts connections."""
        options = f"-p {self.port} -c listen_addresses=127.0.0.1 -k {self.root} -c fsync=off"
        self._run(
            "pg_ctl",
            "-D",
            str(self.data),
            "-l",
            str(self.root / "server.log"),
            "-o",
            options,
            "-t",
            str(PG_CTL_TIMEOUT),
            "-w",
            "start",
        )

    def stop(self, mode: str = "fast") -> None:
        """Stop the server (``fast``: every session is terminated, as an admin shutdown)."""
        self._run(
            "pg_ctl", "-D", str(self.data), "-m", mode, "-t", str(PG_CTL_TIMEOUT), "-w", "stop"
        )

    def restart(self, down_for: float = 0.0) -> float:
        """Stop, stay down ``down_for`` seconds, start again; returns the seconds it was down."""
        began = time.monotonic()
        self.stop()
        rest = down_for - (time.monotonic() - began)
        if rest > 0:
            time.sleep(rest)  # the outage's length, not a wait for a state
        self.start()
        return time.monotonic() - began

    def sql(self, statement: str) -> str:
        """Run one statement with psql; its output (tuples only)."""
        return self._run(
            "psql",
            "-h",
            "127.0.0.1",
            "-p",
            str(self.port),
            "-U",
            "postgres",
            "-d",
            "postgres",
            "-At",
            "-c",
            statement,
        ).strip()

    def kill_backends(self, application_name: str) -> int:
        """Terminate every session tagged ``application_name``; how many there were."""
        if "'" in application_name:
            raise ValueError(f"application_name must not hold a quote, got {application_name!r}")
        return int(
            self.sql(
                "SELECT count(pg_terminate_backend(pid)) FROM pg_stat_activity"
                f" WHERE application_name = '{application_name}' AND pid <> pg_backend_pid()"
            )
        )

    def remove(self) -> None:
        """Stop the server (if it runs) and delete its folder."""
        try:
            if (self.data / "postmaster.pid").exists():
                self.stop(mode="immediate")
        finally:
            shutil.rmtree(self.root, ignore_errors=True)


class CuttableProxy:
    """A TCP proxy to a database that a test can cut: a connection fault for ONE client.

    While cut, every proxied connection is closed and every new one is accepted and closed
    at once (counted in :attr:`refused`): the client sees its connection die and cannot
    make a new one, while other clients of the same server go on.
    """

    def __init__(self, host: str, port: int) -> None:
        self._upstream = (host, port)
        self._cut = False
        self._live: set[asyncio.StreamWriter] = set()
        self._server: asyncio.Server | None = None
        self.refused = 0
        self.port = 0

    async def start(self) -> CuttableProxy:
        self._server = await asyncio.start_server(self._serve, "127.0.0.1", 0)
        self.port = int(self._server.sockets[0].getsockname()[1])
        return self

    def cut(self) -> None:
        self._cut = True
        for writer in list(self._live):
            writer.transport.abort()

    def heal(self) -> None:
        self._cut = False

    async def close(self) -> None:
        self.cut()
        if self._server is not None:
            self._server.close()
            await self._server.wait_closed()

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        if self._cut:
            self.refused += 1
            writer.transport.abort()
            return
        try:
            up_reader, up_writer = await asyncio.open_connection(*self._upstream)
        except OSError:
            writer.transport.abort()
            return
        self._live.update((writer, up_writer))

        async def pipe(source: asyncio.StreamReader, sink: asyncio.StreamWriter) -> None:
            try:
                while data := await source.read(65536):
                    sink.write(data)
                    await sink.drain()
            except (OSError, asyncio.IncompleteReadError):
                pass
            finally:
                sink.transport.abort()

        try:
            await asyncio.gather(pipe(reader, up_writer), pipe(up_reader, writer))
        finally:
            self._live.difference_update((writer, up_writer))

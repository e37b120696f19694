"""A replicated PostgreSQL pair of the test's own: a primary and a streaming standby on
loopback (``initdb``, ``pg_basebackup -R``), whose replication a test cuts and whose primary
it kills before it promotes the standby: the failover a Patroni or a managed service does.

Never the shared server: both clusters live in temporary folders and :meth:`ReplicatedPair.remove`
deletes them, even after a failure.
"""

from __future__ import annotations

import os
import shutil
import tempfile
import time
from pathlib import Path

from tests.support.pg_cluster import PgCluster
from tests.support.processes import free_port

__all__ = ["ReplicatedPair"]

#: Seconds to wait for the standby to catch up, or to drop its replication connection.
REPLICATION_TIMEOUT = 30.0


class ReplicatedPair:
    """A primary and its standby; after :meth:`fail_over`, the promoted standby alone."""

    def __init__(self, primary: PgCluster, standby: PgCluster) -> None:
        self.primary = primary
        self.standby = standby
        self.promoted = False

    @classmethod
    def create(cls, bindir: Path, *, synchronous: bool = False) -> ReplicatedPair:
        """A new primary, a standby streaming from it (synchronous: every commit waits for
        the standby to flush it), both up."""
        primary = PgCluster.create(bindir)
        standby = None
        try:
            root = Path(tempfile.mkdtemp(prefix="lgf-standby-"))
            standby = PgCluster(bindir, root, free_port())  # removed with its folder below
            if os.geteuid() == 0:
                shutil.chown(root, "postgres", "postgres")
            standby._run(
                "pg_basebackup",
                "-h", "127.0.0.1", "-p", str(primary.port), "-U", "postgres",
                "-D", str(standby.data), "-R", "-X", "stream", "--no-sync",
            )  # fmt: skip
            standby.start()
            pair = cls(primary, standby)
            pair.caught_up()
            if synchronous:
                primary.sql("ALTER SYSTEM SET synchronous_standby_names = '*'")
                primary.sql("SELECT pg_reload_conf()")
                pair._until(
                    lambda: primary.sql("SELECT count(*) FROM pg_stat_replication "
                                        "WHERE sync_state = 'sync'") == "1",
                    "the standby to become synchronous",
                )  # fmt: skip
            return pair
        except BaseException:
            if standby is not None:
                standby.remove()
            primary.remove()
            raise

    @property
    def url(self) -> str:
        """The multi-host URL workers use: the primary first, then the standby."""
        return (
            f"postgresql://postgres@127.0.0.1:{self.primary.port},"
            f"127.0.0.1:{self.standby.port}/postgres"
        )

    def _until(self, done: object, what: str) -> None:
        deadline = time.monotonic() + REPLICATION_TIMEOUT
        while not done():  # type: ignore[operator]
            if time.monotonic() > deadline:
                raise TimeoutError(f"waited {REPLICATION_TIMEOUT} s for {what}")
            time.sleep(0.02)  # polling the servers' own views; no event to wait on

    def caught_up(self) -> None:
        """Wait until the standby has replayed everything the primary wrote so far."""
        target = self.primary.sql("SELECT pg_current_wal_lsn()")
        self._until(
            lambda: self.standby.sql(
                f"SELECT pg_last_wal_replay_lsn() >= '{target}'::pg_lsn"
            ) == "t",
            f"the standby to replay up to {target}",
        )  # fmt: skip

    def cut(self) -> None:
        """Stop the standby's replication: what the primary commits from now on, the
        standby never sees (an asynchronous standby that fell behind, a network split)."""
        self.standby.sql("ALTER SYSTEM SET primary_conninfo = ''")
        self.standby.sql("SELECT pg_reload_conf()")
        self._until(
            lambda: self.standby.sql("SELECT count(*) FROM pg_stat_wal_receiver") == "0",
            "the standby's WAL receiver to stop",
        )

    def fail_over(self) -> None:
        """Kill the primary (immediate stop: no checkpoint, every session cut) and promote
        the standby, as an HA manager does when the primary stops answering."""
        self.primary.stop(mode="immediate")
        self.standby._run("pg_ctl", "-D", str(self.standby.data), "-w", "-t", "60", "promote")
        self.promoted = True

    def timeline(self) -> int:
        """The promoted (or primary) server's timeline."""
        server = self.standby if self.promoted else self.primary
        return int(
            server.sql(
                "SELECT CAST(CAST(('x' || substr(pg_walfile_name(pg_current_wal_lsn()), 1, 8))"
                " AS bit(32)) AS bigint)"
            )
        )

    def remove(self) -> None:
        """Stop both servers and delete their folders."""
        try:
            self.standby.remove()
        finally:
            self.primary.remove()

"""The migrations' advisory lock is one number across every process and release: a worker
of the last version and one of this version migrating the same database at once must take
the same lock, or both act on the version they read."""

from __future__ import annotations

import zlib

from langgraph_fence.database.migrations import MIGRATION_LOCK_ID


def test_the_migration_lock_is_the_one_every_release_takes() -> None:
    # The text of 0.1.0's module path, whatever the module's path is now.
    assert zlib.crc32(b"langgraph_fence.migrations") == MIGRATION_LOCK_ID == 1576637424

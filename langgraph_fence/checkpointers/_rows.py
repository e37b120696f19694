"""What the saver hands its dialect drivers, and what they hand back: plain values, no I/O.

Every row and every query names its tenant: the tenant is part of each thread's key.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol

if TYPE_CHECKING:
    from langgraph_fence.lease import Lease

__all__ = [
    "BlobRow",
    "CheckpointFields",
    "CheckpointQuery",
    "CheckpointRow",
    "Driver",
    "Guard",
    "StoredCheckpoint",
    "TaskWrites",
    "WriteRow",
]


@dataclass(frozen=True, slots=True)
class Guard:
    """The lease a write must still hold: key, holder and epoch, in state ``running``.

    ``clear_keys``: entries of the lease's stamp set the write clears in its own statement or
    transaction: a checkpoint always (it lands with them), a task's writes only when every
    checkpoint of ``proof`` is stored (orphan writes prove nothing to a resume).
    ``proof``: for a task's writes, ``(checkpoint_ns, checkpoint_id)`` of the checkpoint they
    belong to and of every ancestor's (``langgraph_fence.fence.admission.writes_proof``).
    """

    tenant_id: str
    execution_id: str
    holder: str
    epoch: int
    clear_keys: tuple[str, ...] = ()
    proof: tuple[tuple[str, str], ...] = ()

    @classmethod
    def of(
        cls,
        lease: Lease,
        clear_keys: tuple[str, ...] = (),
        proof: tuple[tuple[str, str], ...] = (),
    ) -> Guard:
        """The guard of a write made under ``lease``."""
        return cls(
            tenant_id=lease.key.tenant_id,
            execution_id=lease.key.execution_id,
            holder=lease.holder or "",
            epoch=lease.epoch,
            clear_keys=clear_keys,
            proof=proof,
        )


#: ``(channel, version, type, blob)``
BlobRow = tuple[str, str, str, bytes | None]
#: ``(idx, channel, type, blob)``
WriteRow = tuple[int, str, str, bytes]


@dataclass(frozen=True, slots=True)
class CheckpointFields:
    """What a checkpoint row holds written and read alike: its key, its parent, and the
    checkpoint serialized (``type``, ``checkpoint``)."""

    tenant_id: str
    thread_id: str
    checkpoint_ns: str
    checkpoint_id: str
    parent_checkpoint_id: str | None
    type: str
    checkpoint: bytes


@dataclass(frozen=True, slots=True)
class CheckpointRow(CheckpointFields):
    """One checkpoint, serialized, ready to insert, with the blobs it writes."""

    channel_versions: str
    metadata: str
    run_id: str | None
    blobs: Sequence[BlobRow] = ()

    def columns(self) -> tuple[Any, ...]:
        """The row's values in the table's column order, up to ``run_id``."""
        return (
            self.tenant_id,
            self.thread_id,
            self.checkpoint_ns,
            self.checkpoint_id,
            self.parent_checkpoint_id,
            self.type,
            self.checkpoint,
            self.channel_versions,
            self.metadata,
            self.run_id,
        )


@dataclass(frozen=True, slots=True)
class TaskWrites:
    """A task's writes for one checkpoint, serialized, ready to insert."""

    tenant_id: str
    thread_id: str
    checkpoint_ns: str
    checkpoint_id: str
    task_id: str
    task_path: str
    writes: Sequence[WriteRow]
    #: Every channel is one of LangGraph's special ones: a write again replaces the row.
    upsert: bool

    def key(self) -> tuple[str, str, str, str, str, str]:
        """The columns every row of the task's writes shares, in the table's order."""
        return (
            self.tenant_id,
            self.thread_id,
            self.checkpoint_ns,
            self.checkpoint_id,
            self.task_id,
            self.task_path,
        )


@dataclass(frozen=True, slots=True)
class CheckpointQuery:
    """Which checkpoints to read, newest first: always of one tenant."""

    tenant_id: str
    thread_id: str | None = None
    checkpoint_ns: str | None = None
    checkpoint_id: str | None = None
    metadata_filter: Mapping[str, Any] | None = None
    before_id: str | None = None
    limit: int | None = None


@dataclass(frozen=True, slots=True)
class StoredCheckpoint(CheckpointFields):
    """One checkpoint as read back, with its channel blobs and pending writes."""

    metadata: str
    #: ``(channel, type, blob)`` for every channel version the checkpoint references
    blobs: Sequence[tuple[str, str, bytes | None]]
    #: ``(task_id, channel, type, blob, task_path, idx)``
    writes: Sequence[tuple[str, str, str, bytes, str, int]]

    @classmethod
    def selected(
        cls,
        tenant_id: str,
        row: Sequence[Any],
        blobs: Sequence[tuple[str, str, bytes | None]],
        writes: Sequence[tuple[str, str, str, bytes, str, int]],
    ) -> StoredCheckpoint:
        """From a row of a driver's select, whose first columns are ``thread_id,
        checkpoint_ns, checkpoint_id, parent_checkpoint_id, type, checkpoint, metadata``."""
        thread_id, checkpoint_ns, checkpoint_id, parent_id, type_, checkpoint, metadata = row[:7]
        return cls(
            tenant_id,
            thread_id,
            checkpoint_ns,
            checkpoint_id,
            parent_id,
            type_,
            checkpoint,
            metadata,
            blobs,
            writes,
        )


class Driver(Protocol):
    """The hot paths of one dialect, each one statement (PostgreSQL) or one transaction run
    in one hop to the connection's thread (SQLite)."""

    async def put(self, row: CheckpointRow, guard: Guard | None) -> bool:
        """Insert the blobs and the checkpoint; ``False`` (and nothing written) when the
        guard found no current lease."""
        ...

    async def put_writes(self, task: TaskWrites, guard: Guard | None) -> tuple[bool, bool]:
        """Insert a task's writes: ``(landed, cleared)``. ``landed`` is ``False`` (and nothing
        written) when the guard refused; ``cleared`` tells whether ``guard.clear_keys`` were
        cleared (only when the writes' checkpoint is stored)."""
        ...

    async def select(self, query: CheckpointQuery) -> list[StoredCheckpoint]:
        """The checkpoints matching ``query``, newest first, with blobs and writes."""
        ...

    async def aclose(self) -> None:
        """Give the held connections back to the engine's pool."""
        ...

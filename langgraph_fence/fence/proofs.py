"""What a run knows of its own stored checkpoints: enough to clear a stamp whose writes
raced their proof, at the next checkpoint of the run instead of never.

A task's finished writes clear its stamp-set entries only when every checkpoint of their
proof is stored (``langgraph_fence.fence.admission.writes_proof``: the writes' own checkpoint and
every ancestor's). Under ``durability="async"`` one of those is often still in flight when
the writes land, and the entries then stood until the next *root* checkpoint, which for a
long subgraph comes only after it ends: a crash in between dead-lettered an execution whose
write a resume would in fact have seen (a false dead letter). So a run remembers the
checkpoints it stored and the entries whose writes landed unproven; each later checkpoint
of the run clears, in its own guarded statement, every such entry whose proof it completes.
"""

from __future__ import annotations

__all__ = ["CheckpointAt", "WriteProofs"]

#: ``(checkpoint_ns, checkpoint_id)``: one stored checkpoint a proof needs.
CheckpointAt = tuple[str, str]


class WriteProofs:
    """One run's stored checkpoints, and its entries whose writes landed unproven.

    Touched only on the run's event loop (every saver call of a run is made there).
    """

    __slots__ = ("_stored", "_unproven")

    def __init__(self) -> None:
        self._stored: set[CheckpointAt] = set()
        self._unproven: dict[str, tuple[CheckpointAt, ...]] = {}

    def landed_unproven(
        self, keys: tuple[str, ...], proof: tuple[CheckpointAt, ...]
    ) -> tuple[str, ...]:
        """The finished writes of the entries ``keys`` are stored, and their statement did
        not see all of ``proof`` stored. Returns ``keys`` when this run has stored every
        checkpoint of it meanwhile (the last one landed while the writes were in flight):
        the caller clears them now. Else they wait for the checkpoint that completes it."""
        if all(pair in self._stored for pair in proof):
            return keys
        for key in keys:
            self._unproven[key] = proof
        return ()

    def provable(self, at: CheckpointAt) -> tuple[str, ...]:
        """The unproven entries a checkpoint stored at ``at`` would prove: every checkpoint
        of their proof is ``at`` or one this run stored."""
        if not self._unproven:
            return ()
        stored = self._stored
        return tuple(
            key
            for key, proof in self._unproven.items()
            if all(pair == at or pair in stored for pair in proof)
        )

    def stored(self, at: CheckpointAt, cleared: tuple[str, ...] = ()) -> tuple[str, ...]:
        """The run stored the checkpoint ``at``, and with it cleared ``cleared``; returns the
        unproven entries it proves besides (their writes landed while it was in flight,
        after its statement was made): the caller clears them."""
        for key in cleared:
            self._unproven.pop(key, None)
        proven = self.provable(at)
        self._stored.add(at)
        for key in proven:
            del self._unproven[key]
        return proven

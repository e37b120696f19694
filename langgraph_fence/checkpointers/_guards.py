"""Which guard a fenced write of a ``SqlCheckpointer`` carries into its statement, after the
local checks; and the error a write its guard refused raises.
"""

from __future__ import annotations

import logging
from collections.abc import Callable

from langchain_core.runnables import RunnableConfig

from langgraph_fence.checkpointers._rows import Guard
from langgraph_fence.errors import ExecutionLeaseLostError
from langgraph_fence.fence import RunHandle
from langgraph_fence.fence.admission import admit_write, refuse_write
from langgraph_fence.lease import Lease
from langgraph_fence.lease.transitions import fenced_error

__all__ = ["WriteGuards", "refused"]

logger = logging.getLogger("langgraph_fence.checkpointers")

#: Keys LangGraph's Agent Server puts in a run's ``config["metadata"]``
#: (``langgraph_api/stream.py``): a write that carries one comes from a server-run attempt.
_AGENT_SERVER_METADATA = ("run_attempt", "langgraph_api_version")


class WriteGuards:
    """The guards of one saver's fenced writes.

    Args:
        store_id: the saver's database, named as lease stores name theirs.
        guards: whether the saver checks a handle's token inside its own writes.
    """

    def __init__(self, store_id: str, guards: Callable[[object], bool]) -> None:
        self._store_id = store_id
        self._guards = guards
        # The guard of the lease the last fenced write was made under.
        self._memo: tuple[Lease, Guard] | None = None
        self._guarded_handle: RunHandle | None = None  # the last handle guards() accepted
        self._told_unfenced = False

    def of_write(
        self,
        handle: RunHandle | None,
        config: RunnableConfig,
        action: str,
        clear_keys: Callable[[RunHandle], tuple[str, ...]],
    ) -> Guard | None:
        """The guard of a fenced write (``None`` without a handle), after the local checks:
        a handle of another store, a run already fenced, a thread of another execution are
        refused here, before anything is read or written."""
        if handle is None:
            if not self._told_unfenced:
                self._tell_unfenced(config, action)
            return None
        # Whether this saver guards a handle is a matter of the handle's store, which a
        # handle keeps for its life: asked once per run, not on each write.
        if handle is not self._guarded_handle and not self._guards(handle):
            raise ValueError(
                f'{action}: config["configurable"]["__fence"] holds a lease of store '
                f"{handle.repository.store_id!r}, and this saver's database is "
                f"{self._store_id!r}: it cannot check that token inside its writes. Keep the "
                "leases in the checkpoints' database, or wrap the saver: "
                "FencedCheckpointer(saver) checks the token before delegating"
            )
        admit_write(handle, config, action)
        # One guard per Lease object, which is immutable: a renewal or a re-take (a new
        # token) hands the handle a new one, so a guard is never of a superseded lease.
        self._guarded_handle = handle
        lease = handle.lease
        keys = clear_keys(handle)
        if keys:
            return Guard.of(lease, keys)
        memo = self._memo
        if memo is not None and memo[0] is lease:
            return memo[1]
        guard = Guard.of(lease)
        self._memo = (lease, guard)
        return guard

    def _tell_unfenced(self, config: RunnableConfig, action: str) -> None:
        """Say it once, loudly, when a run of LangGraph's Agent Server writes through this
        saver: no lease was taken for it, so its writes are not fenced (never a silent
        downgrade; fencing server runs is not supported yet)."""
        metadata = config.get("metadata")
        if not isinstance(metadata, dict) or not any(
            key in metadata for key in _AGENT_SERVER_METADATA
        ):
            return
        self._told_unfenced = True
        logger.warning(
            "SqlCheckpointer %s: a run of LangGraph's Agent Server (run_attempt %s) writes "
            "without a lease: its checkpoints and writes are NOT fenced, and a re-dispatched "
            "attempt's writes land beside the first one's. Fencing server runs is not "
            "supported yet: see docs/agent-server.md (run graphs through an Instance and "
            "`langgraph-fence worker` for the fence)",
            action,
            metadata.get("run_attempt"),
        )


async def refused(
    handle: RunHandle, config: RunnableConfig, action: str
) -> ExecutionLeaseLostError:
    """The error of a write its guard refused, recorded on the run."""
    # The failure path only: one more read, to say which epoch the store has now.
    current = await handle.repository.get(handle.key)
    return refuse_write(handle, config, fenced_error(handle.lease, current, action=action))

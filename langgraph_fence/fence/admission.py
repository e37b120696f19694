"""Write admission: the checks every fenced write makes, whoever stores it.

Below both the wrapper (:class:`~langgraph_fence.saver.checkpoint.FencedCheckpointer`) and the
fence-aware savers (:mod:`langgraph_fence.checkpointers`): the run handle a write carries,
the thread it may write, the refusal recorded on the run, and which stamp entries the
write may clear once what a resume needs is stored.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from typing import Any

from langchain_core.runnables import RunnableConfig
from langgraph.checkpoint.serde.types import ERROR, INTERRUPT
from langgraph.config import get_config
from langgraph.store.base import GetOp, Op, PutOp, SearchOp

from langgraph_fence._compat import pregel_runtime
from langgraph_fence.errors import ExecutionFencedError, ExecutionLeaseLostError
from langgraph_fence.fence import RunHandle
from langgraph_fence.fence.proofs import CheckpointAt
from langgraph_fence.keys import FENCE_CONFIG_KEY
from langgraph_fence.lease.guard import holds
from langgraph_fence.lease.transitions import fenced_error
from langgraph_fence.validate import store_key, store_namespace

__all__ = [
    "admit_write",
    "check_held",
    "check_write_scope",
    "checked_ops",
    "checkpoint_clear_keys",
    "fence_handle",
    "refuse_write",
    "step_config",
    "writes_clear_keys",
    "writes_proof",
]


def fence_handle(config: RunnableConfig) -> RunHandle | None:
    """The run handle at ``config["configurable"]["__fence"]``, or ``None`` when absent.

    Raises:
        ValueError: something other than a :class:`~langgraph_fence.fence.RunHandle` is
            there (a lease, a token, another library's object), or the handle's lease does
            not come from the handle's repository.
    """
    configurable = config.get("configurable") or {}
    handle = configurable.get(FENCE_CONFIG_KEY)
    if handle is None:
        return None
    if not isinstance(handle, RunHandle):
        raise ValueError(
            f'config["configurable"]["{FENCE_CONFIG_KEY}"] must be the RunHandle of the run '
            f"(langgraph_fence.fence.RunHandle), got {type(handle).__name__}: pass the handle "
            "the runtime created for the run (Instance.ainvoke does), or leave the key out to "
            "write unfenced"
        )
    if not handle.from_own_store():
        lease = handle.lease
        raise ValueError(
            f'config["configurable"]["{FENCE_CONFIG_KEY}"] holds a RunHandle whose lease '
            f"({getattr(lease, 'store_id', type(lease).__name__)!r}) does not come from its "
            f"repository ({handle.repository.store_id!r}): build the handle from the lease "
            "its own repository returned"
        )
    return handle


def check_write_scope(handle: RunHandle, config: RunnableConfig, *, action: str) -> None:
    """Refuse a write to a thread that is not the handle's execution.

    The thread's execution is ``configurable["execution_id"]`` (default: the ``thread_id``)
    of tenant ``configurable["tenant_id"]`` when given. A handle of another execution holds
    no right to this thread, whatever its token.

    Raises:
        ExecutionFencedError: the handle covers another execution (not recorded here).
        ValueError: the config names no thread.
    """
    configurable = config.get("configurable") or {}
    if configurable.get("thread_id") is None:
        raise ValueError(
            f'{action} needs config["configurable"]["thread_id"]: pass '
            'config={"configurable": {"thread_id": "<your thread id>"}}'
        )
    execution_id = configurable.get("execution_id") or str(configurable["thread_id"])
    tenant_id = configurable.get("tenant_id")
    key = handle.key
    if key.execution_id != execution_id or (tenant_id is not None and tenant_id != key.tenant_id):
        raise ExecutionFencedError(
            f"{action} refused: thread {configurable.get('thread_id')!r} belongs to execution "
            f"{execution_id!r}{'' if tenant_id is None else f' of tenant {tenant_id!r}'}, but "
            f"the run handle holds the lease of {handle.scope_key!r} (token {handle.token}): a "
            "lease covers its own execution only. Pass the handle of this thread's execution.",
            scope_key=handle.scope_key,
            token_held=handle.token,
            token_seen=None,
        )


def step_config() -> RunnableConfig:
    """The config of the LangGraph step running now, or an empty one outside any step.

    For a write that is handed no config (a store op): :func:`refuse_write` finds the run's
    drain control in it.
    """
    try:
        return get_config()
    except RuntimeError:
        return {}


async def check_held(handle: RunHandle, config: RunnableConfig, action: str) -> None:
    """The check a write to a store that cannot check tokens makes before it delegates.

    Locally first (no I/O), then one read of the lease compared by the one guard
    (:func:`~langgraph_fence.lease.guard.holds`). A refusal is recorded on the run
    (:func:`refuse_write`) and raised. **Window:** a take-over committed after the read and
    before the delegated write completes is not seen; that write lands.

    Raises:
        ExecutionLeaseLostError: the hold can no longer be proven, or (as
            ``ExecutionFencedError``) the lease was taken over.
    """
    try:
        handle.check()
        current = await handle.repository.get(handle.key)
        if not holds(handle.lease, current):
            raise fenced_error(handle.lease, current, action=action)
    except ExecutionLeaseLostError as exc:
        raise refuse_write(handle, config, exc) from None


def admit_write(handle: RunHandle, config: RunnableConfig, action: str) -> None:
    """The local checks of a fenced write (no I/O), made before anything is read or
    written: a run already fenced or lost, a thread of another execution (and any tenant
    but the run's) are refused with :func:`refuse_write`."""
    try:
        if handle.error is not None:
            raise handle.error
        check_write_scope(handle, config, action=action)
    except ExecutionLeaseLostError as exc:
        raise refuse_write(handle, config, exc) from None


def refuse_write(
    handle: RunHandle, config: RunnableConfig, error: ExecutionLeaseLostError
) -> ExecutionLeaseLostError:
    """Record ``error`` on the handle, ask the run to drain, and return the error to raise.

    The handle keeps the first fencing error of the run; that one is returned, so every
    place that raises raises the same object. The drain goes through LangGraph's
    ``RunControl`` (``runtime.control.request_drain``) when the run has one: a run with
    ``durability="async"`` then stops at the next superstep boundary instead of running on
    ahead of its refused checkpoints.
    """
    recorded = handle.record(error)
    runtime = pregel_runtime(config.get("configurable") or {})
    control = getattr(runtime, "control", None)
    if control is not None:
        control.request_drain(f"execution {handle.scope_key} fenced at token {handle.token}")
    return recorded


#: Writes that record a step that did not finish: its effect may or may not have happened.
_UNFINISHED = frozenset({ERROR, INTERRUPT})


def writes_clear_keys(
    handle: RunHandle, task_id: str, writes: Sequence[tuple[str, Any]]
) -> tuple[str, ...]:
    """The entries of the stamp set these writes of ``task_id`` may clear.

    Only the task's own entries, and only with writes of a finished step: an error or an
    interrupt write leaves them standing (nothing proves the effect did not start), so a
    resume of that step is dead-lettered rather than repeated. The saver clears them only
    where the writes are seen by a resume: their checkpoint is stored.
    """
    if not handle.pending_effects or any(channel in _UNFINISHED for channel, _ in writes):
        return ()
    return tuple(k for k, e in handle.pending_effects.items() if e.task_id == task_id)


def writes_proof(config: RunnableConfig) -> tuple[CheckpointAt, ...]:
    """The checkpoints that must all be stored for a task's writes (saved with ``config``)
    to be seen by a resume: the one they belong to, and every ancestor's.

    A resume starts from the root. It re-runs the root task that runs a subgraph unless the
    root checkpoint of that task's superstep is stored; a re-run from an earlier root
    checkpoint gives that task a new id, so the subgraph starts over in a new namespace and
    writes stored in the old one are seen by nobody. So a subgraph task's writes prove its
    step recorded only once the checkpoint of every level above it is stored too: LangGraph's
    ``checkpoint_map`` names them (``""`` the root's).
    """
    configurable = config.get("configurable") or {}
    own_ns = str(configurable.get("checkpoint_ns") or "")
    proof: dict[str, str] = {}
    ancestors = configurable.get("checkpoint_map")
    if isinstance(ancestors, Mapping):
        for ns, checkpoint_id in ancestors.items():
            if isinstance(ns, str) and isinstance(checkpoint_id, str) and checkpoint_id:
                proof[ns] = checkpoint_id
    proof[own_ns] = str(configurable.get("checkpoint_id") or "")
    return tuple(sorted(proof.items()))


def checkpoint_clear_keys(
    handle: RunHandle, config: RunnableConfig, checkpoint_id: str
) -> tuple[str, ...]:
    """The entries of the stamp set a checkpoint ``checkpoint_id`` clears.

    A root checkpoint is taken after every task of the supersteps before it finished and
    their writes were applied, so a resume from it (or a later one) never runs those steps
    again: it clears every entry whose superstep checkpoint is older. Checkpoint ids are
    ordered (LangGraph's uuid6), so "older" is a string comparison.

    Any checkpoint of the run (a subgraph's too) also clears the entries whose finished
    writes landed before their proof was stored, once it completes that proof
    (:class:`~langgraph_fence.fence.proofs.WriteProofs`).
    """
    pending = handle.pending_effects
    if not pending:
        return ()
    ns = (config.get("configurable") or {}).get("checkpoint_ns") or ""
    proven = [k for k in handle.proofs.provable((ns, checkpoint_id)) if k in pending]
    if ns:
        return tuple(proven)
    older = [k for k, e in pending.items() if e.checkpoint_id and e.checkpoint_id < checkpoint_id]
    return tuple(dict.fromkeys(older + proven))


def checked_ops(ops: Iterable[Op]) -> list[Op]:
    """``ops`` as a list, each namespace and key checked (:func:`~langgraph_fence.validate.
    store_namespace`, :func:`~langgraph_fence.validate.store_key`): a NUL, a lone surrogate,
    a period in a label or an over-long namespace or key is a ``ValueError`` naming the
    argument and its limit, before anything is read or written (never a driver error)."""
    listed = list(ops)
    for op in listed:
        if isinstance(op, PutOp | GetOp):
            store_namespace("namespace", op.namespace)
            store_key("key", op.key)
        elif isinstance(op, SearchOp):
            store_namespace("namespace_prefix", op.namespace_prefix)
    return listed

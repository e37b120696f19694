"""Agent Server run attempts: which attempt holds a thread, decided by the lease store.

LangGraph's Agent Server runs a run again (attempt 2, 3, ...) when it stops hearing from the
worker of the attempt before, which may still be running (langgraph issues #7213, #7417).
Each attempt names itself with a *stamp*, ``(run_id, attempt)`` as one sortable text: the
server's run ids are UUIDv7, so a later run sorts after an earlier one, and a later attempt
of a run after an earlier attempt of it.

The store keeps, per execution, the latest stamp that started. An attempt starting with a
stamp older than that one is superseded for ever (:class:`ExecutionSupersededError`); one
with a newer stamp becomes the latest and, if an earlier attempt holds the lease, fences it
(the epoch moves on, the lease is left pending and unheld): every later write, renewal or
release of the earlier attempt is refused, and the new attempt's take (the next token)
decides the stamps that attempt left, as any take does (a non-idempotent one standing
dead-letters the execution instead of repeating the write).
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import replace
from typing import Any

from langgraph_fence.errors import ExecutionSupersededError
from langgraph_fence.lease import Lease, LeaseKey, LeaseStatus

__all__ = ["attempt_stamp", "decide_supersede", "server_attempt", "superseded_error"]

#: Up to 10**9 - 1 attempts sort as text.
_ATTEMPT_DIGITS = 9
_RUN_ID = re.compile(r"[0-9A-Za-z-]{1,64}")


def attempt_stamp(run_id: str, attempt: int) -> str:
    """The stamp of ``attempt`` of server run ``run_id``: later runs and later attempts sort
    after earlier ones.

    Raises:
        ValueError: ``run_id`` is not a run id (letters, digits, ``-``; at most 64), or
            ``attempt`` is not a positive int below 10**9.
    """
    if not isinstance(run_id, str) or not _RUN_ID.fullmatch(run_id):
        raise ValueError(f"run_id must be the server's run id (a UUID), got {run_id!r}")
    if isinstance(attempt, bool) or not isinstance(attempt, int) or not 0 < attempt < 10**9:
        raise ValueError(f"run_attempt must be a positive int, got {attempt!r}")
    return f"{run_id.lower()}#{attempt:0{_ATTEMPT_DIGITS}d}"


def server_attempt(config: Mapping[str, Any]) -> str | None:
    """The stamp of the Agent Server run attempt ``config`` is of, or ``None`` for a run the
    server did not start (no ``langgraph_api_version`` in its metadata).

    Raises:
        ValueError: the server started it but ``config`` lacks the run's id
            (``configurable["run_id"]``) or attempt (``metadata["run_attempt"]``): its
            attempts could not be told apart, so it is refused rather than run unfenced.
    """
    metadata = config.get("metadata")
    if not isinstance(metadata, Mapping) or "langgraph_api_version" not in metadata:
        return None
    configurable = config.get("configurable") or {}
    run_id, attempt = configurable.get("run_id"), metadata.get("run_attempt")
    if run_id is None or attempt is None:
        raise ValueError(
            f"an Agent Server run (langgraph-api {metadata['langgraph_api_version']}) without "
            f"configurable['run_id'] ({run_id!r}) or metadata['run_attempt'] ({attempt!r}): "
            "its attempts cannot be fenced apart, so it is refused; run a langgraph-api "
            "release langgraph_fence.server supports"
        )
    return attempt_stamp(str(run_id), attempt)


def superseded_error(key: LeaseKey, stamp: str, latest: str) -> ExecutionSupersededError:
    """The refusal of attempt ``stamp`` of ``key`` where ``latest`` started."""
    return ExecutionSupersededError(
        f"execution {key.scope_key!r}: Agent Server attempt {_said(stamp)} was superseded by "
        f"attempt {_said(latest)}, which holds the thread; this attempt never runs or writes"
    )


def _said(stamp: str) -> str:
    run_id, _, attempt = stamp.partition("#")
    return f"{int(attempt)} of run {run_id}" if attempt.isdigit() else repr(stamp)


def decide_supersede(
    key: LeaseKey, current: Lease | None, latest: str | None, stamp: str
) -> Lease | None:
    """Start attempt ``stamp`` of ``key`` where ``latest`` is the newest stamp that started
    (``None``: none) and ``current`` the lease: the lease to write, or ``None`` to leave it.

    The caller records ``stamp`` as the newest when this returns (in the same transaction).

    - ``latest`` newer than ``stamp``: refused, :class:`ExecutionSupersededError`.
    - ``current`` running for a holder and an older stamp started before (``latest <
      stamp``): that attempt is fenced, the lease returned at the next epoch, pending, with
      no holder and its stamps kept for the new attempt's take to decide.
    - Otherwise (no lease, not held, no stamp before: a run not started by the server holds
      it, or the same stamp again after a server restart): ``None``; the take decides.
    """
    if latest is not None and latest > stamp:
        raise superseded_error(key, stamp, latest)
    held = (
        current is not None and current.status is LeaseStatus.RUNNING and current.holder is not None
    )
    if not held or latest is None or latest == stamp:
        return None
    assert current is not None
    return replace(
        current,
        epoch=current.epoch + 1,
        holder=None,
        expires_at=None,
        status=LeaseStatus.PENDING,
        reason=f"superseded by Agent Server attempt {_said(stamp)}",
    )

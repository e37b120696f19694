"""A submitted run's recorded stream: the events its holders wrote, what a takeover
withdraws, and the order any process reads them in.

Each event row (``fence_stream``) carries the token of the holder that produced it
(``epoch``), its place in that holder's stream (``seq``), and the root checkpoint its step
began from (``after``; ``""``: none). A holder writes a step's events under its lease
(:data:`RECORD`, after the guard read :data:`HELD`) before the checkpoint that ends the step,
so a checkpoint that is stored has its step's events stored before it. A taker that resumes
from checkpoint ``C`` withdraws the events older holders wrote after ``C``
(:data:`WITHDRAW`): it runs those steps again and writes their events itself.

So an event is final once a root checkpoint newer than its ``after`` is stored (no takeover
resumes before it), or once its run has ended: a reader shows a prefix of final events, in
``(epoch, seq)`` order, and never one that is withdrawn later.
"""

from __future__ import annotations

from collections.abc import Collection, Iterable, Sequence
from typing import Any, Final, NamedTuple

from sqlalchemy import text

from langgraph_fence.lease.guard import guard_sql

__all__ = [
    "HELD",
    "NS_SEP",
    "PREAMBLE",
    "READ",
    "RECORD",
    "RECORDED_AFTER",
    "STREAM_MODES",
    "STREAM_OF",
    "WITHDRAW",
    "Kept",
    "check_stream_mode",
    "joined_modes",
    "keep_tuples",
    "kept_at",
    "listed_modes",
    "restore_tuples",
    "split_modes",
]

#: The stream modes a submitted run can record (LangGraph's, with the same events).
STREAM_MODES: Final = ("values", "updates", "custom", "messages")
#: How a namespace's parts are joined in a row (LangGraph's own separator).
NS_SEP: Final = "|"

_GUARD = guard_sql(
    tenant_id=":tenant_id", execution_id=":execution_id", holder=":holder", epoch=":epoch"
)


def held_sql(pg: bool) -> str:
    """The guard read of a stream write: the lease row, still this hold; on PostgreSQL read
    ``FOR SHARE``, so a take waits for the write's commit (and a write after a take finds
    the new token and writes nothing)."""
    return "SELECT 1 FROM fence_leases WHERE " + _GUARD + (" FOR SHARE" if pg else "")


HELD = {pg: text(held_sql(pg)) for pg in (False, True)}
RECORD = text(
    "INSERT INTO fence_stream (run_id, epoch, seq, tenant_id, execution_id, after, task, node, "
    "mode, ns, payload_type, payload, withdrawn) VALUES (:run_id, :epoch, :seq, :tenant_id, "
    ":execution_id, :after, :task, :node, :mode, :ns, :payload_type, :payload, 0) "
    "ON CONFLICT (run_id, epoch, seq) DO NOTHING"
)
#: What older holders recorded at or after the checkpoint a take begins from.
RECORDED_AFTER = text(
    "SELECT epoch, seq, after, task, node, mode FROM fence_stream WHERE run_id = :run_id "
    "AND epoch < :epoch AND after >= :resume_from AND withdrawn = 0"
)
WITHDRAW = text(
    "UPDATE fence_stream SET withdrawn = 1 WHERE run_id = :run_id AND epoch = :epoch AND seq = :seq"
)
#: The task of an event a take recorded before its first step (the state it began from).
PREAMBLE: Final = "^"


class Kept(NamedTuple):
    """What a take's withdrawal kept of older holders' events."""

    #: Whether an older holder's events of the state the take begins from were kept.
    preamble: bool
    #: The nodes of the kept updates of tasks whose writes the take applies (one per
    #: task): LangGraph replays those updates, and the take leaves its replay out.
    replayed: tuple[str, ...] = ()


def kept_at(
    rows: Iterable[Any], resume_from: str, finished: Collection[str]
) -> tuple[set[tuple[int, int]], Kept]:
    """Of older holders' events at or after checkpoint ``resume_from`` (rows with
    ``epoch``, ``seq``, ``after``, ``task``), the positions a take beginning there keeps,
    and what they keep (:class:`Kept`).

    Kept: the events of the first holder that began from ``resume_from`` before its first
    step (the take does not record its own), and the events of each task in ``finished``
    (its writes are stored: the take applies them and does not run it) recorded by the
    last holder that ran it (an earlier one died before its writes were stored). Every
    other event is of a step the take runs again."""
    at = [r for r in rows if r.after == resume_from]
    keep: set[tuple[int, int]] = set()
    began = [r.epoch for r in at if r.task == PREAMBLE]
    if began:
        first = min(began)
        keep.update((r.epoch, r.seq) for r in at if r.task == PREAMBLE and r.epoch == first)
    replayed: list[str] = []
    for task in finished:
        ran = [r.epoch for r in at if r.task == task]
        if ran:
            last = max(ran)
            mine = [r for r in at if r.task == task and r.epoch == last]
            keep.update((r.epoch, r.seq) for r in mine)
            replayed.extend(r.node for r in mine if r.mode == "updates" and r.node)
    return keep, Kept(bool(began), tuple(replayed))


READ = text(
    "SELECT epoch, seq, after, mode, ns, payload_type, payload FROM fence_stream "
    "WHERE run_id = :run_id AND withdrawn = 0 AND (epoch > :epoch OR (epoch = :epoch "
    "AND seq > :seq)) ORDER BY epoch, seq LIMIT :limit"
)
STREAM_OF = text(
    "SELECT stream_modes, thread_id FROM fence_runs WHERE run_id = :run_id "
    "AND tenant_id = :tenant_id AND execution_id = :execution_id"
)


def check_stream_mode(stream_mode: object, *, name: str = "stream_mode") -> tuple[str, ...]:
    """``stream_mode`` (one mode or several) as a tuple of distinct modes, in order.

    Raises:
        ValueError: an empty list, or a mode a submitted run cannot record, named with the
            ones it can.
    """
    modes: tuple[object, ...]
    if isinstance(stream_mode, str):
        modes = (stream_mode,)
    elif isinstance(stream_mode, Sequence):
        modes = tuple(stream_mode)
    else:
        raise ValueError(
            f"{name} must be a stream mode or a list of them ({', '.join(STREAM_MODES)}), "
            f"got {stream_mode!r}"
        )
    if not modes:
        raise ValueError(f"{name} is empty: name at least one of {', '.join(STREAM_MODES)}")
    bad = [m for m in modes if m not in STREAM_MODES]
    if bad:
        raise ValueError(
            f"{name} has {', '.join(map(repr, bad))}: a submitted run records "
            f"{', '.join(STREAM_MODES)} (the others describe one process's run, not the run)"
        )
    return tuple(dict.fromkeys(str(m) for m in modes))


def joined_modes(modes: Sequence[str] | None, *, listed: bool = True) -> str | None:
    """The modes as the run's row keeps them (``None``: none recorded); ``listed``: they
    were given as a list (read as ``(mode, payload)``), kept with a trailing comma."""
    if not modes:
        return None
    return ",".join(modes) + ("," if listed else "")


def split_modes(stored: str | None) -> tuple[str, ...]:
    """The modes a run's row keeps, read tolerantly: a mode this version does not know is
    left out, never an error."""
    if not stored:
        return ()
    return tuple(m for m in stored.split(",") if m in STREAM_MODES)


#: The mark of a tuple in a stored event (the serializer stores tuples as lists).
_TUPLE = "__langgraph_fence_tuple__"


def keep_tuples(value: Any) -> Any:
    """``value`` with each tuple among its dicts and lists marked, so that it reads back as
    the tuple LangGraph streamed (``__interrupt__``, a ``messages`` event), not a list."""
    kind = type(value)
    if kind is tuple:
        return {_TUPLE: [keep_tuples(v) for v in value]}
    if kind is list:
        return [keep_tuples(v) for v in value]
    if kind is dict:
        return {k: keep_tuples(v) for k, v in value.items()}
    return value


def restore_tuples(value: Any) -> Any:
    """What :func:`keep_tuples` marked, as it was."""
    kind = type(value)
    if kind is list:
        return [restore_tuples(v) for v in value]
    if kind is dict:
        if len(value) == 1 and _TUPLE in value:
            return tuple(restore_tuples(v) for v in value[_TUPLE])
        return {k: restore_tuples(v) for k, v in value.items()}
    return value


def listed_modes(stored: str | None) -> bool:
    """Whether the run's modes were given as a list (its stream reads ``(mode, payload)``)."""
    return "," in (stored or "")

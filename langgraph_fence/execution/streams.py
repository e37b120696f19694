"""The holder's side of a submitted run's recorded stream: every event the run produces in
its recorded modes, written under the run's lease before the writes of the task that
produced it and the checkpoint that ends its step.

A :class:`StreamRecorder` is made for each take of a run submitted with ``stream_mode``
(:meth:`Instance.submit <langgraph_fence.Instance.submit>`). It hooks the run's config so
LangGraph hands it each event as it is produced (:func:`~langgraph_fence._compat.
record_stream_config`), tags it with the root checkpoint its step began from and the root
task that produced it, and keeps it until a root task's writes or checkpoint is about to be
written (the run handle's ``before_root_write``) or the run ends: then it writes them,
guarded by the lease. So whatever a resume finds stored (a checkpoint, a finished task's
writes), the events that led to it are stored before it.

A take begins with the state it begins from (LangGraph streams it first): an older holder
streamed it already when the take resumes from a checkpoint of the run, or began from the
same one; those events are left out. Tasks of its first step whose writes were stored are
not run again: LangGraph replays their updates (marked cached), left out too, since the
older holder's events of those tasks are kept (:mod:`langgraph_fence.queue._streams`).
"""

from __future__ import annotations

import asyncio
import logging
import threading
from typing import TYPE_CHECKING, Any

from langgraph_fence._compat import messages_stream_handler, record_stream_config
from langgraph_fence.queue import NS_SEP, STREAM_PREAMBLE, keep_tuples

if TYPE_CHECKING:
    from langchain_core.runnables import RunnableConfig

    from langgraph_fence.fence import RunHandle
    from langgraph_fence.queue import SubmittedRuns

__all__ = ["StreamRecorder"]

logger = logging.getLogger("langgraph_fence.streams")


class StreamRecorder:
    """Records one take of a submitted run's stream (see the module).

    Args:
        queue: the run queue the events are written to.
        handle: the run's handle (its lease guards each write).
        run_id: the submitted run.
        modes: the modes recorded.
        after: the checkpoint the take begins from (``""``: none).
        skip_preamble: leave out the events before the take's first step (the state it
            begins from, which an older holder streamed already).
        replayed: the nodes of the tasks of the first step whose stored writes the take
            applies instead of running them, and whose updates an older holder recorded:
            LangGraph's replay of those updates (marked cached) is left out.
    """

    def __init__(
        self,
        queue: SubmittedRuns,
        handle: RunHandle,
        run_id: str,
        modes: tuple[str, ...],
        *,
        after: str,
        skip_preamble: bool,
        replayed: tuple[str, ...] = (),
    ) -> None:
        self._queue = queue
        self._handle = handle
        self.run_id = run_id
        self.modes = frozenset(modes)
        # Events come from the run's loop and from its sync steps' worker threads.
        self._lock = threading.Lock()
        self._writing = asyncio.Lock()
        self._rows: list[dict[str, Any]] = []
        self._seq = 0
        self._after = after
        self._steps = 0  # root checkpoints seen: 0 before the first step, 1 in it
        self._skip_preamble = skip_preamble
        self._replayed = list(replayed)
        self._last_update: dict[str, Any] | None = None
        self._told: set[str] = set()

    def config(self, config: RunnableConfig, *, store: Any = None) -> RunnableConfig:
        """``config`` with the hooks that hand this recorder the run's events (``store``:
        the graph's, which the run keeps)."""
        hooked = {"checkpoints", *(self.modes & {"values", "updates", "custom"})}
        if "updates" in self.modes:
            hooked.add("tasks")  # which task each update is of
        configurable = record_stream_config(
            config.get("configurable") or {}, self._emit, hooked, store
        )
        out: dict[str, Any] = {**config, "configurable": configurable}
        if "messages" in self.modes:
            handler = messages_stream_handler(self._emit)
            callbacks = config.get("callbacks")
            if callbacks is None:
                out["callbacks"] = [handler]
            elif isinstance(callbacks, list):
                out["callbacks"] = [*callbacks, handler]
            else:  # a callback manager
                manager = callbacks.copy()
                manager.add_handler(handler, inherit=True)
                out["callbacks"] = manager
        return out  # type: ignore[return-value]

    def _emit(self, chunk: tuple[Any, ...]) -> None:
        ns, mode, payload = chunk[:3]
        if not ns and mode in ("checkpoints", "tasks"):
            self._boundary(mode, payload)
            return
        if mode not in self.modes:
            return
        if not ns and mode == "updates" and self._replay(payload):
            return
        try:
            payload_type, blob = self._queue.serde.dumps_typed(keep_tuples(payload))
        except Exception as exc:
            # Never the run's failure: the run goes on, its stream without this event.
            if mode not in self._told:
                self._told.add(mode)
                logger.warning(
                    "run %s: a %r stream event cannot be stored (%s: %s); it is left out of "
                    "the recorded stream",
                    self.run_id,
                    mode,
                    type(exc).__name__,
                    exc,
                )
            return
        with self._lock:
            if self._steps == 0 and self._skip_preamble:
                return
            update = mode == "updates" and not ns
            row = {
                "run_id": self.run_id,
                "seq": self._seq,
                "after": self._after,
                "task": STREAM_PREAMBLE if self._steps == 0 else _task_of(ns, mode, payload, chunk),
                "node": _node_of(payload) if update else None,
                "mode": mode,
                "ns": NS_SEP.join(ns),
                "payload_type": payload_type,
                "payload": blob,
            }
            self._rows.append(row)
            self._seq += 1
            if update:  # told whose by the tasks event that follows it
                self._last_update = row

    def _boundary(self, mode: str, payload: Any) -> None:
        """A root step begins (``checkpoints``: from that checkpoint) or a root task ended
        (``tasks`` with a result: the update just recorded is that task's)."""
        with self._lock:
            if mode == "checkpoints":
                self._after = str(payload["config"]["configurable"]["checkpoint_id"])
                self._steps += 1
                self._last_update = None
            elif "result" in payload:
                update, self._last_update = self._last_update, None
                if update is not None and update["node"] == payload.get("name"):
                    update["task"] = str(payload["id"])

    def _replay(self, payload: Any) -> bool:
        """Whether an update is LangGraph's replay of a task of the take's first step whose
        stored writes it applies (left out: that task's own events are recorded)."""
        cached = isinstance(payload, dict) and (payload.get("__metadata__") or {}).get("cached")
        node = _node_of(payload)
        with self._lock:
            if not cached or self._steps != 1 or node not in self._replayed:
                return False
            self._replayed.remove(node)
            return True

    async def flush(self) -> None:
        """Write the events kept so far, under the run's lease.

        Raises:
            ExecutionFencedError: the lease is no longer the run's (nothing written).
        """
        # LangGraph starts a save eagerly (it runs at once, up to its first await) and
        # hands over the task's update and end right after starting it: one pass of the
        # loop first, so they are in this write, before the task's writes are saved.
        await asyncio.sleep(0)
        # One write at a time, in order: a reader moves past what it read, so a later write
        # must never commit before an earlier one (a checkpoint and a task's writes, or
        # parallel tasks' writes, ask for a write at once).
        async with self._writing:
            with self._lock:
                rows, self._rows = self._rows, []
            if not rows:
                return
            try:
                landed = await self._queue.record_stream(self._handle.lease, rows)
            except BaseException:
                with self._lock:  # kept for the next write
                    self._rows[:0] = rows
                raise
        if not landed:
            await self._handle.renew()  # raises the fencing error the refusal means
            raise RuntimeError(f"the stream of run {self.run_id} was refused")


def _task_of(ns: tuple[str, ...], mode: str, payload: Any, chunk: tuple[Any, ...]) -> str | None:
    """The root task an event is of (``None``: none known yet, or none): a subgraph's
    events name it first in their namespace; a root step's ``custom`` events carry it, its
    ``messages`` name it in their metadata; its ``updates`` are told by the ``tasks`` event
    that follows them."""
    if ns:
        return ns[0].split(":")[-1]
    if mode == "custom" and len(chunk) > 3:
        return str(chunk[3])
    if mode == "messages":
        try:
            return str(payload[1]["langgraph_checkpoint_ns"]).split("|")[0].split(":")[-1]
        except (LookupError, TypeError):
            return None
    return None


def _node_of(payload: Any) -> str | None:
    """The node a root update is of (``{node: writes}``, beside LangGraph's metadata)."""
    if not isinstance(payload, dict):
        return None
    return next((str(k) for k in payload if k != "__metadata__"), None)

"""The holder's side of a submitted run's recorded stream: every event the run produces in
its recorded modes, written under the run's lease before the checkpoint that ends its step.

A :class:`StreamRecorder` is made for each take of a run submitted with ``stream_mode``
(:meth:`Instance.submit <langgraph_fence.Instance.submit>`). It hooks the run's config so
LangGraph hands it each event as it is produced (:func:`~langgraph_fence._compat.
record_stream_config`), tags it with the root checkpoint its step began from, and keeps it
until the run's next root checkpoint is about to be written (the run handle's
``before_checkpoint``) or the run ends: then it writes them, guarded by the lease. A
takeover resuming from a checkpoint begins with the state it resumes from, which the
holder before it streamed already: the events before its first step are not recorded.
"""

from __future__ import annotations

import logging
import threading
from typing import TYPE_CHECKING, Any

from langgraph_fence._compat import messages_stream_handler, record_stream_config
from langgraph_fence.queue import NS_SEP, keep_tuples

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
        after: the checkpoint the run resumes from (``""``: none).
        resumed: whether this take resumes from a checkpoint rather than the run's input.
    """

    def __init__(
        self,
        queue: SubmittedRuns,
        handle: RunHandle,
        run_id: str,
        modes: tuple[str, ...],
        *,
        after: str,
        resumed: bool,
    ) -> None:
        self._queue = queue
        self._handle = handle
        self.run_id = run_id
        self.modes = frozenset(modes)
        # Events come from the run's loop and from its sync steps' worker threads.
        self._lock = threading.Lock()
        self._rows: list[dict[str, Any]] = []
        self._seq = 0
        self._after = after
        self._skipping = resumed
        self._told: set[str] = set()

    def config(self, config: RunnableConfig) -> RunnableConfig:
        """``config`` with the hooks that hand this recorder the run's events."""
        hooked = {"checkpoints", *(self.modes & {"values", "updates", "custom"})}
        configurable = record_stream_config(config.get("configurable") or {}, self._emit, hooked)
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

    def _emit(self, chunk: tuple[tuple[str, ...], str, Any]) -> None:
        ns, mode, payload = chunk
        if mode == "checkpoints":
            if not ns:  # a root step begins from this checkpoint
                checkpoint_id = str(payload["config"]["configurable"]["checkpoint_id"])
                with self._lock:
                    self._after = checkpoint_id
                    self._skipping = False
            return
        if mode not in self.modes:
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
            if self._skipping:
                return
            self._rows.append(
                {
                    "run_id": self.run_id,
                    "seq": self._seq,
                    "after": self._after,
                    "mode": mode,
                    "ns": NS_SEP.join(ns),
                    "payload_type": payload_type,
                    "payload": blob,
                }
            )
            self._seq += 1

    async def flush(self) -> None:
        """Write the events kept so far, under the run's lease.

        Raises:
            ExecutionFencedError: the lease is no longer the run's (nothing written).
        """
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

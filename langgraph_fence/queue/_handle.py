"""A handle on one submitted run, from the process that submitted it or any other: its
state, its end (waited for), and its cancel."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Collection, Sequence
from contextlib import nullcontext
from typing import TYPE_CHECKING, Any

from langgraph_fence.errors import RunFailedError
from langgraph_fence.lease import LeaseKey, LeaseStatus
from langgraph_fence.lease.transitions import is_yielded
from langgraph_fence.queue._callbacks import CallbackState
from langgraph_fence.queue._state import RunState
from langgraph_fence.queue.notifications import ENDS_CHANNEL
from langgraph_fence.validate import positive_seconds

if TYPE_CHECKING:
    from langgraph_fence.queue._submitted_runs import SubmittedRuns

__all__ = ["SubmittedRun"]

#: Statuses a submitted run ends in (``waiting``: it reached an interrupt).
_ENDED = frozenset({"done", "waiting", "failed", "dead_lettered", "cancelled"})


class SubmittedRun:
    """A handle on a submitted run, from the process that submitted it or any other
    (:meth:`Instance.get_run <langgraph_fence.Instance.get_run>`).

    A handle with a ``run_id`` follows that one submit: its state and output are its own,
    even after later runs of the thread (``on_busy="enqueue"``) began. Without one, it
    follows the execution's run, whichever is the latest.

    Attributes:
        key: the execution.
        run_id: the submitted run's id, or ``None``.
    """

    def __init__(
        self,
        queue: SubmittedRuns,
        key: LeaseKey,
        run_id: str | None = None,
        *,
        checkpointer: Any = None,
    ) -> None:
        self._queue = queue
        self.key = key
        self.run_id = run_id
        # The saver of the run's thread: which of its checkpoints are stored tells which
        # recorded events are final (astream).
        self._checkpointer = checkpointer

    def __repr__(self) -> str:
        return f"SubmittedRun({self.key.scope_key!r}, run_id={self.run_id!r})"

    @property
    def scope_key(self) -> str:
        """The execution's scope key."""
        return self.key.scope_key

    async def state(self) -> RunState:
        """Where the run stands now (one read).

        Raises:
            KeyError: no execution of that key exists.
        """
        found = await self._queue.state(self.key, self.run_id)
        if found is None:
            raise KeyError(f"no execution {self.key.scope_key!r}: nothing was submitted under it")
        return found[0]

    async def result(
        self,
        timeout: float | None = None,  # noqa: ASYNC109 - the API is result(timeout=...)
        *,
        poll_interval: float = 0.05,
        allow: Collection[tuple[str, ...]] = (),
    ) -> Any:
        """Wait for the run's end and return its output (what ``graph.ainvoke`` returned).

        A run that reached an interrupt ends ``waiting``: its output is the state with
        ``__interrupt__``, as ``ainvoke`` returns it.

        Args:
            timeout: seconds to wait (``None``: as long as it takes).
            poll_interval: the longest pause between looks (they start faster). On
                PostgreSQL the run's end wakes the wait at once (LISTEN on
                :data:`~langgraph_fence.queue.notifications.ENDS_CHANNEL`), and it looks every
                ``poll_interval`` (at least a second) only in case that notification was
                lost.
            allow: ``(module, name)`` pairs the output may construct besides what the
                serializer allows (your state types).

        Raises:
            RunFailedError: the run ended ``failed`` (its error, or cancelled) or
                ``dead_lettered``; the message names the execution, its end and why.
            TimeoutError: it had not ended within ``timeout``.
            KeyError: no execution of that key exists.
        """
        if timeout is not None:
            timeout = positive_seconds("timeout", timeout, what="how long result() waits")
        pause = positive_seconds("poll_interval", poll_interval, what="between looks")
        loop = asyncio.get_running_loop()
        deadline = None if timeout is None else loop.time() + timeout
        wait = min(0.005, pause)
        ended = asyncio.Event()
        notifications = self._queue.notifications
        # Subscribed before the first look: an end after it is not missed.
        async with (
            notifications.subscribe(ENDS_CHANNEL, ended, self.key.scope_key)
            if notifications is not None
            else nullcontext(False)
        ) as listening:
            while True:
                ended.clear()
                found = await self._queue.state(self.key, self.run_id)
                if found is None:
                    raise KeyError(f"no execution {self.key.scope_key!r}: nothing was submitted")
                state, stored = found
                # A yielded run (waiting for its children, holder kept) has not ended.
                if state.status.value in _ENDED and not is_yielded(state.status, state.holder):
                    return self._end(state, stored, allow)
                if deadline is not None and loop.time() >= deadline:
                    raise TimeoutError(
                        f"execution {self.key.scope_key!r} had not ended after {timeout:g} s "
                        f"(it is {state.status.value}, held by {state.holder or 'no worker'} "
                        f"at token {state.epoch}): is a worker serving graph {state.graph!r}? "
                        "See `langgraph-fence runs`"
                    )
                left = pause if deadline is None else max(0.0, deadline - loop.time())
                if listening:
                    # Woken by the run's end; a look every poll_interval (at least a
                    # second) in case that notification was lost.
                    with contextlib.suppress(TimeoutError):
                        await asyncio.wait_for(ended.wait(), min(max(pause, 1.0), left))
                else:
                    await asyncio.sleep(min(wait, left))
                    wait = min(wait * 2, pause)

    async def callbacks(self) -> list[CallbackState]:
        """Where each of the run's completion callbacks stands (its webhook, its
        registered callback), by target.

        Raises:
            ValueError: a handle without ``run_id``.
        """
        if self.run_id is None:
            raise ValueError(
                "this handle follows whichever run is the latest: ask the handle submit() "
                "returned, or instance.get_run(..., run_id=...)"
            )
        return await self._queue.callbacks.of_run(self.run_id)

    async def join(
        self,
        timeout: float | None = None,  # noqa: ASYNC109 - the API is join(timeout=...)
        *,
        allow: Collection[tuple[str, ...]] = (),
    ) -> Any:
        """Wait for the run's end, from any process, and return its output: the same as
        :meth:`result` (the name LangGraph's Agent Server gives it)."""
        return await self.result(timeout, allow=allow)

    async def astream(
        self,
        stream_mode: str | Sequence[str] | None = None,
        *,
        subgraphs: bool = False,
        poll_interval: float = 0.1,
        allow: Collection[tuple[str, ...]] = (),
    ) -> AsyncIterator[Any]:
        """The run's stream, from any process, while it runs and after it ended: the events
        an in-process ``graph.astream(input, config, stream_mode=..., subgraphs=...)`` of the
        run would yield, in its order and shapes, from its start (a run submitted with
        ``stream_mode=``, in those modes).

        An event is shown once it is final: once the checkpoint that ends its step is
        stored, or the run has ended. A takeover's re-run of a step is shown once, never
        the superseded holder's attempt at it; so a step's events (``messages`` tokens
        too) arrive when the step's checkpoint is stored, not as they are produced, and a
        run with ``durability="exit"`` shows its events when it ends. The stream ends with
        the run (``done``, ``waiting`` at an interrupt, ``failed``, ...): a failed run's
        stream ends without raising; :meth:`result` says why it failed.

        Args:
            stream_mode: a mode or modes the run records (default: as it was submitted;
                a list of modes yields ``(mode, payload)``, one mode its payloads).
            subgraphs: include subgraphs' events, as ``(namespace, ...)`` tuples.
            poll_interval: the longest pause between looks at the store.
            allow: ``(module, name)`` pairs the events may construct besides what the
                serializer allows (your state types).

        Raises:
            ValueError: a handle without ``run_id``, a run submitted without
                ``stream_mode``, or a mode it does not record; named with the fix.
            KeyError: no such run.
        """
        from langgraph_fence.queue._streams import check_stream_mode

        if self.run_id is None:
            raise ValueError(
                f"this handle of {self.key.scope_key!r} follows whichever run is the latest: "
                "stream one run, with the handle submit() returned or "
                "instance.get_run(..., run_id=...)"
            )
        pause = positive_seconds("poll_interval", poll_interval, what="between looks")
        found = await self._queue.stream_of(self.key, self.run_id)
        if found is None:
            raise KeyError(f"no run {self.run_id!r} of execution {self.key.scope_key!r}")
        recorded, listed, thread_id = found
        if not recorded:
            raise ValueError(
                f"run {self.run_id!r} of {self.key.scope_key!r} records no stream: submit it "
                "with stream_mode=[...] (e.g. stream_mode=['values', 'updates'])"
            )
        wanted = recorded if stream_mode is None else check_stream_mode(stream_mode)
        missing = [m for m in wanted if m not in recorded]
        if missing:
            raise ValueError(
                f"run {self.run_id!r} records {', '.join(recorded)}, not "
                f"{', '.join(missing)}: submit it with stream_mode={list(wanted)!r}"
            )
        single = isinstance(stream_mode, str) or (stream_mode is None and not listed)
        position = (-1, -1)
        wait = min(0.005, pause)
        while True:
            state = await self.state()
            ended = state.status.value in _ENDED and not is_yielded(state.status, state.holder)
            stored = "" if ended else await self._latest(thread_id)
            rows = await self._queue.stream_rows(self.run_id, position, 500)
            shown = 0
            for row in rows:
                if not ended and not row.after < stored:
                    break  # its step's checkpoint is not stored yet: not final
                position = (int(row.epoch), int(row.seq))
                shown += 1
                ns = tuple(row.ns.split("|")) if row.ns else ()
                if row.mode not in wanted or (ns and not subgraphs):
                    continue
                payload = self._queue.decode_event(row.payload_type, row.payload, allow)
                event = payload if single else (row.mode, payload)
                yield ((ns, event) if single else (ns, row.mode, payload)) if subgraphs else event
            if shown == len(rows) == 500:
                continue  # more to read at once
            if ended and shown == len(rows):
                return
            if shown:
                wait = min(0.005, pause)
            else:
                await asyncio.sleep(wait)
                wait = min(wait * 2, pause)

    async def _latest(self, thread_id: str) -> str:
        """The id of the thread's latest stored root checkpoint (``""``: none)."""
        if self._checkpointer is None:
            return ""
        config = {
            "configurable": {
                "thread_id": thread_id,
                "tenant_id": self.key.tenant_id,
                "checkpoint_ns": "",
            }
        }
        latest = await self._checkpointer.aget_tuple(config)
        return "" if latest is None else str(latest.config["configurable"]["checkpoint_id"])

    def _end(self, state: RunState, stored: tuple[Any, Any], allow: Collection[Any]) -> Any:
        if state.status in (LeaseStatus.DONE, LeaseStatus.WAITING):
            return self._queue.decode_output(self.key, stored, allow)
        raise RunFailedError(
            f"execution {self.key.scope_key!r} (graph {state.graph!r}, thread "
            f"{state.thread_id!r}) ended {state.status.value} at token {state.epoch}: "
            f"{state.reason or 'no reason recorded'}",
            scope_key=self.key.scope_key,
            status=state.status.value,
            reason=state.reason,
        )

    async def cancel(self) -> bool:
        """Cancel the run on purpose: a pending or queued one never starts, a running one is
        fenced (its next write is refused and it drains); it ends ``cancelled``, a state of
        its own that no worker takes over. Whether it was still pending, running or queued.

        A cancelled run resumes from its last checkpoint when its thread is run again, or
        with ``langgraph-fence resolve --retry`` (refused, like every resume, while a
        non-idempotent write it stamped may have happened: guarantee 3 stands).

        A run stopped by its process (Ctrl-C, SIGTERM, a cancelled task) is not cancelled:
        it is handed back for any worker to take over."""
        return await self._queue.cancel(self.key, "cancelled by SubmittedRun.cancel()", self.run_id)

"""The serving side of completion callbacks: each look of ``serve()`` delivers the due
callbacks of ended runs (:mod:`langgraph_fence.queue._callbacks`): a webhook is POSTed the
run's end as JSON, a registered Python callback is called with a :class:`RunEnd`; a failed
delivery is retried after a backoff (a :class:`~langgraph_fence.RunRetry`), at least once
in all, by whichever worker claims it.

``instance.serve(graphs, callbacks={"billing": on_end})`` registers ``on_end`` for the runs
submitted with ``callback="billing"``; every serving worker delivers webhooks.
"""

from __future__ import annotations

import asyncio
import dataclasses
import inspect
import json
import logging
import urllib.request
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from langgraph_fence.execution.retries import RunRetry
from langgraph_fence.lease import LeaseKey, LeaseStatus
from langgraph_fence.queue import CALLBACK, SWEEP_EVERY, WEBHOOK, DueCallback
from langgraph_fence.redact import failure_reason
from langgraph_fence.validate import text_id

if TYPE_CHECKING:
    from langgraph_fence.queue import SubmittedRuns

__all__ = ["DEFAULT_CALLBACK_RETRY", "Deliveries", "RunEnd", "RunEndCallback"]

logger = logging.getLogger("langgraph_fence.callbacks")

#: How a failed delivery is retried by default: 5 attempts, 2 s, 4 s, 8 s, 16 s apart.
DEFAULT_CALLBACK_RETRY = RunRetry(attempts=5, backoff=2.0, factor=2.0, max_backoff=300.0)
#: How long one claim of a delivery lasts: a worker lost while delivering leaves it to
#: another after this.
CLAIM_SECONDS = 60.0
#: The longest a webhook's receiver may take to answer.
WEBHOOK_TIMEOUT = 10.0


@dataclass(frozen=True)
class RunEnd:
    """How a submitted run ended, as its completion callbacks are told.

    Attributes:
        run_id: the submitted run.
        tenant_id: its tenant.
        execution_id: its execution.
        thread_id: its thread.
        graph: the graph it ran.
        status: ``done``, ``waiting`` (at an interrupt), ``failed``, ``dead_lettered`` or
            ``cancelled``.
        reason: why it failed, was dead-lettered or cancelled (``None`` for done).
        output: its output (``done``, ``waiting``), as ``result()`` returns it; ``None``
            otherwise, or when it cannot be read with the serializer's allow-list.
        attempt: this delivery's attempt (1 for the first).
    """

    run_id: str
    tenant_id: str
    execution_id: str
    thread_id: str | None
    graph: str | None
    status: str
    reason: str | None
    output: Any
    attempt: int

    def as_json(self) -> bytes:
        """The JSON a webhook is POSTed (values the JSON has no type for, as text)."""
        fields = {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}
        return json.dumps(fields, default=_plain).encode()


RunEndCallback = Callable[[RunEnd], Awaitable[None] | None]


def check_callbacks(callbacks: object) -> dict[str, RunEndCallback]:
    """``serve(callbacks=...)``, checked: a mapping of names to callables.

    Raises:
        ValueError: a bad name or a value that is not callable, named.
    """
    if callbacks is None:
        return {}
    if not isinstance(callbacks, Mapping):
        raise ValueError(
            f"callbacks must be a mapping of names to callables (RunEnd -> None), got {callbacks!r}"
        )
    checked: dict[str, RunEndCallback] = {}
    for name, fn in callbacks.items():
        text_id("callbacks' names", name, what="the name runs are submitted with, callback=...")
        if not callable(fn):
            raise ValueError(f"callbacks[{name!r}] must be callable (RunEnd -> None), got {fn!r}")
        checked[str(name)] = fn
    return checked


class Deliveries:
    """One serving loop's deliveries of completion callbacks.

    Args:
        queue: the run queue.
        callbacks: the Python callbacks this loop registers, by name.
        retry: how a failed delivery is retried.
        concurrency: the most deliveries in flight at once.
    """

    def __init__(
        self,
        queue: SubmittedRuns,
        callbacks: Mapping[str, RunEndCallback],
        retry: RunRetry,
        *,
        concurrency: int = 8,
    ) -> None:
        self._queue = queue
        self._callbacks = dict(callbacks)
        self._retry = retry
        self._concurrency = concurrency
        self._tasks: set[asyncio.Task[None]] = set()
        self._swept_at: float | None = None  # the loop's clock; never yet

    async def arm(self, run_id: str) -> None:
        """Run ``run_id`` ended here: its callbacks are due at the next look of any worker."""
        await self._queue.callbacks.arm(run_id)

    async def look(self) -> None:
        """Make due the callbacks of runs that ended elsewhere (every ``SWEEP_EVERY``
        seconds), then claim the due deliveries there is room for and begin them."""
        now = asyncio.get_running_loop().time()
        if self._swept_at is None or now - self._swept_at >= SWEEP_EVERY:
            await self._queue.callbacks.sweep()
            self._swept_at = now
        self._tasks = {t for t in self._tasks if not t.done()}
        free = self._concurrency - len(self._tasks)
        if free <= 0:
            return
        rows = self._queue.callbacks
        for due in await rows.due(list(self._callbacks), free):
            if await rows.claim(due, CLAIM_SECONDS):
                task = asyncio.create_task(self._deliver(due), name=f"callback {due.run_id}")
                self._tasks.add(task)

    async def settle(self) -> None:
        """Wait for the deliveries in flight (a test's, or a stopping loop's)."""
        if self._tasks:
            await asyncio.gather(*self._tasks, return_exceptions=True)

    async def stop(self) -> None:
        """Cancel the deliveries in flight: their claims lapse and any worker makes them."""
        for task in self._tasks:
            task.cancel()
        await self.settle()

    async def _deliver(self, due: DueCallback) -> None:
        rows = self._queue.callbacks
        attempt = due.attempts + 1
        try:
            end = await self._end(due, attempt)
            if due.target.startswith(WEBHOOK):
                body = end.as_json()
                url = due.target.removeprefix(WEBHOOK)
                await asyncio.to_thread(_post, url, body, due.run_id)
            else:
                called = self._callbacks[due.target.removeprefix(CALLBACK)](end)
                if inspect.isawaitable(called):
                    await called
        except asyncio.CancelledError:
            raise
        except Exception as exc:
            reason = failure_reason(exc)
            last = attempt >= self._retry.attempts
            logger.warning(
                "callback %s of run %s failed (attempt %d of %d): %s%s",
                due.target,
                due.run_id,
                attempt,
                self._retry.attempts,
                reason,
                "; no attempt is left" if last else "",
            )
            await rows.failed(due, reason, self._retry.delay(attempt), self._retry.attempts)
        else:
            await rows.delivered(due)

    async def _end(self, due: DueCallback, attempt: int) -> RunEnd:
        key = LeaseKey(due.tenant_id, due.execution_id)
        found = await self._queue.state(key, due.run_id)
        if found is None:
            raise LookupError(f"run {due.run_id} is gone (its thread was erased?)")
        state, stored = found
        output = None
        if state.status in (LeaseStatus.DONE, LeaseStatus.WAITING):
            try:
                output = self._queue.decode_output(key, stored, ())
            except Exception:
                logger.warning("the output of run %s cannot be read", due.run_id, exc_info=True)
        return RunEnd(
            run_id=due.run_id,
            tenant_id=due.tenant_id,
            execution_id=due.execution_id,
            thread_id=state.thread_id,
            graph=state.graph,
            status=state.status.value,
            reason=state.reason,
            output=output,
            attempt=attempt,
        )


def _post(url: str, body: bytes, run_id: str) -> None:
    """POST ``body`` to ``url``; raises unless the receiver answers 2xx."""
    request = urllib.request.Request(
        url,
        data=body,
        method="POST",
        headers={
            "Content-Type": "application/json",
            "User-Agent": "langgraph-fence",
            # At least once: the receiver tells a repeated delivery by it.
            "Idempotency-Key": run_id,
        },
    )
    with urllib.request.urlopen(request, timeout=WEBHOOK_TIMEOUT) as answer:
        if not 200 <= answer.status < 300:
            raise RuntimeError(f"the webhook answered {answer.status}")


def _plain(value: Any) -> Any:
    """A JSON value for what ``json`` has no type for: a model's or a dataclass's fields,
    else its text."""
    dump = getattr(value, "model_dump", None)
    if callable(dump):
        return dump()
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return dataclasses.asdict(value)
    return repr(value)

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
import urllib.error
import urllib.request
from collections.abc import Awaitable, Callable, Collection, Mapping
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from langgraph_fence.execution.retries import RunRetry
from langgraph_fence.lease import LeaseKey, LeaseStatus
from langgraph_fence.lease.transitions import is_yielded
from langgraph_fence.queue import CALLBACK, ENDED, SWEEP_EVERY, WEBHOOK, DueCallback, shown_target
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
#: The longest one delivery may take (a webhook's answer, a callback's return); well
#: below a claim's length, so a delivery never outlives its claim by design.
DELIVERY_TIMEOUT = 10.0


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
        """The JSON a webhook is POSTed: models and dataclasses as their fields, other
        values JSON has no type for as text; an output that still cannot be written (keys
        that are not text, a NaN) as ``null``, with ``output_error`` saying why."""
        fields: dict[str, Any] = {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}
        try:
            return json.dumps(fields, default=_plain, allow_nan=False).encode()
        except (TypeError, ValueError) as exc:
            fields["output"] = None
            fields["output_error"] = f"the output cannot be written as JSON: {exc}"
            return json.dumps(fields, default=_plain, allow_nan=False).encode()


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
        allow: a graph's name -> the types its output may construct besides what the
            serializer allows (the served graphs' own).
    """

    def __init__(
        self,
        queue: SubmittedRuns,
        callbacks: Mapping[str, RunEndCallback],
        retry: RunRetry,
        *,
        concurrency: int = 8,
        allow: Callable[[str | None], Collection[tuple[str, ...]]] = lambda graph: (),
    ) -> None:
        self._queue = queue
        self._allow = allow
        self._callbacks = dict(callbacks)
        self._retry = retry
        self._concurrency = concurrency
        self._tasks: set[asyncio.Task[None]] = set()
        self._swept_at: float | None = None  # the loop's clock; never yet
        # Webhook POSTs and sync callbacks run here, never on the loop nor in asyncio's
        # default executor (LangGraph's sync steps, name lookups): a receiver that hangs
        # holds one of these threads, nothing else.
        self._threads = ThreadPoolExecutor(concurrency, thread_name_prefix="lgf-callback")

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
        """Cancel the deliveries in flight: their claims lapse and any worker makes them.
        A thread still in a receiver's or a callback's hands is not waited for."""
        for task in self._tasks:
            task.cancel()
        await self.settle()
        self._threads.shutdown(wait=False, cancel_futures=True)

    async def _deliver(self, due: DueCallback) -> None:
        rows = self._queue.callbacks
        attempt = due.attempts + 1
        try:
            end = await self._end(due, attempt)
            async with asyncio.timeout(DELIVERY_TIMEOUT):
                await self._call(due.target, end)
        except asyncio.CancelledError:
            raise
        except Exception as exc:
            if isinstance(exc, TimeoutError):
                reason = f"no answer within {DELIVERY_TIMEOUT:g} s"
            else:
                reason = failure_reason(exc)
            last = attempt >= self._retry.attempts
            logger.warning(
                "callback %s of run %s failed (attempt %d of %d): %s%s",
                shown_target(due.target),
                due.run_id,
                attempt,
                self._retry.attempts,
                reason,
                "; no attempt is left" if last else "",
            )
            await rows.failed(due, reason, self._retry.delay(attempt), self._retry.attempts)
        else:
            await rows.delivered(due)

    async def _call(self, target: str, end: RunEnd) -> None:
        loop = asyncio.get_running_loop()
        if target.startswith(WEBHOOK):
            url, body = target.removeprefix(WEBHOOK), end.as_json()
            await loop.run_in_executor(self._threads, _post, url, body, end.run_id)
            return
        fn = self._callbacks[target.removeprefix(CALLBACK)]
        if inspect.iscoroutinefunction(fn) or inspect.iscoroutinefunction(
            getattr(fn, "__call__", None)  # noqa: B004 - an object's async __call__
        ):
            await fn(end)  # type: ignore[misc]
            return
        called = await loop.run_in_executor(self._threads, fn, end)
        if inspect.isawaitable(called):
            await called

    async def _end(self, due: DueCallback, attempt: int) -> RunEnd:
        key = LeaseKey(due.tenant_id, due.execution_id)
        found = await self._queue.state(key, due.run_id)
        if found is None:
            raise LookupError(f"run {due.run_id} is gone (its thread was erased?)")
        state, stored = found
        if state.status.value not in ENDED or is_yielded(state.status, state.holder):
            # The execution runs again (a direct run of its thread): its end is not this
            # run's to tell now; tried again later.
            raise RuntimeError(f"run {due.run_id}'s execution is {state.status.value} again")
        output = None
        if state.status in (LeaseStatus.DONE, LeaseStatus.WAITING):
            try:
                output = self._queue.decode_output(key, stored, self._allow(state.graph))
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


class _NoRedirects(urllib.request.HTTPRedirectHandler):
    """A redirect is a failed delivery: urllib would follow it with a GET without the body
    (and to another host or scheme)."""

    def redirect_request(
        self, req: Any, fp: Any, code: int, msg: str, headers: Any, newurl: str
    ) -> None:
        raise urllib.error.HTTPError(
            req.full_url, code, f"the webhook redirects ({code}) to {newurl!r}", headers, fp
        )


_OPENER = urllib.request.build_opener(_NoRedirects)


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
    with _OPENER.open(request, timeout=DELIVERY_TIMEOUT) as answer:
        if not 200 <= answer.status < 300:
            raise RuntimeError(f"the webhook answered {answer.status}")


def _plain(value: Any) -> Any:
    """A JSON value for what ``json`` has no type for: a model's or a dataclass's fields,
    else its text."""
    dump = getattr(value, "model_dump", None)
    if callable(dump):
        return dump(mode="json")
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return dataclasses.asdict(value)
    return repr(value)

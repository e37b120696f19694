"""Completion callbacks (issue 37): a run submitted with ``callback=`` or ``webhook=`` is
told its end at least once, by a serving worker's look, after it ended: a registered
Python callback is called with a ``RunEnd``, a webhook is POSTed it as JSON; a failed
delivery is retried after its backoff on the store's clock, then ``failed``; a worker lost
while delivering leaves it to another once its claim has passed. On SQLite and PostgreSQL."""

from __future__ import annotations

import asyncio
import json
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

import pytest
from langgraph.types import Command

from langgraph_fence import RunEnd, RunRetry
from langgraph_fence.execution import callbacks
from langgraph_fence.execution.callbacks import CLAIM_SECONDS
from langgraph_fence.testing import Leases
from tests.support.databases import SQL_BACKENDS, unique
from tests.support.deliveries import db, deliver
from tests.support.serving import cfg, look, stepped
from tests.support.statements import Statements
from tests.support.stream_graphs import orders

RUNS_ON = SQL_BACKENDS

__all__ = ["db"]  # a database of the test's own (tests.support.deliveries)


async def test_a_registered_callback_is_told_each_end_once(db: Leases) -> None:
    client, worker = db.instance("client"), db.instance("worker")
    ends: list[RunEnd] = []

    async def told(end: RunEnd) -> None:
        ends.append(end)

    loop = stepped(worker, {"orders": orders(worker)}, callbacks={"told": told})
    thread = unique("t")
    run = await client.submit("orders", {"item": "b"}, cfg(thread), tenant_id="a", callback="told")
    await look(loop)
    await deliver(loop)
    await deliver(loop)  # delivered: never again
    (end,) = ends
    assert (end.run_id, end.status, end.thread_id, end.graph) == (
        run.run_id,
        "waiting",
        thread,
        "orders",
    )
    assert end.output["log"] == ["plan"]
    assert "__interrupt__" in end.output
    resumed = await client.submit(
        "orders", Command(resume="ok"), cfg(thread), tenant_id="a", callback="told"
    )
    await look(loop)
    await deliver(loop)
    assert [(e.run_id, e.status) for e in ends[1:]] == [(resumed.run_id, "done")]
    assert ends[1].output["log"] == ["plan", "approve", "charge", "notify"]
    assert [(c.status, c.attempts) for c in await resumed.callbacks()] == [("delivered", 1)]


async def test_a_failed_delivery_is_retried_after_its_backoff_then_failed(db: Leases) -> None:
    client, worker = db.instance("client"), db.instance("worker")
    calls: list[int] = []

    def flaky(end: RunEnd) -> None:
        calls.append(end.attempt)
        raise ConnectionRefusedError("the billing service is down")

    retry = RunRetry(attempts=3, backoff=5.0, factor=2.0)
    loop = stepped(
        worker, {"orders": orders(worker)}, callbacks={"bill": flaky}, callback_retry=retry
    )
    run = await client.submit(
        "orders", {"item": "b"}, cfg(unique("t")), tenant_id="a", callback="bill"
    )
    await look(loop)
    await deliver(loop)
    (state,) = await run.callbacks()
    assert (state.status, state.attempts) == ("pending", 1)
    assert "the billing service is down" in (state.last_error or "")
    db.advance(4.9)
    await deliver(loop)
    assert calls == [1]  # not before its backoff
    db.advance(0.1)
    await deliver(loop)
    db.advance(10.0)  # the backoff doubled
    await deliver(loop)
    assert calls == [1, 2, 3]
    (state,) = await run.callbacks()
    assert (state.status, state.attempts) == ("failed", 3)
    db.advance(100.0)
    await deliver(loop)
    assert calls == [1, 2, 3]  # its attempts ran out


async def test_a_delivery_lost_with_its_worker_is_made_by_another(db: Leases) -> None:
    client, first, second = db.instance("client"), db.instance("first"), db.instance("second")
    entered, never = asyncio.Event(), asyncio.Event()
    told: list[str] = []

    async def hangs(end: RunEnd) -> None:
        entered.set()
        await never.wait()  # its worker is lost here

    def tells(end: RunEnd) -> None:
        told.append(end.run_id)

    loop_a = stepped(first, {"orders": orders(first)}, callbacks={"tell": hangs})
    loop_b = stepped(second, {"orders": orders(second)}, callbacks={"tell": tells})
    run = await client.submit(
        "orders", {"item": "b"}, cfg(unique("t")), tenant_id="a", callback="tell"
    )
    await look(loop_a)
    await loop_a.poll_once()
    await asyncio.wait_for(entered.wait(), 20)
    await deliver(loop_b)
    assert told == []  # claimed by the first
    db.advance(CLAIM_SECONDS)
    await deliver(loop_b)
    assert told == [run.run_id]
    assert [(c.status, c.attempts) for c in await run.callbacks()] == [("delivered", 2)]
    await loop_a.deliveries.stop()


async def test_a_run_ended_elsewhere_is_told_by_the_sweep(
    db: Leases, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A run cancelled before any worker ran it ends with no worker to say so: a serving
    loop's sweep makes its callbacks due (every SWEEP_EVERY seconds of the loop's clock;
    the first look sweeps)."""
    client, worker = db.instance("client"), db.instance("worker")
    told: list[tuple[str, str]] = []
    loop = stepped(
        worker,
        {"orders": orders(worker)},
        callbacks={"tell": lambda end: told.append((end.run_id, end.status))},
    )
    await deliver(loop)  # the first look swept: nothing had ended
    run = await client.submit(
        "orders", {"item": "b"}, cfg(unique("t")), tenant_id="a", callback="tell", not_before=60
    )
    assert await run.cancel()
    await deliver(loop)
    assert told == []  # no sweep yet, and no worker ended it
    monkeypatch.setattr(callbacks, "SWEEP_EVERY", 0.0)
    await deliver(loop)
    assert told == [(run.run_id, "cancelled")]


async def test_only_a_worker_that_registered_a_callback_calls_it(db: Leases) -> None:
    client, worker = db.instance("client"), db.instance("worker")
    loop = stepped(worker, {"orders": orders(worker)})
    run = await client.submit(
        "orders", {"item": "b"}, cfg(unique("t")), tenant_id="a", callback="elsewhere"
    )
    await look(loop)
    await deliver(loop)
    assert [(c.status, c.attempts) for c in await run.callbacks()] == [("pending", 0)]


class Receiver:
    """A webhook receiver on 127.0.0.1 that answers 500 to its first ``failures`` POSTs."""

    def __init__(self, failures: int) -> None:
        self.failures = failures
        self.posts: list[tuple[dict[str, str], Any]] = []
        receiver = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:
                body = self.rfile.read(int(self.headers["Content-Length"]))
                receiver.posts.append((dict(self.headers), json.loads(body)))
                ok = len(receiver.posts) > receiver.failures
                self.send_response(200 if ok else 500)
                self.end_headers()

            def log_message(self, *args: Any) -> None:
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}/hook"


@pytest.fixture
def receiver() -> Iterator[Receiver]:
    found = Receiver(failures=1)
    thread = threading.Thread(target=found.server.serve_forever, daemon=True)
    thread.start()
    try:
        yield found
    finally:
        found.server.shutdown()
        found.server.server_close()


async def test_a_webhook_is_posted_the_runs_end_and_retried(db: Leases, receiver: Receiver) -> None:
    client, worker = db.instance("client"), db.instance("worker")
    loop = stepped(worker, {"orders": orders(worker)})  # no callback registered: webhooks
    run = await client.submit(
        "orders", {"item": "b"}, cfg(unique("t")), tenant_id="a", webhook=receiver.url
    )
    await look(loop)
    await deliver(loop)
    (state,) = await run.callbacks()
    assert (state.status, state.attempts) == ("pending", 1)
    assert "500" in (state.last_error or "")
    db.advance(2.0)  # the default backoff
    await deliver(loop)
    assert [(c.status, c.attempts) for c in await run.callbacks()] == [("delivered", 2)]
    (_, first), (headers, body) = receiver.posts
    assert {**first, "attempt": 2} == body  # the same end, again
    assert headers["Idempotency-Key"] == run.run_id
    assert (body["run_id"], body["status"], body["attempt"]) == (run.run_id, "waiting", 2)
    assert body["output"]["log"] == ["plan"]
    assert body["output"]["__interrupt__"][0]["value"] == {"approve": "b"}


async def test_bad_callbacks_are_refused_naming_the_fix(db: Leases) -> None:
    client, worker = db.instance("client"), db.instance("worker")
    with pytest.raises(ValueError, match="webhook must be an absolute http"):
        await client.submit("orders", {}, cfg(unique("t")), tenant_id="a", webhook="ftp://x/y")
    with pytest.raises(ValueError, match="must not carry credentials"):
        await client.submit(
            "orders", {}, cfg(unique("t")), tenant_id="a", webhook="https://u:p@x.org/"
        )
    with pytest.raises(ValueError, match="callback"):
        await client.submit("orders", {}, cfg(unique("t")), tenant_id="a", callback="")
    with pytest.raises(ValueError, match=r"callbacks\['x'\] must be callable"):
        stepped(worker, {"orders": orders(worker)}, callbacks={"x": 42})


async def test_only_a_run_with_callbacks_makes_them_due_as_it_ends(db: Leases) -> None:
    """The end of a run submitted without callbacks sends no callbacks statement (its pin
    said it has none); one submitted with a callback has it made due by its worker."""
    client, worker = db.instance("client"), db.instance("worker")
    ends: list[RunEnd] = []

    async def told(end: RunEnd) -> None:
        ends.append(end)

    loop = stepped(worker, {"orders": orders(worker)}, callbacks={"told": told})
    statements = Statements(db.engine, sqlalchemy=True)
    await look(loop)  # its sweep of ended runs' callbacks: not again within 10 s
    await client.submit("orders", {"item": "b"}, cfg(unique("t")), tenant_id="a")
    await statements.take()
    await look(loop)
    sent = await statements.take()
    assert sent, "nothing traced"
    assert "UPDATE FENCE_CALLBACKS SET" not in sent, sent

    run = await client.submit(
        "orders", {"item": "b"}, cfg(unique("t")), tenant_id="a", callback="told"
    )
    await look(loop)
    # Due at once, made so by the worker as the run ended: told now, not after the next
    # sweep 10 s on (the look made before the submit swept).
    await deliver(loop)
    assert [(e.run_id, e.status) for e in ends] == [(run.run_id, "waiting")]

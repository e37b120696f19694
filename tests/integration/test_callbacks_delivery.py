"""How completion callbacks are delivered (issue 37, from a review): a sync callback and a
webhook never run on the serving loop nor in asyncio's shared executor; a delivery has a
deadline; a redirect is a failure, not a delivery; a claim that outlived its time never
ends or reschedules a newer one; a webhook URL is bounded alike on both databases."""

from __future__ import annotations

import asyncio
import secrets
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

import pytest

from langgraph_fence import RunEnd, RunRetry
from langgraph_fence.execution import callbacks
from langgraph_fence.execution.callbacks import CLAIM_SECONDS
from langgraph_fence.queue import CallbackState
from langgraph_fence.testing import Leases
from tests.support.databases import SQL_BACKENDS, unique
from tests.support.deliveries import db, deliver
from tests.support.polling import eventually
from tests.support.serving import cfg, look, stepped
from tests.support.stream_graphs import orders

RUNS_ON = SQL_BACKENDS
__all__ = ["db"]  # a database of the test's own (tests.support.deliveries)


class Http:
    """A receiver on 127.0.0.1 with a handler of the test's."""

    def __init__(self, handler: type[BaseHTTPRequestHandler]) -> None:
        self.server = ThreadingHTTPServer(("127.0.0.1", 0), handler)
        self.server.daemon_threads = True
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}/hook"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


class Quiet(BaseHTTPRequestHandler):
    def log_message(self, *args: Any) -> None:
        pass


async def one_delivery(db: Leases, url: str) -> CallbackState:
    """A run with webhook ``url`` served to its end, one delivery made: where it stands."""
    client, worker = db.instance("client"), db.instance("worker")
    loop = stepped(worker, {"orders": orders(worker)})
    run = await client.submit("orders", {"item": "b"}, cfg(unique("t")), tenant_id="a", webhook=url)
    await look(loop)
    await deliver(loop)
    (state,) = await run.callbacks()
    return state


@pytest.fixture
def released() -> Iterator[threading.Event]:
    """Set at the end of the test: a receiver waiting on it lets go."""
    event = threading.Event()
    yield event
    event.set()


async def test_a_sync_callback_runs_beside_the_loop(db: Leases) -> None:
    client, worker = db.instance("client"), db.instance("worker")
    go = threading.Event()
    waited: list[bool] = []

    def slow(end: RunEnd) -> None:  # e.g. requests.post to a billing service
        waited.append(go.wait(10))

    loop = stepped(worker, {"orders": orders(worker)}, callbacks={"bill": slow})
    await client.submit("orders", {"item": "b"}, cfg(unique("t")), tenant_id="a", callback="bill")
    await look(loop)
    # Set by the loop while the callback waits: only if the callback leaves the loop free.
    asyncio.get_running_loop().call_soon(go.set)
    await deliver(loop)
    assert waited == [True]


async def test_hanging_receivers_leave_the_shared_executor_free(
    db: Leases, released: threading.Event
) -> None:
    posts: list[str] = []

    class Hangs(Quiet):
        def do_POST(self) -> None:
            posts.append(self.path)
            released.wait(30)
            self.send_response(200)
            self.end_headers()

    http = Http(Hangs)
    client, worker = db.instance("client"), db.instance("worker")
    loop = stepped(worker, {"orders": orders(worker)}, concurrency=8)
    try:
        for _ in range(8):
            await client.submit(
                "orders", {"item": "b"}, cfg(unique("t")), tenant_id="a", webhook=http.url
            )
        await look(loop)  # the 8 runs, to their interrupt
        await loop.poll_once()  # 8 deliveries, each held by the receiver
        await eventually(lambda: len(posts) == 8, timeout=20, what="8 held POSTs")
        # LangGraph's sync steps and name lookups use asyncio's default executor.
        assert await asyncio.wait_for(asyncio.to_thread(int, "7"), 10) == 7
    finally:
        released.set()
        await loop.deliveries.settle()
        http.close()


async def test_a_receiver_that_trickles_is_cut_off_at_the_deadline(
    db: Leases, monkeypatch: pytest.MonkeyPatch, released: threading.Event
) -> None:
    monkeypatch.setattr(callbacks, "DELIVERY_TIMEOUT", 0.5)

    class Trickles(Quiet):
        def do_POST(self) -> None:
            self.wfile.write(b"HTTP/1.1 200 OK\r\n")
            while not released.is_set():  # a header line now and then, never the end
                self.wfile.write(b"X: y\r\n")
                self.wfile.flush()
                released.wait(0.1)

    http = Http(Trickles)
    try:
        state = await one_delivery(db, http.url)
        assert (state.status, state.last_error) == ("pending", "no answer within 0.5 s")
    finally:
        released.set()
        http.close()


async def test_a_redirect_is_a_failed_delivery(db: Leases) -> None:
    gets: list[str] = []

    class Redirects(Quiet):
        def do_POST(self) -> None:
            self.rfile.read(int(self.headers["Content-Length"]))
            self.send_response(302)
            self.send_header("Location", "/moved")
            self.send_header("Content-Length", "0")
            self.end_headers()

        def do_GET(self) -> None:
            gets.append(self.path)
            self.send_response(200)
            self.send_header("Content-Length", "0")
            self.end_headers()

    http = Http(Redirects)
    try:
        state = await one_delivery(db, http.url)
        assert state.status == "pending"
        assert "redirects (302)" in (state.last_error or "")
        assert gets == []  # never followed as a GET without the end
    finally:
        http.close()


async def test_a_stale_claims_failure_does_not_undo_a_newer_delivery(db: Leases) -> None:
    client, first, second = db.instance("client"), db.instance("first"), db.instance("second")
    a_in, a_go, b_in, b_go = (asyncio.Event() for _ in range(4))

    async def a_fails(end: RunEnd) -> None:
        a_in.set()
        await a_go.wait()
        raise RuntimeError("the receiver timed out")

    async def b_succeeds(end: RunEnd) -> None:
        b_in.set()
        await b_go.wait()

    retry = RunRetry(attempts=2, backoff=2.0)
    loop_a = stepped(
        first, {"orders": orders(first)}, callbacks={"t": a_fails}, callback_retry=retry
    )
    loop_b = stepped(
        second, {"orders": orders(second)}, callbacks={"t": b_succeeds}, callback_retry=retry
    )
    run = await client.submit(
        "orders", {"item": "b"}, cfg(unique("t")), tenant_id="a", callback="t"
    )
    await look(loop_a)
    await loop_a.poll_once()
    await asyncio.wait_for(a_in.wait(), 10)  # the first claim, attempt 1, slow
    db.advance(CLAIM_SECONDS)
    await loop_b.poll_once()
    await asyncio.wait_for(b_in.wait(), 10)  # the second claim, attempt 2
    a_go.set()
    await loop_a.deliveries.settle()  # the first claim's failure: its last attempt, stale
    assert [(c.status, c.attempts) for c in await run.callbacks()] == [("pending", 2)]
    b_go.set()
    await loop_b.deliveries.settle()
    assert [(c.status, c.attempts) for c in await run.callbacks()] == [("delivered", 2)]


async def test_a_long_or_spaced_webhook_url_is_refused_alike_on_both_databases(
    db: Leases,
) -> None:
    client = db.instance("client")
    long = "https://hooks.example.com/" + secrets.token_hex(2000)
    with pytest.raises(ValueError, match="at most 2048 characters"):
        await client.submit("orders", {}, cfg(unique("t")), tenant_id="a", webhook=long)
    with pytest.raises(ValueError, match="no spaces or control characters"):
        await client.submit(
            "orders", {}, cfg(unique("t")), tenant_id="a", webhook="https://x.org/a b"
        )


def test_an_output_json_cannot_hold_is_told_as_null_with_why() -> None:
    end = RunEnd("r", "t", "e", "th", "g", "done", None, {(1, 2): float("nan")}, 1)
    told = end.as_json()
    assert b'"output": null' in told
    assert b"cannot be written as JSON" in told

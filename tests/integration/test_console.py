"""The operator's console, in process (httpx's ASGI transport), on real databases.

What an operator relies on: a dead letter shows its reason, stamps and token timeline; the
actions write only for a signed-in operator, through a form of this console's own, and the
database shows what they did; a tenant's strings are text; a tenant-scoped console shows no
other tenant; the listing pages through every execution once; a database the console cannot
read is named with the fix. The same pages in a real Chromium: tests/chaos/test_console_browser.py.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any
from urllib.parse import quote

import httpx
import pytest
from sqlalchemy import insert, select, text

from langgraph_fence import Effect, Instance, LeaseKey, LeaseStatus
from langgraph_fence.console import create_app
from langgraph_fence.lease.journal import JOURNAL, Journal
from langgraph_fence.testing import Leases
from tests.support.databases import SQL_BACKENDS, Database, unique
from tests.support.serving import opened
from tests.support.takeovers import Shop, take_over_mid_charge

RUNS_ON = SQL_BACKENDS
TOKEN = "operator-token-for-tests-0123456789"
SCRIPT = "<script>alert('x')</script>"


@pytest.fixture
def leases(own_leases: Leases) -> Leases:
    return own_leases


def journaled(leases: Leases, *instances: Instance) -> list[Journal]:
    """Each instance journals its turns, as ``Instance.open``'s do."""
    journals = [Journal(leases.engine) for _ in instances]
    for instance, journal in zip(instances, journals, strict=True):
        instance.add_listener(journal)
    return journals


async def dead_letter(leases: Leases, thread: str) -> LeaseKey:
    """A run killed (frozen past its lease) inside a non-idempotent charge: B's takeover
    dead-letters it, A thaws and is fenced. Its journal is written."""
    a, b = leases.instance("A"), leases.instance("B")
    journals = journaled(leases, a, b)
    key, a_error = await take_over_mid_charge(
        leases, a, b, Shop(Effect.NON_IDEMPOTENT_WRITE), thread=thread
    )
    assert a_error is not None
    for journal in journals:
        await journal.aclose()
    lease = await leases.store.get(key)
    assert lease is not None
    assert lease.status is LeaseStatus.DEAD_LETTERED
    return key


def client(app: Any) -> httpx.AsyncClient:
    return httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://console")


def text_of(html: str) -> str:
    return " ".join(re.sub(r"<[^>]+>", " ", html).split())


def page_of(key: LeaseKey) -> str:
    return "/executions/" + quote(key.scope_key, safe="")


async def test_a_dead_letter_shows_its_reason_and_timeline_and_an_operator_abandons_it(
    leases: Leases,
) -> None:
    key = await dead_letter(leases, unique("order") + SCRIPT)
    app = create_app(leases.engine, operator_token=TOKEN)
    async with client(app) as http:
        listed = await http.get("/dead-letters")
        assert listed.status_code == 200
        assert SCRIPT not in listed.text  # the thread id is text, escaped
        assert "&lt;script&gt;" in listed.text
        assert 'method="post" action="/resolve"' not in listed.text  # not signed in

        page = await http.get(page_of(key))
        assert page.status_code == 200
        shown = text_of(page.text)
        assert "dead_lettered" in shown
        assert "charge" in shown  # the reason names the step whose write may have happened
        timeline = shown[shown.index("Token timeline") :]
        assert re.search(r"1 \S+ \S+ UTC took the lease A", timeline), timeline
        assert "dead-lettered B" in timeline
        assert "write refused: a newer token holds it A" in timeline

        # Acting needs the operator: not signed in, a forged form, a wrong token: refused.
        form = {"key": key.scope_key, "action": "abandon", "note": "refunded by hand"}
        assert (await http.post("/resolve", data=form)).status_code == 403
        wrong = await http.post("/login", data={"name": "mallory", "token": "x" * 20})
        assert wrong.status_code == 403
        signed = await http.post("/login", data={"name": "dana <ops>", "token": TOKEN})
        assert signed.status_code == 303
        assert (await http.post("/resolve", data={**form, "csrf": "forged"})).status_code == 403
        assert (await leases.store.get(key)).status is LeaseStatus.DEAD_LETTERED  # type: ignore[union-attr]

        listed = await http.get("/dead-letters")
        csrf = re.search(r'name="csrf" value="([0-9a-f]+)"', listed.text)
        assert csrf is not None
        assert "dana &lt;ops&gt;" in listed.text
        done = await http.post("/resolve", data={**form, "csrf": csrf.group(1)})
        assert done.status_code == 303
        assert done.headers["location"] == page_of(key) + "?resolved=abandoned"

    lease = await leases.store.get(key)
    assert lease is not None
    assert lease.status is LeaseStatus.FAILED
    assert lease.reason == "abandoned by operator: refunded by hand"
    async with leases.engine.connect() as conn:
        actions = (
            await conn.execute(
                select(JOURNAL.c.kind, JOURNAL.c.actor, JOURNAL.c.detail).where(
                    JOURNAL.c.execution_id == key.execution_id, JOURNAL.c.actor.is_not(None)
                )
            )
        ).all()
    assert [tuple(a) for a in actions] == [("abandoned", "dana <ops>", "refunded by hand")]


async def test_a_read_only_console_has_no_action_that_writes(leases: Leases) -> None:
    key = await dead_letter(leases, unique("order"))
    app = create_app(leases.engine)  # no operator token
    async with client(app) as http:
        for path in ("/executions", "/dead-letters", page_of(key), "/queue", "/instances"):
            page = await http.get(path)
            assert page.status_code == 200, path
            assert 'method="post"' not in page.text, path
            assert "sign in" not in page.text, path
        assert (await http.get("/login")).status_code == 404
        refused = await http.post(
            "/resolve", data={"key": key.scope_key, "action": "retry", "csrf": ""}
        )
        assert refused.status_code == 403
        assert "LANGGRAPH_FENCE_UI_TOKEN" in text_of(refused.text)
    lease = await leases.store.get(key)
    assert lease is not None
    assert lease.status is LeaseStatus.DEAD_LETTERED


async def test_the_host_apps_authorize_decides_who_acts(leases: Leases) -> None:
    key = await dead_letter(leases, unique("order"))
    app = create_app(
        leases.engine, authorize=lambda request: request.headers.get("x-operator") or None
    )
    async with client(app) as http:
        anonymous = await http.get("/dead-letters")
        assert 'method="post" action="/resolve"' not in anonymous.text
        page = await http.get("/dead-letters", headers={"x-operator": "sre-1"})
        csrf = re.search(r'name="csrf" value="([0-9a-f]+)"', page.text)
        assert csrf is not None
        retried = await http.post(
            "/resolve",
            data={"key": key.scope_key, "action": "retry", "csrf": csrf.group(1)},
            headers={"x-operator": "sre-1"},
        )
        # The stamp of the non-idempotent charge stands: a retry would repeat it. Refused,
        # saying so, as `langgraph-fence resolve --retry` refuses it.
        assert retried.status_code == 409
        assert "non-idempotent" in text_of(retried.text) or "stamp" in text_of(retried.text)
    lease = await leases.store.get(key)
    assert lease is not None
    assert lease.status is LeaseStatus.DEAD_LETTERED


async def test_a_tenant_scoped_console_shows_no_other_tenant(leases: Leases) -> None:
    ours, theirs = LeaseKey("acme", unique("ours")), LeaseKey("globex", unique("theirs"))
    for key in (ours, theirs):
        await leases.store.acquire(key, "holder-x", 30.0)
    app = create_app(leases.engine, tenant="acme")
    async with client(app) as http:
        listed = text_of((await http.get("/executions?status=running&tenant=globex")).text)
        assert ours.execution_id in listed
        assert theirs.execution_id not in listed
        assert (await http.get(page_of(theirs))).status_code == 404
        assert (await http.get(page_of(ours))).status_code == 200
        metrics = (await http.get("/metrics")).text
        assert 'langgraph_fence_held_leases{instance="holder-x"} 1.0' in metrics


async def pages_of(http: httpx.AsyncClient, path: str, between: Any = None) -> list[str]:
    """Every execution id a listing shows, page after page (``between`` awaited between
    two pages)."""
    seen: list[str] = []
    following: str | None = path
    while following is not None:
        page = await http.get(following)
        assert page.status_code == 200, text_of(page.text)
        seen += re.findall(r">(page-\d{3})</a>", page.text)
        found = re.search(r'rel="next" href="([^"]+)"', page.text)
        following = None if found is None else found.group(1).replace("&amp;", "&")
        if following is not None and between is not None:
            await between()
    return seen


async def test_the_listing_pages_through_every_execution_once(leases: Leases) -> None:
    keys = [LeaseKey("acme", f"page-{n:03d}") for n in range(120)]
    leased = {key: await leases.store.acquire(key, "holder-x", 30.0) for key in keys}

    async def renew_all() -> None:  # a worker renews while the operator pages
        leases.advance(1.0)
        for key, lease in leased.items():
            assert lease is not None
            leased[key] = await leases.store.renew(lease, 30.0)

    # The running: by key (every renewal rewrites their rows; none moves between pages).
    app = create_app(leases.engine)
    async with client(app) as http:
        seen = await pages_of(http, "/executions?status=running", between=renew_all)
        assert seen == sorted((k.execution_id for k in keys), reverse=True)
        bad = await http.get("/executions?after=not-a-cursor")
        assert bad.status_code == 400
        assert "after" in text_of(bad.text)
        bad = await http.get("/executions?status=sleeping")
        assert bad.status_code == 400
        assert "status must be one of" in text_of(bad.text)


async def test_a_database_never_migrated_is_named_with_the_fix(tmp_path: Path) -> None:
    app = create_app(f"sqlite+aiosqlite:///{tmp_path / 'empty.db'}")
    async with client(app) as http:
        page = await http.get("/executions")
    await app.state.console.aclose()
    assert page.status_code == 503
    assert "langgraph-fence migrate" in text_of(page.text)


def test_a_short_operator_token_is_refused_naming_the_fix() -> None:
    with pytest.raises(ValueError, match="operator_token must be at least 16"):
        create_app("sqlite+aiosqlite:///x.db", operator_token="short")
    with pytest.raises(ValueError, match="tenant must be a non-empty"):
        create_app("sqlite+aiosqlite:///x.db", tenant="")


def test_the_ui_command_refuses_a_short_token_and_a_missing_database(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    from langgraph_fence.cli import main

    missing = f"sqlite+aiosqlite:///{tmp_path / 'missing.db'}"
    assert main(["ui", "--db", missing]) == 2
    assert "missing.db" in capsys.readouterr().err
    monkeypatch.setenv("LANGGRAPH_FENCE_UI_TOKEN", "short")
    (tmp_path / "there.db").touch()
    assert main(["ui", "--db", f"sqlite+aiosqlite:///{tmp_path / 'there.db'}"]) == 2
    said = capsys.readouterr().err.strip().splitlines()
    assert said == [
        "error: the operator token must be at least 16 characters: make one with "
        "`python -c 'import secrets; print(secrets.token_urlsafe())'`"
    ]
    empty = tmp_path / "token"
    empty.write_text("\n")
    there = f"sqlite+aiosqlite:///{tmp_path / 'there.db'}"
    assert main(["ui", "--db", there, "--operator-token-file", str(empty)]) == 2
    assert "--operator-token-file: the file is empty" in capsys.readouterr().err


async def test_mounted_under_a_prefix_every_link_and_cookie_stays_under_it(
    leases: Leases,
) -> None:
    from starlette.applications import Starlette
    from starlette.routing import Mount

    key = LeaseKey("acme", unique("mounted"))
    await leases.store.acquire(key, "holder-x", 30.0)
    console = create_app(leases.engine, operator_token=TOKEN)
    host = Starlette(routes=[Mount("/fence", app=console)])
    async with client(host) as http:
        page = await http.get("/fence/executions?status=running")
        assert page.status_code == 200
        targets = set(re.findall(r'(?:href|action)="([^"]+)"', page.text))
        assert targets
        assert all(t.startswith("/fence/") for t in targets), targets
        assert "/fence" + page_of(key) in targets
        signed = await http.post("/fence/login", data={"name": "dana", "token": TOKEN})
        assert signed.headers["location"] == "/fence/dead-letters"
        assert "Path=/fence" in signed.headers["set-cookie"]
        home = await http.get("/fence/")
        assert home.headers["location"] == "/fence/executions"


async def test_every_status_newest_run_first_and_one_status_newest_change_first(
    leases: Leases,
) -> None:
    instance = leases.instance("submitter")
    for n in range(70):  # recorded and pending, each at its own time
        config: Any = {"configurable": {"thread_id": f"page-{n:03d}"}}
        await instance.submit("shop", {"log": []}, config, tenant_id="acme")
    app = create_app(leases.engine)
    async with client(app) as http:
        every = await pages_of(http, "/executions")
        pending = await pages_of(http, "/executions?status=pending")
        of_graph = await pages_of(http, "/executions?graph=shop&tenant=acme")
    newest_first = [f"page-{n:03d}" for n in reversed(range(70))]
    assert every == newest_first
    assert pending == newest_first
    assert of_graph == newest_first


async def test_a_row_another_writer_broke_costs_its_stamps_never_the_page(
    leases: Leases, backend: str
) -> None:
    key = LeaseKey("acme", "broken")
    await leases.store.acquire(key, "holder-x", 30.0)
    # Not JSON at all (SQLite's text column can hold it), or JSON that is no object
    # (PostgreSQL's jsonb holds only JSON).
    broken = "'not json'" if backend == "sqlite" else "'[1, \"x\"]'::jsonb"
    async with leases.engine.begin() as conn:
        await conn.execute(
            text(
                f"UPDATE fence_leases SET pending_effects = {broken} WHERE execution_id = 'broken'"
            )
        )
        await conn.execute(
            insert(JOURNAL).values(
                tenant_id="acme", execution_id="broken", at=1e300, kind="mystery", epoch=1
            )
        )
    app = create_app(leases.engine, metrics_max_age=0)
    async with client(app) as http:
        listed = await http.get("/executions?status=running")
        assert listed.status_code == 200
        assert "broken" in listed.text
        page = await http.get(page_of(key))
        assert page.status_code == 200
        assert "not a time" in text_of(page.text)
        assert "mystery" in text_of(page.text)
        assert (await http.get("/metrics")).status_code == 200


async def test_a_key_no_lease_can_have_is_no_such_execution(leases: Leases) -> None:
    app = create_app(leases.engine, operator_token=TOKEN)
    async with client(app) as http:
        assert (await http.get("/executions/acme%3Ab%2500")).status_code == 404
        assert (await http.get("/executions/not-a-key")).status_code == 404


async def test_the_host_apps_can_read_refuses_every_page_and_the_metrics(
    leases: Leases,
) -> None:
    app = create_app(leases.engine, can_read=lambda request: request.headers.get("x-ok") == "1")
    async with client(app) as http:
        for path in ("/executions", "/dead-letters", "/queue", "/instances", "/metrics"):
            assert (await http.get(path)).status_code == 403, path
            assert (await http.get(path, headers={"x-ok": "1"})).status_code == 200, path


async def test_a_delayed_run_and_a_held_back_one_show_when_they_may_start(
    database: Database,
) -> None:
    """A pending run with a time ahead starts in so many seconds (store clock); one held
    back by its flow key says so, never a time millions of years away."""
    from langgraph_fence.queue import Flow

    delayed, held = unique("delayed"), unique("held")
    async with opened(database, "client") as instance:
        config = {"configurable": {"thread_id": delayed}}
        await instance.submit("g", {"n": 1}, config, tenant_id="a", not_before=3600.0)
        config = {"configurable": {"thread_id": held}}
        await instance.submit("g", {"n": 1}, config, tenant_id="a", flow=Flow("k", max_running=1))
        async with client(create_app(instance._run_queue()._engine)) as http:
            delayed_page = text_of((await http.get(page_of(LeaseKey("a", delayed)))).text)
            held_page = text_of((await http.get(page_of(LeaseKey("a", held)))).text)
    assert re.search(r"starts in 3[56]\d\d\.\d s", delayed_page)
    assert "held by its flow key" in held_page

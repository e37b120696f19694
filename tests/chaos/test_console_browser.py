"""The operator's console in a real Chromium, on a real PostgreSQL, with real workers.

A worker is SIGKILLed inside two steps: a non-idempotent charge (on a thread whose id holds
``<script>``) and an idempotent packing step. A second worker takes both over: the charge
is dead-lettered (its write may have happened), the packing resumes at token 2. Then, in
Debian's Chromium driven by Playwright (the browser is never downloaded):

* the dead letter appears with its reason and its token timeline; the thread id is text
  (no script runs: a dialog would fail the test);
* the takeover appears as a new token on the packing run's timeline;
* a read-only console has no form that writes;
* the operator signs in, abandons the dead letter with a note from the page, and the
  database shows it (status, reason, the journal's actor).

Screenshots of each page go to ``$LANGGRAPH_FENCE_ARTIFACTS/console`` (CI keeps them;
docs/console.md shows copies), else to the test's temporary folder.
"""

from __future__ import annotations

import os
import shutil
import signal
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest
from sqlalchemy import select

from langgraph_fence import Instance, LeaseKey, LeaseStatus
from langgraph_fence.lease.journal import JOURNAL
from tests.support.databases import Database
from tests.support.polling import eventually
from tests.support.processes import (
    Started,
    free_port,
    start_process,
    start_worker,
    stop_process,
    wait_ready,
)

pytestmark = [pytest.mark.chaos, pytest.mark.processes, pytest.mark.browser]

TOKEN = "browser-test-operator-token-0123456789"
TENANT = "acme"
GRAPHS = "tests.support.console_graphs:graphs"
TTL = 2.0
CHARGE_THREAD = "order-<script>alert('pwned')</script>"
PACK_THREAD = "parcel-77"
#: The flags Chromium needs as root on a machine with no network beyond loopback.
CHROMIUM_ARGS = [
    "--no-sandbox",
    "--disable-gpu",
    "--disable-quic",
    "--no-first-run",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
]


@pytest.fixture(params=["postgresql"])
def database(request: pytest.FixtureRequest) -> Database:
    """A PostgreSQL schema of the test's own."""
    url, schema = request.getfixturevalue("own_schema")
    return Database(url, schema)


def chromium() -> str:
    """Debian's Chromium, or a skip (a failure under LANGGRAPH_FENCE_REQUIRE_BROWSER=1)."""
    found = os.environ.get("LANGGRAPH_FENCE_CHROMIUM") or shutil.which("chromium")
    if found is None:
        why = "no Chromium on this machine (apt-get install chromium)"
        if os.environ.get("LANGGRAPH_FENCE_REQUIRE_BROWSER") == "1":
            pytest.fail(f"{why}, and LANGGRAPH_FENCE_REQUIRE_BROWSER=1")
        pytest.skip(why)
    return found


def shots_dir(tmp_path: Path) -> Path:
    root = os.environ.get("LANGGRAPH_FENCE_ARTIFACTS")
    shots = Path(root) / "console" if root else tmp_path / "screenshots"
    shots.mkdir(parents=True, exist_ok=True)
    return shots


async def start_ui(
    tmp_path: Path, name: str, database: Database, procs: list[Started], *, token: bool
) -> str:
    port = free_port()
    args = ["-m", "langgraph_fence.cli", "ui", "--db", database.url, "--port", str(port)]
    if database.schema:
        args += ["--schema", database.schema]
    env = {"LANGGRAPH_FENCE_UI_TOKEN": TOKEN if token else ""}
    ui = await start_process(args, tmp_path, name, env=env)
    procs.append(ui)
    await wait_ready(ui, "the console serves", what=f"{name} to serve")
    return f"http://127.0.0.1:{port}"


@pytest.fixture
async def processes() -> AsyncIterator[list[Started]]:
    """The processes a test starts; none is left behind."""
    procs: list[Started] = []
    yield procs
    for proc in procs:
        await stop_process(proc, grace=5)


async def kill_mid_write_and_take_over(
    tmp_path: Path, database: Database, procs: list[Started]
) -> None:
    """w1 is SIGKILLed inside both steps; w2 takes both over."""
    marks = tmp_path / "marks"
    marks.mkdir()
    env = {"LGF_CONSOLE_MARKS": str(marks)}
    first = await start_worker(
        tmp_path,
        "w1",
        database.url,
        database.schema,
        GRAPHS,
        ttl=TTL,
        poll=0.1,
        env={**env, "LGF_CONSOLE_HOLD": "1"},
    )
    procs.append(first)
    async with Instance.open(database.url, schema=database.schema or None) as instance:
        for graph, thread in (("orders", CHARGE_THREAD), ("packing", PACK_THREAD)):
            config: Any = {"configurable": {"thread_id": thread}}
            await instance.submit(graph, {"log": []}, config, tenant_id=TENANT)

    def inside_both() -> bool:
        names = {p.suffix for p in marks.iterdir()}
        return {".charge", ".pack"} <= names

    await wait_ready(first, inside_both, what="w1 to be inside both steps")
    os.kill(first.pid, signal.SIGKILL)  # mid-write: its leases lapse, its stamps stand
    await first.wait()
    second = await start_worker(
        tmp_path, "w2", database.url, database.schema, GRAPHS, ttl=TTL, poll=0.1, env=env
    )
    procs.append(second)


async def lease_status(database: Database, thread: str) -> LeaseStatus | None:
    async with Instance.open(database.url, schema=database.schema or None, journal=False) as i:
        lease = await i.repository.get(LeaseKey(TENANT, thread))
    return None if lease is None else lease.status


async def test_an_operator_finds_and_resolves_a_dead_letter_in_a_real_browser(
    tmp_path: Path, database: Database, processes: list[Started]
) -> None:
    browser_path = chromium()
    from playwright.async_api import async_playwright, expect

    await kill_mid_write_and_take_over(tmp_path, database, processes)

    async def settled() -> bool:
        charge = await lease_status(database, CHARGE_THREAD)
        pack = await lease_status(database, PACK_THREAD)
        return charge is LeaseStatus.DEAD_LETTERED and pack is LeaseStatus.DONE

    await eventually(settled, timeout=60, what="w2 to dead-letter the charge and finish packing")

    async def journaled() -> bool:  # written off the runs' path, a moment after each turn
        async with Instance.open(database.url, schema=database.schema or None, journal=False) as i:
            engine = i.repository.engine  # type: ignore[attr-defined]
            async with engine.connect() as conn:
                kinds = {
                    (kind, holder)
                    for kind, holder in await conn.execute(select(JOURNAL.c.kind, JOURNAL.c.holder))
                }
        return {("taken_over", "w1"), ("dead_lettered", "w2")} <= kinds

    await eventually(journaled, timeout=30, what="both workers' turns in the journal")
    operator_url = await start_ui(tmp_path, "ui-operator", database, processes, token=True)
    read_only_url = await start_ui(tmp_path, "ui-read-only", database, processes, token=False)
    shots = shots_dir(tmp_path)
    dialogs: list[str] = []

    async with async_playwright() as playwright:
        browser = await playwright.chromium.launch(
            executable_path=browser_path, headless=True, args=CHROMIUM_ARGS
        )
        try:
            page = await browser.new_page(viewport={"width": 1400, "height": 900})
            page.on("dialog", lambda dialog: dialogs.append(dialog.message))

            # Read-only: every page, no form that writes, no button that acts.
            for path, shot in (
                ("/executions", "executions"),
                ("/dead-letters", "dead-letters-read-only"),
                ("/queue", "queue"),
                ("/instances", "instances"),
            ):
                await page.goto(read_only_url + path)
                await expect(page.locator("header")).to_contain_text("read-only")
                assert await page.locator("form[method=post]").count() == 0, path
                assert await page.get_by_role("button", name="abandon").count() == 0, path
                await page.screenshot(path=str(shots / f"{shot}.png"), full_page=True)

            # The dead letter: its thread id as text, its reason, its timeline.
            await page.goto(operator_url + "/dead-letters")
            row = page.locator("table.executions tbody tr", has_text="alert('pwned')")
            await expect(row).to_have_count(1)
            await expect(row).to_contain_text(CHARGE_THREAD)  # shown as text, markup and all
            await expect(row).to_contain_text("dead_lettered")
            await expect(row).to_contain_text("charge")
            await row.get_by_role("link").click()
            await expect(page.locator("h1")).to_contain_text(CHARGE_THREAD)
            reason = page.locator("dl.lease")
            await expect(reason).to_contain_text("charge")
            timeline = page.locator("table.timeline")
            await expect(timeline.locator("tr[data-token='1']").first).to_contain_text("w1")
            await expect(timeline.locator("tr[data-token='2']").first).to_contain_text(
                "dead-lettered"
            )
            await expect(page.locator("table.stamps")).to_contain_text("non_idempotent_write")
            await page.screenshot(path=str(shots / "dead-letter.png"), full_page=True)

            # The takeover: a new token on the packing run's timeline, by the second worker.
            await page.goto(operator_url + f"/executions?graph=packing&tenant={TENANT}")
            await page.get_by_role("link", name=PACK_THREAD).click()
            timeline = page.locator("table.timeline")
            await expect(timeline.locator("tr[data-token='1']").first).to_contain_text("w1")
            await expect(timeline.locator("tr[data-token='2']").first).to_contain_text("w2")
            await expect(timeline.locator("tr[data-token='2']").first).to_contain_text(
                "took it over"
            )
            await page.screenshot(path=str(shots / "takeover.png"), full_page=True)

            # The operator signs in and abandons the dead letter with a note, from the page.
            await page.goto(operator_url + "/login")
            await page.get_by_label("your name").fill("dana")
            await page.get_by_label("operator token").fill(TOKEN)
            await page.get_by_role("button", name="sign in").click()
            await expect(page.locator("header")).to_contain_text("operator dana")
            row = page.locator("table.executions tbody tr", has_text="alert('pwned')")
            await row.get_by_placeholder("what was checked, by whom").fill(
                "card checked: charged once, refunded"
            )
            await page.screenshot(path=str(shots / "dead-letters-operator.png"), full_page=True)
            await row.get_by_role("button", name="abandon").click()
            await expect(page.get_by_role("status")).to_contain_text("Abandoned")
            await expect(page.locator("dl.lease")).to_contain_text("failed")
            await expect(page.locator("table.timeline")).to_contain_text("abandoned by an operator")
            await page.screenshot(path=str(shots / "abandoned.png"), full_page=True)
        finally:
            await browser.close()

    assert dialogs == []  # no script of a tenant's ran
    assert await lease_status(database, CHARGE_THREAD) is LeaseStatus.FAILED
    async with Instance.open(database.url, schema=database.schema or None, journal=False) as i:
        lease = await i.repository.get(LeaseKey(TENANT, CHARGE_THREAD))
        engine = i.repository.engine  # type: ignore[attr-defined]
        async with engine.connect() as conn:
            actions = (
                await conn.execute(
                    select(JOURNAL.c.kind, JOURNAL.c.actor, JOURNAL.c.detail).where(
                        JOURNAL.c.execution_id == CHARGE_THREAD, JOURNAL.c.actor.is_not(None)
                    )
                )
            ).all()
    assert lease is not None
    assert lease.reason == "abandoned by operator: card checked: charged once, refunded"
    assert [tuple(a) for a in actions] == [
        ("abandoned", "dana", "card checked: charged once, refunded")
    ]

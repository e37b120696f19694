"""``langgraph-fence demo``, run as a new user runs it: a process of its own, in a folder.

It keeps its database, and ``langgraph-fence executions`` pointed at it shows the demo's
execution done; the card was charged once (by token 2) and the stale worker's charge was
tried and refused.
"""

from __future__ import annotations

import os
import re
import shlex
import sqlite3
import subprocess
import sys
import uuid
from contextlib import closing
from pathlib import Path

import pytest
from sqlalchemy.engine import make_url

from tests.support.databases import pg_admin, pg_url_from_env

#: The CLI or Python run in processes of their own (CI's lowest run leaves them to the newest).
pytestmark = pytest.mark.processes


def _cli(*args: str, cwd: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "langgraph_fence.cli", *args],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=cwd,
        env={**os.environ, "COLUMNS": "200"},
    )


def _run_demo(cwd: Path, *args: str) -> tuple[str, list[str]]:
    """Run the demo; returns its order id and the inspect command it printed."""
    done = _cli("demo", *args, cwd=cwd)
    assert done.returncode == 0, done.stdout + done.stderr
    out = done.stdout
    # Every library warning went into the timeline, none to stderr (nor twice).
    assert "WARNING" not in done.stderr, done.stderr
    assert "OK: charged once, by the holder of token 2" in out
    assert "stale writes refused: 1" in out
    # The stale worker's attempt, and its refusal, each a row with its worker and token.
    assert re.search(r"│ A +│ +1 │ goes on: tries its charge through the sink", out), out
    assert re.search(r"│ A +│ +1 │ fenced: an external system has seen token 2", out), out
    assert re.search(r"│ A +│ +1 │ charge refused \(ExecutionFencedError\)", out), out
    assert re.search(r"│ B +│ +2 │ charged 4200 cents once", out), out
    for row in re.findall(r"^│ +\d+\.\d\d │.*$", out, flags=re.MULTILINE):
        assert re.match(r"│ +\d+\.\d\d │ [AB] +│ +\d+ │", row), (
            f"a row without worker or token: {row}"
        )
    order = re.search(r"timeline of execution acme:(order-[0-9a-f]+)", out)
    assert order is not None, out
    command = _inspect_command(out)
    assert command[:3] == [sys.executable, "-m", "langgraph_fence"], command
    return order.group(1), command[3:]


def _inspect_command(out: str) -> list[str]:
    """The command the demo printed to inspect its database: the whole line after
    "inspect it with:", split as a shell splits it."""
    found = re.search(r"inspect it with(?: \(its password left out: .*\))?:\n(.*)\n", out)
    assert found is not None, out
    return shlex.split(found.group(1))


def _assert_listed_done(cwd: Path, command: list[str], order: str) -> None:
    listed = _cli(*command, cwd=cwd)
    assert listed.returncode == 0, listed.stdout + listed.stderr
    (row,) = [line for line in listed.stdout.splitlines() if order in line]
    assert re.search(r"│ done +│", row), listed.stdout


def test_the_demo_keeps_its_sqlite_file_and_executions_shows_it_done(tmp_path: Path) -> None:
    order, command = _run_demo(tmp_path)
    kept = tmp_path / "langgraph-fence-demo.db"
    assert kept.exists()
    assert command == ["executions", "--db", f"sqlite+aiosqlite:///{kept}"]
    with closing(sqlite3.connect(kept)) as conn:
        payments = conn.execute(
            "SELECT order_id, amount_cents, token FROM demo_payments"
        ).fetchall()
    assert payments == [(order, 4200, 2)]  # exactly one charge, by token 2
    _assert_listed_done(tmp_path, command, order)

    # A second run uses the same file: a new order, both listed.
    again, _ = _run_demo(tmp_path)
    assert again != order
    _assert_listed_done(tmp_path, command, again)


def test_the_demo_prints_a_command_that_runs_as_printed_in_a_narrow_terminal(
    tmp_path: Path,
) -> None:
    """At 80 columns, in a folder whose path makes the command longer than that, the
    command is one line, and a shell without the virtual environment on its PATH runs it."""
    folder = tmp_path / ("a-long-folder-name-" * 3)
    folder.mkdir()
    done = subprocess.run(
        [sys.executable, "-m", "langgraph_fence", "demo"],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=folder,
        env={**os.environ, "COLUMNS": "80"},
    )
    assert done.returncode == 0, done.stdout + done.stderr
    line = re.search(r"inspect it with:\n(.*)\n", done.stdout)
    assert line is not None, done.stdout
    assert len(line.group(1)) > 80  # it would have wrapped
    bare = {k: v for k, v in os.environ.items() if k not in ("VIRTUAL_ENV", "PYTHONHOME")}
    bare.update(PATH="/usr/bin:/bin", COLUMNS="200")
    ran = subprocess.run(
        ["/bin/sh", "-c", line.group(1)],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=tmp_path,  # anywhere: the command names the database in full
        env=bare,
    )
    assert ran.returncode == 0, ran.stdout + ran.stderr
    order = re.search(r"acme:(order-[0-9a-f]+)", done.stdout)
    assert order is not None, done.stdout
    assert order.group(1) in ran.stdout, ran.stdout


def test_the_demo_on_postgresql_works_in_its_schema_and_says_which(
    own_schema: tuple[str, str], tmp_path: Path
) -> None:
    url, schema = own_schema
    # With a password (the test server trusts its clients, so any works): the printed
    # command leaves it out (a masked one would fail) and says where it goes instead.
    with_password = make_url(url).set(password="s3cret").render_as_string(hide_password=False)
    order, command = _run_demo(tmp_path, "--db", with_password, "--schema", schema)
    assert command[-2:] == ["--schema", schema]
    assert not any("s3cret" in part or "***" in part for part in command), command
    _assert_listed_done(tmp_path, command, order)
    # Nothing outside its schema: the database's default schema does not list it.
    listed = _cli("executions", "--db", pg_url_from_env(), cwd=tmp_path)
    assert order not in listed.stdout


def test_the_demo_on_postgresql_makes_a_schema_of_its_own_when_given_none(
    pg_schema: tuple[str, str], tmp_path: Path
) -> None:
    # A database of the test's own: the demo's default schema outlives the demo, by design.
    url, _ = pg_schema
    database = f"lgf_demo_{uuid.uuid4().hex[:10]}"
    pg_admin(url, f'CREATE DATABASE "{database}"')
    try:
        own = make_url(url).set(database=database).render_as_string(hide_password=False)
        order, command = _run_demo(tmp_path, "--db", own)
        assert command[-2:] == ["--schema", "langgraph_fence_demo"]
        _assert_listed_done(tmp_path, command, order)
    finally:
        pg_admin(url, f'DROP DATABASE IF EXISTS "{database}" WITH (FORCE)')


def test_a_schema_on_sqlite_is_refused(tmp_path: Path) -> None:
    done = _cli("demo", "--schema", "x", cwd=tmp_path)
    assert done.returncode == 2
    assert "--schema is for PostgreSQL" in done.stderr
    assert not (tmp_path / "langgraph-fence-demo.db").exists()


def test_an_unsupported_database_is_refused_naming_the_supported_ones(tmp_path: Path) -> None:
    done = _cli("demo", "--db", "mysql://root@localhost/test", cwd=tmp_path)
    assert done.returncode == 2
    assert "sqlite+aiosqlite" in done.stderr
    assert "postgresql+asyncpg" in done.stderr

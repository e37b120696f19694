"""What an operator sees when a ``langgraph-fence`` command goes wrong: one line on stderr
naming the fix, exit status 2, no traceback (unless ``--debug``). Each case runs the
installed console script in a process of its own, as a user runs it."""

from __future__ import annotations

import json
import os
import sqlite3
import subprocess
import sys
import uuid
from importlib.metadata import version
from pathlib import Path

import pytest
from sqlalchemy.engine import make_url

from tests.support.databases import pg_admin, pg_url_from_env

#: The CLI or Python run in processes of their own (CI's lowest run leaves them to the newest).
pytestmark = pytest.mark.processes

#: The console script pip installed beside this interpreter.
SCRIPT = str(Path(sys.executable).with_name("langgraph-fence"))
COMMANDS = ["demo", "worker", "migrate", "erase", "executions", "dead-letters", "resolve"]


def run(*args: str, cwd: Path | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [SCRIPT, *args],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=cwd,
        # A narrow terminal: a one-line error must not be wrapped to its width.
        env={**os.environ, "COLUMNS": "60"},
    )


def assert_one_line(done: subprocess.CompletedProcess[str], *expected: str) -> str:
    """Exit status 2, nothing on stdout, one line on stderr holding every ``expected``."""
    assert done.returncode == 2, done.stdout + done.stderr
    assert "Traceback" not in done.stderr
    lines = done.stderr.splitlines()
    assert len(lines) == 1, done.stderr
    for text in expected:
        assert text in lines[0], lines[0]
    assert done.stdout == ""
    return lines[0]


def pg_url(**parts: object) -> str:
    """The test PostgreSQL's URL with ``parts`` (host, port, database, username) changed."""
    return make_url(pg_url_from_env()).set(**parts).render_as_string(hide_password=False)


def test_an_unreachable_host_says_so_and_what_to_check() -> None:
    done = run("executions", "--db", pg_url(host="127.0.0.1", port=1))
    assert_one_line(done, "cannot connect to PostgreSQL at 127.0.0.1:1", "is the server running")


def test_an_unknown_host_name_says_which() -> None:
    done = run("dead-letters", "--db", pg_url(host="no-such-host.invalid"))
    assert_one_line(done, "cannot resolve the host 'no-such-host.invalid'", "fix the host")


def test_a_missing_database_says_to_create_it(pg_schema: tuple[str, str]) -> None:
    done = run("executions", "--db", pg_url(database="lgf_no_such_db"))
    assert_one_line(done, "no database 'lgf_no_such_db'", "createdb")


def test_a_missing_role_says_so_and_masks_the_password(pg_schema: tuple[str, str]) -> None:
    done = run("executions", "--db", pg_url(username="lgf_no_such_role", password="s3cret"))
    line = assert_one_line(done, "refused the login of 'lgf_no_such_role'", "fix the user")
    assert "s3cret" not in line


def test_a_sqlite_file_in_a_missing_folder_is_refused_before_any_driver(tmp_path: Path) -> None:
    db = f"sqlite+aiosqlite:///{tmp_path}/no/such/folder/fence.db"
    for command in (["migrate"], ["executions"], ["resolve", "t:e", "--retry"]):
        done = run(*command, "--db", db)
        assert_one_line(done, f"the folder {tmp_path}/no/such/folder", "mkdir -p")
    assert not (tmp_path / "no").exists()


def test_listing_a_sqlite_file_that_does_not_exist_creates_nothing(tmp_path: Path) -> None:
    done = run("executions", "--db", f"sqlite+aiosqlite:///{tmp_path}/typo.db")
    assert_one_line(done, f"there is no SQLite file {tmp_path}/typo.db", "langgraph-fence migrate")
    assert not (tmp_path / "typo.db").exists()


def test_a_sqlite_database_never_migrated_says_to_migrate(tmp_path: Path) -> None:
    path = tmp_path / "other.db"
    with sqlite3.connect(path) as conn:
        conn.execute("CREATE TABLE unrelated (x INTEGER)")
    db = f"sqlite+aiosqlite:///{path}"
    for command in (["executions"], ["resolve", "t:e", "--retry"]):
        done = run(*command, "--db", db)
        assert_one_line(done, "no such table: fence_leases", f"langgraph-fence migrate --db {db}")
    with sqlite3.connect(path) as conn:  # resolve created no table on the wrong database
        tables = {row[0] for row in conn.execute("SELECT name FROM sqlite_master")}
    assert tables == {"unrelated"}


def test_a_postgresql_schema_never_migrated_says_to_migrate(own_schema: tuple[str, str]) -> None:
    url, schema = own_schema
    done = run("executions", "--db", url, "--schema", schema)
    assert_one_line(done, '"fence_leases" does not exist', f"migrate --db {url} --schema {schema}")


def test_a_schema_that_does_not_exist_is_listed_as_never_migrated_and_migrate_creates_it(
    pg_schema: tuple[str, str],
) -> None:
    """docs/cli.md's own ``migrate --schema fence``, on a schema that does not exist yet."""
    url, _ = pg_schema
    schema = f"lgf_fresh_{uuid.uuid4().hex[:12]}"
    try:
        # A listing creates nothing: it says to migrate, naming the schema.
        done = run("executions", "--db", url, "--schema", schema)
        assert_one_line(
            done, "has no langgraph-fence tables", f"migrate --db {url} --schema {schema}"
        )
        migrated = run("migrate", "--db", url, "--schema", schema)
        assert migrated.returncode == 0, migrated.stdout + migrated.stderr
        listed = run("executions", "--db", url, "--schema", schema, "--json")
        assert (listed.returncode, json.loads(listed.stdout)) == (0, []), listed.stderr
        again = run("migrate", "--db", url, "--schema", schema)  # a no-op the second time
        assert again.returncode == 0, again.stdout + again.stderr
    finally:
        pg_admin(url, f'DROP SCHEMA IF EXISTS "{schema}" CASCADE')


@pytest.mark.parametrize(
    "command",
    [
        ["migrate"],
        ["executions"],
        ["dead-letters"],
        ["runs"],
        ["resolve", "t:e", "--retry"],
        ["worker", "--graphs", "m:f"],
        ["submit", "--graph", "g", "--thread", "t", "--input", "{}"],
    ],
)
def test_a_schema_with_a_sqlite_url_is_one_line(command: list[str], tmp_path: Path) -> None:
    db = f"sqlite+aiosqlite:///{tmp_path}/fence.db"
    sqlite3.connect(tmp_path / "fence.db").close()  # exists: the listings get past that check
    done = run(*command, "--db", db, "--schema", "fence")
    assert_one_line(done, "--schema: SQLite has no schemas", "leave --schema out")


@pytest.mark.parametrize(
    ("db", "expected"),
    [
        ("mysql://root:pw@localhost/x", "unsupported driver 'mysql'"),
        ("not a url", "is not a database URL"),
    ],
)
def test_a_bad_url_names_the_supported_ones(db: str, expected: str) -> None:
    line = assert_one_line(run("executions", "--db", db), "--db", expected, "sqlite+aiosqlite")
    assert "pw" not in line


@pytest.mark.parametrize(
    ("args", "expected"),
    [
        (["executions", "--db", "sqlite:///x.db", "--status", "bogus"], "choose from 'pending'"),
        (["executions", "--db", "sqlite:///x.db", "--limit", "0"], "--limit: expected a whole"),
        (["executions"], "the following arguments are required: --db"),
        (["worker", "--db", "sqlite:///x.db", "--graphs", "m:f", "--lease-ttl", "0"], "seconds"),
        (["worker", "--db", "sqlite:///x.db", "--graphs", "m:f", "--concurrency", "x"], "whole"),
        (["resolve", "--db", "sqlite:///x.db", "t:e"], "one of the arguments --retry --abandon"),
        (["nosuchcommand"], "invalid choice: 'nosuchcommand'"),
    ],
)
def test_bad_arguments_are_one_line_naming_the_help(
    args: list[str], expected: str, tmp_path: Path
) -> None:
    done = run(*args, cwd=tmp_path)
    assert_one_line(done, expected, "--help`")
    assert list(tmp_path.iterdir()) == []  # nothing written


def test_bad_resolve_input_is_refused_before_the_database_is_opened(tmp_path: Path) -> None:
    db = f"sqlite+aiosqlite:///{tmp_path}/fence.db"
    assert_one_line(run("resolve", "t:e", "--abandon", "--db", db), "--abandon needs --reason")
    assert_one_line(
        run("resolve", "t:e", "--abandon", "--reason", " ", "--db", db), "--abandon needs --reason"
    )
    assert_one_line(run("resolve", "nocolon", "--retry", "--db", db), "KEY:", "not a scope key")
    assert_one_line(run("resolve", "--retry", "--db", db), "name the execution")
    assert not (tmp_path / "fence.db").exists()


def test_debug_adds_the_traceback(tmp_path: Path) -> None:
    done = run("executions", "--debug", "--db", pg_url(host="127.0.0.1", port=1))
    assert done.returncode == 2
    assert "Traceback" in done.stderr
    assert done.stderr.splitlines()[-1].startswith("error: cannot connect to PostgreSQL")


@pytest.mark.parametrize("command", [None, *COMMANDS])
def test_the_help_of_every_command_documents_the_exit_status(command: str | None) -> None:
    done = run(*([command] if command else []), "--help")
    assert done.returncode == 0, done.stderr
    assert "exit status:" in done.stdout
    assert "2  bad usage or input" in done.stdout
    if command in ("worker", "executions", "dead-letters", "erase", "migrate", "resolve"):
        assert "--schema" in done.stdout


def test_the_worker_help_gives_units_and_defaults() -> None:
    out = " ".join(run("worker", "--help").stdout.split())
    assert "--lease-ttl SECONDS" in out
    assert "(default: 30.0)" in out
    assert "--poll-interval SECONDS" in out
    assert "(default: 1.0)" in out
    assert "at once (default: 4)" in out


def test_version_is_the_installed_distributions() -> None:
    done = run("--version")
    assert (done.returncode, done.stdout) == (0, f"langgraph-fence {version('langgraph-fence')}\n")
    import langgraph_fence

    assert langgraph_fence.__version__ == version("langgraph-fence")


def test_help_and_listings_never_load_langgraph(tmp_path: Path) -> None:
    """The start-up budget (0.5 s, benchmarks/README.md): LangGraph's imports alone cost
    seconds, so the commands an operator types most must not load it."""
    db = f"sqlite+aiosqlite:///{tmp_path}/fence.db"
    assert run("migrate", "--db", db).returncode == 0
    probe = (
        "import sys\n"
        "from langgraph_fence.cli import main\n"
        "code = main(sys.argv[1:])\n"
        "print('LOADED', sorted(m for m in sys.modules if m.split('.')[0] in "
        "('langgraph', 'langchain_core', 'checkpointers') "
        "or m.startswith('langgraph_fence.checkpointers')))\n"
        "sys.exit(code)\n"
    )
    for args in (
        ["executions", "--db", db, "--json"],
        ["dead-letters", "--db", db],
        ["runs", "--db", db, "--json"],
    ):
        done = subprocess.run(
            [sys.executable, "-c", probe, *args], capture_output=True, text=True, timeout=120
        )
        assert done.returncode == 0, done.stderr
        assert done.stdout.splitlines()[-1] == "LOADED []"
    listed = subprocess.run(
        [sys.executable, "-c", probe, "executions", "--db", db, "--json"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert json.loads(listed.stdout.rsplit("LOADED", 1)[0]) == []

"""``langgraph-fence schedules``, run as an operator runs it: each command a process of its
own, on one database (workers firing the ticks: tests/chaos/test_schedules_chaos.py)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from tests.support.cli import cli

#: The CLI in processes of its own (CI's lowest run leaves them to the newest).
pytestmark = pytest.mark.processes


def listed(db: str) -> list[dict[str, Any]]:
    done = cli("schedules", "list", "--db", db, "--json")
    assert done.returncode == 0, done.stderr
    found: list[dict[str, Any]] = json.loads(done.stdout)
    return found


def test_create_list_pause_resume_and_delete_on_the_command_line(tmp_path: Path) -> None:
    db = f"sqlite+aiosqlite:///{tmp_path}/schedules.db"
    made = cli(
        "schedules", "create", "nightly", "--db", db, "--graph", "report", "--thread",
        "reports", "--input", '{"day": "today"}', "--cron", "0 2 * * *", "--timezone",
        "Europe/Paris", "--overlap", "enqueue", "--end-at", "2099-01-01T00:00:00+00:00",
    )  # fmt: skip
    assert made.returncode == 0, made.stderr
    assert "next tick 20" in made.stdout
    [schedule] = listed(db)
    assert schedule["schedule_id"] == "nightly"
    assert schedule["cron"] == "0 2 * * *"
    assert schedule["timezone"] == "Europe/Paris"
    assert schedule["overlap"] == "enqueue"
    assert schedule["paused"] is False
    # 2:00 in Paris is 1:00 or 0:00 UTC, by the season.
    assert schedule["next_tick"][11:] in ("01:00:00+00:00", "00:00:00+00:00")
    assert schedule["end_at"] == "2099-01-01T00:00:00+00:00"

    again = cli(
        "schedules", "create", "nightly", "--db", db, "--graph", "report", "--thread",
        "reports", "--input", "{}", "--cron", "0 3 * * *",
    )  # fmt: skip
    assert again.returncode == 2
    assert "exists: nothing written" in again.stderr
    assert listed(db)[0]["cron"] == "0 2 * * *"

    assert cli("schedules", "pause", "nightly", "--db", db).returncode == 0
    assert listed(db)[0]["paused"] is True
    resumed = cli("schedules", "resume", "nightly", "--db", db)
    assert resumed.returncode == 0, resumed.stderr
    assert listed(db)[0]["paused"] is False
    unknown = cli("schedules", "resume", "weekly", "--db", db)
    assert unknown.returncode == 2
    assert "'weekly'" in unknown.stderr
    assert cli("schedules", "delete", "nightly", "--db", db).returncode == 0
    assert listed(db) == []


@pytest.mark.parametrize(
    ("options", "says"),
    [
        (["--cron", "every day"], "cron must be a cron expression"),
        (["--cron", "* * * * *", "--timezone", "Mars/Olympus"], "timezone must be"),
        (["--cron", "* * * * *", "--end-at", "soon"], "--end-at must be"),
        (["--cron", "* * * * *", "--overlap", "drop"], "invalid choice"),
    ],
)
def test_a_bad_schedule_is_one_line_naming_it(
    tmp_path: Path, options: list[str], says: str
) -> None:
    db = f"sqlite+aiosqlite:///{tmp_path}/schedules.db"
    done = cli(
        "schedules", "create", "s", "--db", db, "--graph", "g", "--thread", "t", "--input",
        "{}", *options,
    )  # fmt: skip
    assert done.returncode == 2
    assert says in done.stderr

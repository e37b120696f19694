"""The docs' code runs (issue 34): every ```python block of README.md and docs/*.md that is
not marked a fragment is a complete program, run as a newcomer would run it (a file of its
own, in an empty folder, on SQLite); a fragment at least compiles.

Each program runs in a process of its own with a timeout, in ``tmp_path`` (the SQLite
files it makes land there). The quickstart's slow model call is skipped (``PLAN_SECONDS``).
"""

from __future__ import annotations

import ast
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.support.pages import Block, all_blocks

pytestmark = pytest.mark.processes

BLOCKS = all_blocks()
PROGRAMS = [block for block in BLOCKS if not block.fragment]
TIMEOUT = 120  # imports take seconds on a busy 2-core machine


def test_the_readme_has_programs_to_run() -> None:
    assert [b for b in PROGRAMS if b.page.name == "README.md"], "the README's snippet is gone"


@pytest.mark.parametrize("block", [b for b in BLOCKS if b.fragment], ids=lambda b: b.name)
def test_a_fragment_compiles(block: Block) -> None:
    compile(block.code, block.name, "exec", flags=ast.PyCF_ALLOW_TOP_LEVEL_AWAIT)


@pytest.mark.processes
@pytest.mark.parametrize("block", PROGRAMS, ids=lambda b: b.name)
def test_a_program_runs(block: Block, tmp_path: Path) -> None:
    script = tmp_path / "snippet.py"
    script.write_text(block.code, encoding="utf-8")
    # A newcomer's environment: none of the project's variables, the package installed.
    env = {
        k: v
        for k, v in os.environ.items()
        if not k.startswith(("LANGGRAPH_FENCE_", "LGF_")) and k != "PYTHONPATH"
    }
    env["PLAN_SECONDS"] = "0"
    try:
        done = subprocess.run(
            [sys.executable, str(script)],
            cwd=tmp_path,
            env=env,
            capture_output=True,
            text=True,
            timeout=TIMEOUT,
            stdin=subprocess.DEVNULL,
        )
    except subprocess.TimeoutExpired as timeout:
        pytest.fail(f"{block.name} did not end within {TIMEOUT} s: {timeout.stderr!r}")
    assert done.returncode == 0, (
        f"{block.name} is not marked <!-- fragment --> and does not run "
        f"(exit {done.returncode}):\n{done.stderr[-3000:]}"
    )

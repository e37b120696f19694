"""Running the ``langgraph-fence`` command line in a test: ``cli()`` and the schema's arguments."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path


def cli(*args: str, columns: int = 200) -> subprocess.CompletedProcess[str]:
    """``langgraph-fence ARGS`` run to its end (60 s at most), its output captured, on a
    terminal ``columns`` wide."""
    return subprocess.run(
        [sys.executable, "-m", "langgraph_fence.cli", *args],
        capture_output=True,
        text=True,
        timeout=60,
        cwd=ROOT,
        env={**os.environ, "COLUMNS": str(columns)},
    )


def schema_args(schema: str) -> list[str]:
    return ["--schema", schema] if schema else []


ROOT = Path(__file__).parents[2]

"""Running the ``langgraph-fence`` command line in a test: ``cli()`` and the schema's arguments."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path


def cli(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "langgraph_fence.cli", *args],
        capture_output=True,
        text=True,
        timeout=60,
        cwd=ROOT,
        env={**os.environ, "COLUMNS": "200"},
    )


def schema_args(schema: str) -> list[str]:
    return ["--schema", schema] if schema else []


ROOT = Path(__file__).parents[2]

"""The benchmarks import only what the package has: a module moved or a name renamed
fails here, not the first time someone runs ``benchmarks/`` (they are not run in CI)."""

from __future__ import annotations

import ast
import importlib
import importlib.util
from pathlib import Path

import pytest

BENCHMARKS = sorted((Path(__file__).parents[2] / "benchmarks").glob("*.py"))


@pytest.mark.parametrize("path", BENCHMARKS, ids=lambda p: p.name)
def test_every_name_a_benchmark_takes_from_the_package_exists(path: Path) -> None:
    missing = []
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("langgraph_fence"):
            module = importlib.import_module(node.module or "")
            missing += [
                f"{node.module}.{alias.name}"
                for alias in node.names
                if not hasattr(module, alias.name)
                and importlib.util.find_spec(f"{node.module}.{alias.name}") is None
            ]
        elif isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name.startswith("langgraph_fence"):
                    importlib.import_module(alias.name)
    assert missing == []

"""Every notebook under notebooks/ runs top to bottom, quickly, on the public API only,
leaves no file behind, and is stored without outputs."""

from __future__ import annotations

import ast
import time
from pathlib import Path

import nbformat
import pytest
from nbclient import NotebookClient

NOTEBOOKS = sorted((Path(__file__).parents[2] / "notebooks").glob("*.ipynb"))

#: What each notebook must show: its point, in its own outputs.
SHOWN = {
    "01_quickstart.ipynb": [
        "event: acquired token 1 of acme:order-1",
        "charge order-1: token 1, attempt 1",
        "charge order-1: token 2, attempt 1",
        "execution.context-unavailable",
    ],
    "02_takeover.ipynb": [
        "execution.lease-lost.fenced | held 1 | store has 2",
        "[('acquired', 1, 'A'), ('taken_over', 2, 'B'), ('fenced', 1, 'A')]",
        "crashed 1 workers",
        "(<LeaseStatus.DONE: 'done'>, 4)",
    ],
    "03_exactly_once.ipynb": [
        "execution.lease-lost.fenced | held 1 | seen 2",
        "[('order-7', 4200, 2)]",
        "('receipt of order-7 under token 2', [('order-7', 4200, 2)])",
    ],
    "04_children.ipynb": [
        "while A waits: waiting | holder A | epoch 1",
        "['A', 'B', 'C'] | the parent step went on under token [2]",
        "A  yielded    token 1  acme:fan-1",
        "A  retaken    token 2  acme:fan-1",
    ],
}

#: The modules a notebook may import from this project: the public ones.
PUBLIC = {"langgraph_fence", "langgraph_fence.testing", "langgraph_fence.sinks"}


def _code(path: Path) -> list[str]:
    notebook = nbformat.read(path, as_version=4)
    return [cell.source for cell in notebook.cells if cell.cell_type == "code"]


@pytest.mark.parametrize("path", NOTEBOOKS, ids=[p.name for p in NOTEBOOKS])
def test_the_notebook_runs_in_a_minute_and_leaves_nothing_behind(
    path: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    notebook = nbformat.read(path, as_version=4)
    cwd, temp = tmp_path / "cwd", tmp_path / "tmp"
    cwd.mkdir()
    temp.mkdir()
    monkeypatch.setenv("TMPDIR", str(temp))  # the kernel's tempfile folders go here
    started = time.monotonic()
    NotebookClient(
        notebook, timeout=120, kernel_name="python3", resources={"metadata": {"path": str(cwd)}}
    ).execute()
    elapsed = time.monotonic() - started
    outputs = [o for cell in notebook.cells for o in cell.get("outputs", [])]
    assert not [o for o in outputs if o.get("output_type") == "error"]
    text = "".join(str(o.get("text", "")) + str(o.get("data", "")) for o in outputs)
    for shown in SHOWN[path.name]:
        assert shown in text, f"{path.name} does not show {shown!r}:\n{text}"
    assert elapsed < 60, f"{path.name} took {elapsed:.1f} s"
    assert not list(cwd.iterdir()), "files left in the notebook's folder"
    left = [p.name for p in temp.iterdir() if not p.name.startswith(("tmp", "ipykernel"))]
    assert not left, f"files left in the temporary folder: {left}"


@pytest.mark.parametrize("path", NOTEBOOKS, ids=[p.name for p in NOTEBOOKS])
def test_the_notebook_uses_only_the_public_api(path: Path) -> None:
    for source in _code(path):
        # Top-level await is valid in a notebook: parse each cell as a coroutine's body.
        body = "async def _cell():\n" + "\n".join(f"    {line}" for line in source.splitlines())
        for node in ast.walk(ast.parse(body)):
            if isinstance(node, ast.ImportFrom) and (node.module or "").startswith(
                ("langgraph_fence", "checkpointers")
            ):
                assert node.module in PUBLIC, f"{path.name} imports {node.module}"
            if isinstance(node, ast.Import):
                for alias in node.names:
                    assert not alias.name.startswith(("langgraph_fence.", "checkpointers"))
            if isinstance(node, ast.Attribute) and not node.attr.endswith("__"):
                assert not node.attr.startswith("_"), f"{path.name} uses .{node.attr}"


@pytest.mark.parametrize("path", NOTEBOOKS, ids=[p.name for p in NOTEBOOKS])
def test_the_notebook_is_stored_without_outputs(path: Path) -> None:
    notebook = nbformat.read(path, as_version=4)
    for cell in notebook.cells:
        if cell.cell_type == "code":
            assert cell.outputs == [], path.name
            assert cell.execution_count is None, path.name


def test_there_are_the_three_notebooks() -> None:
    assert [p.name for p in NOTEBOOKS] == sorted(SHOWN)

"""Every notebook under notebooks/ runs top to bottom, quickly, on the public API only, and
leaves no file behind; each is stored with the outputs of its current code (GitHub shows
them), and no output names a folder of the machine that ran it.

After a change to a notebook, ``python -m tests.integration.test_notebooks`` runs every
notebook once in a fresh kernel and saves its outputs (``... test_notebooks 02_takeover.ipynb``
one of them).
"""

from __future__ import annotations

import ast
import hashlib
import re
import sys
import tempfile
import time
from pathlib import Path

import nbformat
import pytest
from nbclient import NotebookClient

pytestmark = pytest.mark.processes

ROOT = Path(__file__).parents[2]
NOTEBOOKS = sorted((ROOT / "notebooks").glob("*.ipynb"))
SAVE = "python -m tests.integration.test_notebooks"

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

#: Where the notebook metadata records which code its saved outputs are the outputs of.
OUTPUTS_OF = "langgraph_fence_outputs_of"

#: Folders no saved output may name: they are the machine's, not the reader's.
MACHINE_PATHS = re.compile(r"/tmp/|/var/folders/|/home/|/Users/|/root/|site-packages")


def _code(path: Path) -> list[str]:
    notebook = nbformat.read(path, as_version=4)
    return [cell.source for cell in notebook.cells if cell.cell_type == "code"]


def _digest(notebook: nbformat.NotebookNode) -> str:
    """The digest of a notebook's code, cell by cell: what its saved outputs must come from."""
    code = [cell.source for cell in notebook.cells if cell.cell_type == "code"]
    return hashlib.sha256("\0".join(code).encode()).hexdigest()


def execute(path: Path, cwd: Path) -> nbformat.NotebookNode:
    """The notebook at ``path``, outputs cleared, run top to bottom in a fresh kernel in
    ``cwd``."""
    notebook = nbformat.read(path, as_version=4)
    for cell in notebook.cells:
        if cell.cell_type == "code":
            cell.outputs, cell.execution_count = [], None
    NotebookClient(
        notebook,
        timeout=120,
        kernel_name="python3",
        record_timing=False,
        resources={"metadata": {"path": str(cwd)}},
    ).execute()
    return notebook


def _outputs(notebook: nbformat.NotebookNode) -> list[nbformat.NotebookNode]:
    return [o for cell in notebook.cells for o in cell.get("outputs", [])]


def _text(notebook: nbformat.NotebookNode) -> str:
    return "".join(str(o.get("text", "")) + str(o.get("data", "")) for o in _outputs(notebook))


def _check_outputs(name: str, notebook: nbformat.NotebookNode, *folders: Path) -> None:
    """No error, every point of the notebook shown, no folder of this machine named."""
    errors = [o for o in _outputs(notebook) if o.get("output_type") == "error"]
    assert not errors, f"{name}: {errors}"
    text = _text(notebook)
    for shown in SHOWN[name]:
        assert shown in text, f"{name} does not show {shown!r}:\n{text}"
    named = MACHINE_PATHS.findall(text) + [str(f) for f in folders if str(f) in text]
    assert not named, f"{name}'s outputs name folders of this machine: {named}"


@pytest.mark.parametrize("path", NOTEBOOKS, ids=[p.name for p in NOTEBOOKS])
def test_the_notebook_runs_in_a_minute_and_leaves_nothing_behind(
    path: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    cwd, temp = tmp_path / "cwd", tmp_path / "tmp"
    cwd.mkdir()
    temp.mkdir()
    monkeypatch.setenv("TMPDIR", str(temp))  # the kernel's tempfile folders go here
    started = time.monotonic()
    notebook = execute(path, cwd)
    elapsed = time.monotonic() - started
    _check_outputs(path.name, notebook, tmp_path, ROOT, Path.home())
    assert elapsed < 60, f"{path.name} took {elapsed:.1f} s"
    assert not list(cwd.iterdir()), "files left in the notebook's folder"
    left = [p.name for p in temp.iterdir() if not p.name.startswith(("tmp", "ipykernel"))]
    assert not left, f"files left in the temporary folder: {left}"


@pytest.mark.parametrize("path", NOTEBOOKS, ids=[p.name for p in NOTEBOOKS])
def test_the_notebook_is_stored_with_the_outputs_of_its_code(path: Path) -> None:
    """Saved by one run top to bottom of the code it holds now: a cell changed since, and
    not run again, fails here (the outputs would no longer be that code's)."""
    notebook = nbformat.read(path, as_version=4)
    counts = [cell.execution_count for cell in notebook.cells if cell.cell_type == "code"]
    assert counts == list(range(1, len(counts) + 1)), (
        f"{path.name} was not saved from one run top to bottom ({counts}): {SAVE} {path.name}"
    )
    assert notebook.metadata.get(OUTPUTS_OF) == _digest(notebook), (
        f"{path.name}'s code changed since its outputs were saved: {SAVE} {path.name}"
    )
    _check_outputs(path.name, notebook, ROOT, Path.home(), Path(tempfile.gettempdir()))


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


def test_there_are_the_four_notebooks_and_getting_started_names_each() -> None:
    assert [p.name for p in NOTEBOOKS] == sorted(SHOWN)
    page = (ROOT / "docs" / "getting-started.md").read_text()
    assert not [p.name for p in NOTEBOOKS if p.name not in page]


def save_outputs(paths: list[Path]) -> None:
    """Run each notebook once in a fresh kernel (in a folder of its own) and save it with its
    outputs and the digest of the code they come from."""
    for path in paths:
        print(f"running {path.relative_to(ROOT)}", flush=True)
        with tempfile.TemporaryDirectory() as cwd:
            notebook = execute(path, Path(cwd))
        # The metadata as it was: the kernel's names this machine's Python version.
        notebook.metadata = nbformat.read(path, as_version=4).metadata
        notebook.metadata[OUTPUTS_OF] = _digest(notebook)
        nbformat.write(notebook, path)


if __name__ == "__main__":
    save_outputs([ROOT / "notebooks" / name for name in sys.argv[1:]] or NOTEBOOKS)

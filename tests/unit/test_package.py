"""The package's public names load on first use, and each is the one its module defines."""

from __future__ import annotations

import ast
import importlib
import pickle
import subprocess
import sys
from pathlib import Path

import langgraph_fence
from langgraph_fence import errors


def test_every_public_name_resolves_to_its_modules_object() -> None:
    assert set(langgraph_fence.__all__) == {*langgraph_fence._WHERE, "__version__"}
    for name, module in langgraph_fence._WHERE.items():
        defined = getattr(importlib.import_module(module, "langgraph_fence"), name)
        assert getattr(langgraph_fence, name) is defined, name
    assert set(langgraph_fence.__all__) <= set(dir(langgraph_fence))


def test_type_checkers_see_every_public_name() -> None:
    """The ``TYPE_CHECKING`` block names what ``_WHERE`` loads (else a type checker sees
    ``Any`` for a public name)."""
    tree = ast.parse(Path(langgraph_fence.__file__).read_text())
    block = next(
        n for n in tree.body if isinstance(n, ast.If) and "TYPE_CHECKING" in ast.unparse(n.test)
    )
    seen = {
        alias.asname or alias.name
        for node in block.body
        if isinstance(node, ast.ImportFrom)
        for alias in node.names
    }
    assert seen == set(langgraph_fence._WHERE)


def test_a_users_own_checkpointers_module_cannot_break_the_package(tmp_path: Path) -> None:
    """A project with a ``checkpointers.py`` of its own (found first on the script's path)
    opens an instance, and the earlier import name ``checkpointers`` (outside such a
    project) gives the very same classes."""
    (tmp_path / "checkpointers.py").write_text("raise ImportError('the user own module')\n")
    probe = (
        "import asyncio, langgraph_fence\n"
        "async def main():\n"
        "    async with langgraph_fence.Instance.open('sqlite+aiosqlite:///f.db') as i:\n"
        "        print(type(i.checkpointer).__name__)\n"
        "asyncio.run(main())\n"
    )
    done = subprocess.run(
        [sys.executable, "-c", probe], capture_output=True, text=True, cwd=tmp_path
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "FencedCheckpointer"

    import checkpointers
    import checkpointers.sql
    import langgraph_fence.checkpointers.sql as sql

    assert checkpointers.SqlCheckpointer is langgraph_fence.SqlCheckpointer
    assert checkpointers.sql is sql
    assert checkpointers.SqlStore is langgraph_fence.SqlStore


def test_importing_the_package_and_its_errors_loads_no_langgraph() -> None:
    probe = (
        "import sys, langgraph_fence, langgraph_fence.errors, langgraph_fence.lease\n"
        "print(sorted(m for m in sys.modules if m.split('.')[0] == 'langgraph'))\n"
    )
    done = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "[]"


def test_the_testing_tools_import_without_pytest() -> None:
    """Notebooks and scripts use open_leases and run_node with the notebooks extra only: the
    module needs pytest for its fixture alone."""
    probe = (
        "import sys\n"
        "class NoPytest:\n"
        "    def find_spec(self, name, path=None, target=None):\n"
        "        if name.split('.')[0] in ('pytest', '_pytest', 'pytest_asyncio'):\n"
        "            raise ImportError(f'No module named {name!r}')\n"
        "sys.meta_path.insert(0, NoPytest())\n"
        "from langgraph_fence.testing import *\n"
        "import langgraph_fence.testing as testing\n"
        "print(sorted(testing.__all__), hasattr(testing, 'leases'))\n"
    )
    done = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "['Leases', 'ManualClock', 'open_leases', 'run_node'] False"


def test_write_dead_lettered_error_is_one_class_that_pickles_and_bubbles_up() -> None:
    from langgraph.errors import GraphBubbleUp

    from langgraph_fence.errors import WriteDeadLetteredError

    assert errors.WriteDeadLetteredError is WriteDeadLetteredError
    assert issubclass(WriteDeadLetteredError, errors.ExecutionDeadLetteredError)
    assert issubclass(WriteDeadLetteredError, GraphBubbleUp)
    assert WriteDeadLetteredError.code == "execution.dead-lettered.write"
    assert WriteDeadLetteredError.__qualname__ == "WriteDeadLetteredError"
    again = pickle.loads(pickle.dumps(WriteDeadLetteredError("boom")))
    assert type(again) is WriteDeadLetteredError
    assert str(again) == "boom"

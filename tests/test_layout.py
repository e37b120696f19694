"""The test house's one rule of layout: no test module (nor a ``conftest.py``) imports
another module of ``tests``; what more than one of them uses lives in ``tests.support``.

Read with ``ast``, not imported: an import inside a function counts, as does a relative one.
"""

from __future__ import annotations

import ast
from pathlib import Path

TESTS = Path(__file__).resolve().parent
ROOT = TESTS.parent
SUPPORT = "tests.support"


def module_of(path: Path) -> str:
    return ".".join(path.relative_to(ROOT).with_suffix("").parts)


def _imported(node: ast.Import | ast.ImportFrom, module: str) -> list[str]:
    """The modules ``node`` imports: ``from a import b`` imports ``a``, or module ``a.b``."""
    if isinstance(node, ast.Import):
        return [alias.name for alias in node.names]
    base = node.module or ""
    if node.level:  # relative: from the package of ``module``
        package = module.split(".")[: -node.level]
        base = ".".join([*package, base] if base else package)
    named = [f"{base}.{alias.name}" for alias in node.names]
    # ``from tests import support`` imports tests.support, not the package's other modules.
    return named if base == "tests" else [base, *named]


def _forbidden(name: str) -> bool:
    inside = name == "tests" or name.startswith("tests.")
    support = name == SUPPORT or name.startswith(f"{SUPPORT}.")
    return inside and not support


def violations(source: str, module: str) -> list[tuple[int, list[str]]]:
    """``(line, modules)`` for each import in ``source`` (of module ``module``) of a module
    of ``tests`` that is not ``tests.support``."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import | ast.ImportFrom):
            bad = sorted({name for name in _imported(node, module) if _forbidden(name)})
            if bad:
                found.append((node.lineno, bad))
    return sorted(found)


def checked_files() -> list[Path]:
    """Every ``test_*.py`` and ``conftest.py`` under ``tests/`` (``tests/support`` holds
    neither)."""
    return sorted(
        path
        for path in TESTS.rglob("*.py")
        if path.name.startswith("test_") or path.name == "conftest.py"
    )


def test_no_test_module_imports_another() -> None:
    files = checked_files()
    assert len(files) > 100, f"the walk found only {len(files)} test modules"
    found = [
        f"{path.relative_to(ROOT)}:{line}: imports {', '.join(modules)}"
        for path in files
        for line, modules in violations(path.read_text(), module_of(path))
    ]
    assert not found, "import these from tests.support instead:\n" + "\n".join(found)


def test_support_holds_no_tests() -> None:
    support = TESTS / "support"
    assert support.is_dir()
    assert not [p.name for p in support.rglob("test_*.py")], "tests.support holds helpers only"


def test_the_rule_sees_every_form_of_import_and_lets_support_through() -> None:
    source = (
        "import tests.integration.test_serve\n"  # 1
        "from tests.integration.test_submit import cfg\n"  # 2
        "from tests.integration import test_hardening\n"  # 3
        "from . import test_admin\n"  # 4
        "def f():\n"
        "    from tests.chaos.test_chaos_serve import effects\n"  # 6
        "from tests import conftest\n"  # 7
        "from tests.support.serving import serving\n"
        "from tests import support\n"
        "import tests.support.polling\n"
        "from ..support import polling\n"
        "import langgraph_fence.testing\n"
    )
    found = violations(source, "tests.integration.test_sample")
    assert [line for line, _ in found] == [1, 2, 3, 4, 6, 7]
    assert found[3] == (4, ["tests.integration", "tests.integration.test_admin"])

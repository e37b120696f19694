"""The architecture page matches the code (issue 34): every package of ``langgraph_fence``
is in its table, every module it names exists where it says, and each guarantee of the
README is held by one package that exists."""

from __future__ import annotations

import re
from pathlib import Path

import langgraph_fence
from tests.support.pages import README, ROOT

PAGE = ROOT / "docs" / "architecture.md"
PACKAGE = Path(langgraph_fence.__file__).parent


def _table(title: str) -> list[list[str]]:
    """The rows of the first table under ``title``, each a list of its cells."""
    text = PAGE.read_text(encoding="utf-8")
    start = text.index(f"\n{title}\n")
    rows = []
    for line in text[start:].splitlines()[1:]:
        if line.startswith("|"):
            rows.append([cell.strip() for cell in line.strip("|").split("|")])
        elif rows:
            break
    return rows[2:]  # past the header and its rule


def _packages() -> dict[str, list[str]]:
    """The packages table: each package or top-level module, and the modules it names."""
    found = {}
    for _layer, package, _concept, modules in _table("## The packages, in their layers"):
        name = package.strip("`").removesuffix("/").removesuffix(".py")
        while re.search(r"\([^()]*\)", modules):  # what a module holds, in brackets
            modules = re.sub(r"\([^()]*\)", "", modules)
        found[name] = re.findall(r"`([a-z_]+/?)`", modules)
    return found


def _top_level() -> set[str]:
    return {
        path.stem if path.suffix == ".py" else path.name
        for path in PACKAGE.iterdir()
        if (path.suffix == ".py" or (path / "__init__.py").exists())
        and path.stem not in {"__init__", "__main__"}
    }


def test_every_package_and_edge_module_is_in_the_table() -> None:
    named = set(_packages()) - {"top-level modules"}
    packages = {name for name in _top_level() if (PACKAGE / name / "__init__.py").exists()}
    assert packages <= named, f"packages missing from {PAGE.name}: {sorted(packages - named)}"
    assert named <= _top_level(), f"{PAGE.name} names what is not there: {named - _top_level()}"


def test_every_module_the_table_names_is_in_its_package() -> None:
    missing = []
    for package, cells in _packages().items():
        if package == "top-level modules" or not (PACKAGE / package).is_dir():
            continue
        for cell in cells:
            module = cell.removesuffix("/")
            if not (
                (PACKAGE / package / f"{module}.py").exists()
                or (PACKAGE / package / module).is_dir()
            ):
                missing.append(f"{package}/{module}")
    assert missing == []


def test_every_module_path_the_page_names_exists() -> None:
    text = PAGE.read_text(encoding="utf-8")
    paths = set(re.findall(r"`((?:[a-z_]+/)+[a-z_]+\.py)`", text))
    missing = sorted(
        path for path in paths if not (PACKAGE / path).exists() and not (ROOT / path).exists()
    )
    assert missing == [], f"{PAGE.name} names files that do not exist: {missing}"


def test_each_guarantee_of_the_readme_is_held_by_one_package() -> None:
    readme = README.read_text(encoding="utf-8")
    start = readme.index("| Guarantee | Limit |")
    guarantees = [
        line.strip("|").split("|")[0].strip()
        for line in readme[start:].splitlines()[2:]
        if line.startswith("|")
    ]
    rows = _table("## Where each guarantee lives")
    assert len(rows) == len(guarantees), "one row per guarantee of the README"
    for guarantee, row in zip(guarantees, rows, strict=True):
        # The row opens with the README's sentence (up to its first stop, colon or bracket).
        opening = re.split(r"[.:(]", guarantee)[0].strip()
        assert row[0].startswith(opening), (row[0], guarantee)
        package = row[1].strip("`")
        assert re.fullmatch(r"[a-z_]+", package), f"one package, not {row[1]!r}"
        assert package in _top_level(), f"{package} is not a package of langgraph_fence"

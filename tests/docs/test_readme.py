"""The README a newcomer reads in five minutes (issue 34): under 10 KB, its two commands
(the demo, the tests) where .ci/newcomer and .ci/run find them, and no link that leads
nowhere, in the README or on any page of the docs site."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from tests.support.pages import PAGES, README, ROOT

LIMIT = 10 * 1024
#: A markdown link's target: [text](target), not an image's, not inside inline code.
_LINK = re.compile(r"(?<!!)\[[^\]]*\]\(([^)\s]+)\)")


def section(text: str, title: str) -> str:
    start = text.index(f"\n{title}\n")
    end = text.find("\n## ", start + 1)
    return text[start : end if end >= 0 else len(text)]


def test_the_readme_is_under_10_kb() -> None:
    size = len(README.read_bytes())
    assert size < LIMIT, f"README.md is {size} bytes: move a section to docs/ (limit {LIMIT})"


def test_the_readme_has_the_two_commands_and_ci_runs_the_test_one() -> None:
    commands = section(README.read_text(), "## Two commands")
    assert "langgraph-fence demo" in commands
    tests = re.search(r"(\.venv/bin/python -m pytest -n auto)\n", commands)
    assert tests is not None, "the README's test command is gone"
    assert tests.group(1) in (ROOT / ".ci" / "run").read_text(), ".ci/run must call it"


def _links(page: Path) -> list[str]:
    text = re.sub(r"^```.*?^```", "", page.read_text(encoding="utf-8"), flags=re.S | re.M)
    text = re.sub(r"`[^`\n]*`", "", text)  # inline code is not a link
    return _LINK.findall(text)


@pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(ROOT)))
def test_every_relative_link_resolves(page: Path) -> None:
    broken = []
    for target in _links(page):
        if re.match(r"[a-z][a-z0-9+.-]*:", target) or target.startswith("#"):
            continue  # a URL, or an anchor on the page itself
        path = target.split("#", 1)[0]
        if not (page.parent / path).exists():
            broken.append(target)
    assert not broken, f"{page.name} links to what does not exist: {broken}"

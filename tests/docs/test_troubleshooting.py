"""docs/troubleshooting.md names every error code (issue 34): a code set in the package
(``code: ClassVar[str] = "..."``) that the page does not have as a heading fails here."""

from __future__ import annotations

import re

from tests.support.pages import DOCS, ROOT

PAGE = DOCS / "troubleshooting.md"
_CODE = re.compile(r"""\bcode\s*(?::\s*ClassVar\[str\])?\s*=\s*["']([\w.-]+)["']""")


def codes_in_the_package() -> set[str]:
    found: set[str] = set()
    for package in ("langgraph_fence", "checkpointers"):
        for path in (ROOT / package).rglob("*.py"):
            found.update(_CODE.findall(path.read_text(encoding="utf-8")))
    return found


def test_the_package_has_codes() -> None:
    assert {"execution.lease-lost.fenced", "execution.dead-lettered.write"} <= (
        codes_in_the_package()
    )


def test_every_error_code_has_its_section() -> None:
    headings = set(re.findall(r"^### `([\w.-]+)`$", PAGE.read_text(), re.M))
    missing = sorted(codes_in_the_package() - headings)
    assert not missing, f"docs/troubleshooting.md has no section for {missing}"
    stale = sorted(headings - codes_in_the_package())
    assert not stale, f"docs/troubleshooting.md has a section for a code that is gone: {stale}"

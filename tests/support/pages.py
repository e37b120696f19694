"""The documentation as the tests read it: README.md and the pages of the docs site, and
the fenced Python blocks in them.

A block is a complete program unless the line before it (blank lines aside) is the marker
``<!-- fragment -->`` (optionally ``<!-- fragment: why -->``): a fragment is compiled, a
program is run.
"""

from __future__ import annotations

import re
import textwrap
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
README = ROOT / "README.md"
DOCS = ROOT / "docs"
#: What the tests read: the README, then every page of the site.
PAGES = [README, *sorted(DOCS.glob("*.md"))]

_BLOCK = re.compile(
    r"^(?P<indent>[ \t]*)```python\n(?P<body>.*?)^(?P=indent)```[ \t]*$", re.S | re.M
)
_FRAGMENT = re.compile(r"<!--\s*fragment\b[^>]*-->")


@dataclass(frozen=True)
class Block:
    """A fenced Python block: where it is, its code (dedented), and whether it is a fragment."""

    page: Path
    line: int
    code: str
    fragment: bool

    @property
    def name(self) -> str:
        return f"{self.page.relative_to(ROOT)}:{self.line}"


def python_blocks(page: Path) -> list[Block]:
    """Every ```python block of ``page``, in order."""
    text = page.read_text(encoding="utf-8")
    blocks = []
    for found in _BLOCK.finditer(text):
        before = text[: found.start()].rstrip().rsplit("\n", 1)[-1]
        blocks.append(
            Block(
                page=page,
                line=text.count("\n", 0, found.start()) + 1,
                code=textwrap.dedent(found.group("body")),
                fragment=bool(_FRAGMENT.fullmatch(before.strip())),
            )
        )
    return blocks


def all_blocks() -> list[Block]:
    return [block for page in PAGES for block in python_blocks(page)]

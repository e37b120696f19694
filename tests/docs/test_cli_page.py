"""docs/cli.md has a section for every command of ``langgraph-fence`` (issue 34): a command
added to langgraph_fence/cli/_parser.py without one fails here."""

from __future__ import annotations

import re

from tests.support.pages import DOCS, ROOT

CLI = ROOT / "langgraph_fence" / "cli" / "_parser.py"
PAGE = DOCS / "cli.md"


def test_every_command_has_a_section() -> None:
    commands = set(re.findall(r"\bcommand\(\s*\"([\w-]+)\"", CLI.read_text()))
    assert {"demo", "worker", "submit", "resolve"} <= commands
    headings = " ".join(re.findall(r"^## (.+)$", PAGE.read_text(), re.M))
    missing = sorted(c for c in commands if not re.search(rf"(?<![\w-]){c}(?![\w-])", headings))
    assert not missing, f"docs/cli.md has no section for {missing}"

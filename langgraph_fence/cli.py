"""The ``langgraph-fence`` command."""

from __future__ import annotations


def main(argv: list[str] | None = None) -> int:
    """Entry point of the ``langgraph-fence`` console script."""
    raise SystemExit("langgraph-fence: the CLI is not built yet")

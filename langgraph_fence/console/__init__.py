"""The operator's console: a web page of executions, tokens and dead letters, and
``/metrics`` for Prometheus (``pip install 'langgraph-fence[ui]'``).

``langgraph-fence ui --db URL`` serves it; :func:`create_app` returns it as an ASGI app to
mount in your own (Starlette, FastAPI) or in LangGraph's Agent Server (``http.app`` in
``langgraph.json``). It reads the same tables every instance writes: any number of
workers, one page. Read-only unless an operator token (or the host app's ``authorize``)
lets an operator retry or abandon a dead letter; binds to loopback by default; every
value a tenant controls is shown as text. See ``docs/console.md``.
"""

from __future__ import annotations

try:
    import jinja2  # noqa: F401
    import prometheus_client  # noqa: F401
    import starlette  # noqa: F401
except ImportError as exc:  # pragma: no cover - exercised by a bare install
    raise ImportError(
        f"langgraph_fence.console needs {exc.name}: pip install 'langgraph-fence[ui]'"
    ) from exc

from langgraph_fence.console._app import Authorize, CanRead, Console, create_app, metrics_app
from langgraph_fence.console._metrics import CONTENT_TYPE, LocalFigures, exposition

__all__ = [
    "CONTENT_TYPE",
    "Authorize",
    "CanRead",
    "Console",
    "LocalFigures",
    "create_app",
    "exposition",
    "metrics_app",
]

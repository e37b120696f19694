"""Fenced runs on LangGraph's Agent Server (``langgraph dev``, self-hosted deployments).

Name :func:`checkpointer` (and :func:`store`) in ``langgraph.json``::

    {
      "dependencies": ["."],
      "graphs": {"agent": "./agent.py:graph"},
      "checkpointer": {"path": "langgraph_fence.server.checkpointer"},
      "store": {"path": "langgraph_fence.server.store"}
    }

and set ``LANGGRAPH_FENCE_URL`` (the database of the leases and checkpoints) in the server's
environment. Every run the server starts on a thread then runs as an instance's run: it takes
the thread's lease before anything of it is written, every checkpoint and task write carries
the lease's token, and the lease is released with the run's outcome.

Configured by environment variables, read when the server first enters the factory:

``LANGGRAPH_FENCE_URL`` (required)
    ``sqlite+aiosqlite:///path.db`` or ``postgresql+asyncpg://...``.
``LANGGRAPH_FENCE_SCHEMA``
    PostgreSQL only: the schema of every table.
``LANGGRAPH_FENCE_LEASE_TTL``
    Seconds a run's lease lasts between renewals (the instance's default otherwise).
``LANGGRAPH_FENCE_TENANT``
    The tenant of a run whose config names none (``configurable["tenant_id"]``).

The server enters the factory once per thread that asks for its checkpointer; each event
loop gets one instance, shared by every entry on that loop and closed with the last.

Refused at start (``RuntimeError`` naming the versions supported) on a langgraph-api
release this version was not tested with: the server's run attempts are read from the
config it passes, and another release may pass them differently.
"""

from __future__ import annotations

import asyncio
import os
from collections.abc import AsyncIterator
from contextlib import AsyncExitStack, asynccontextmanager
from dataclasses import dataclass
from typing import Any

from langgraph_fence.instance import Instance

__all__ = ["SUPPORTED_API", "check_api_version", "checkpointer", "settings_from_env", "store"]

#: The langgraph-api releases (major.minor) the server mode is tested with.
SUPPORTED_API = ("0.16",)

ENV_URL = "LANGGRAPH_FENCE_URL"
ENV_SCHEMA = "LANGGRAPH_FENCE_SCHEMA"
ENV_TTL = "LANGGRAPH_FENCE_LEASE_TTL"
ENV_TENANT = "LANGGRAPH_FENCE_TENANT"


def settings_from_env(environ: Any = None) -> tuple[str, dict[str, Any]]:
    """The database URL and the :meth:`Instance.open` options the environment sets.

    Raises:
        ValueError: ``LANGGRAPH_FENCE_URL`` is not set, or ``LANGGRAPH_FENCE_LEASE_TTL`` is
            not a number; the message names the variable and the fix.
    """
    env = os.environ if environ is None else environ
    url = env.get(ENV_URL, "").strip()
    if not url:
        raise ValueError(
            f"{ENV_URL} is not set: set it in the server's environment (or the .env file "
            "langgraph.json names) to the database of the leases and checkpoints, e.g. "
            f"{ENV_URL}=sqlite+aiosqlite:///fence.db"
        )
    options: dict[str, Any] = {}
    if env.get(ENV_SCHEMA):
        options["schema"] = env[ENV_SCHEMA]
    if env.get(ENV_TTL):
        try:
            options["lease_ttl"] = float(env[ENV_TTL])
        except ValueError:
            raise ValueError(
                f"{ENV_TTL} must be a number of seconds, got {env[ENV_TTL]!r}"
            ) from None
    if env.get(ENV_TENANT):
        options["tenant_id"] = env[ENV_TENANT]
    return url, options


def check_api_version(version: str | None = None) -> str:
    """The running langgraph-api's version, if this release supports it.

    Raises:
        RuntimeError: langgraph-api is not installed, or its release is not one of
            :data:`SUPPORTED_API`; the message names the versions supported.
    """
    if version is None:
        try:
            import langgraph_api  # type: ignore[import-untyped]
        except ImportError:
            raise RuntimeError(
                "langgraph_fence.server is the checkpointer factory of LangGraph's Agent "
                "Server, and langgraph-api is not installed: run it under `langgraph dev` "
                "or a deployment, or open an Instance yourself (Instance.open)"
            ) from None
        version = str(langgraph_api.__version__)
    release = ".".join(version.split(".")[:2])
    if release not in SUPPORTED_API:
        raise RuntimeError(
            f"langgraph-api {version} is not supported by this langgraph-fence: runs would "
            f"not be fenced as documented. Supported: langgraph-api "
            f"{', '.join(r + '.x' for r in SUPPORTED_API)}; pin one of them, or upgrade "
            "langgraph-fence"
        )
    return version


@dataclass
class _Shared:
    instance: Instance
    stack: AsyncExitStack
    users: int = 0


_by_loop: dict[asyncio.AbstractEventLoop, _Shared] = {}
_opening: dict[asyncio.AbstractEventLoop, asyncio.Lock] = {}


@asynccontextmanager
async def _instance() -> AsyncIterator[Instance]:
    """This event loop's instance, opened from the environment by its first user and closed
    with its last: the checkpointer and the store factories share it (one lease table, one
    engine)."""
    check_api_version()
    loop = asyncio.get_running_loop()
    async with _opening.setdefault(loop, asyncio.Lock()):  # two first entries open one
        shared = _by_loop.get(loop)
        if shared is None:
            url, options = settings_from_env()
            stack = AsyncExitStack()
            instance = await stack.enter_async_context(Instance.open(url, **options))
            shared = _by_loop[loop] = _Shared(instance, stack)
        shared.users += 1
    try:
        yield shared.instance
    finally:
        shared.users -= 1
        if shared.users == 0 and _by_loop.get(loop) is shared:
            del _by_loop[loop]
            await shared.stack.aclose()


@asynccontextmanager
async def checkpointer() -> AsyncIterator[Any]:
    """The checkpointer factory of ``langgraph.json`` (``"checkpointer": {"path":
    "langgraph_fence.server.checkpointer"}``): yields the fenced checkpointer of this event
    loop's instance, opened from the environment (module docstring).

    Every server run on a graph mounted with it runs fenced: one lease per thread, taken
    before the run writes, every checkpoint and task write checked against it in its own
    statement, released with the run's outcome; an attempt the server re-dispatches
    supersedes the one before it. A write made outside such a run is refused, never
    stored unfenced.

    Raises:
        RuntimeError: an unsupported langgraph-api release.
        ValueError: a missing or malformed environment variable.
    """
    async with _instance() as instance:
        yield instance.checkpointer


@asynccontextmanager
async def store() -> AsyncIterator[Any]:
    """The store factory of ``langgraph.json`` (``"store": {"path":
    "langgraph_fence.server.store"}``): yields the fenced store of this event loop's
    instance (the one the checkpointer factory uses), on the same database.

    A store write made inside a fenced step of a server run is made under the run's token
    and refused under a superseded one (checked in the write's own statement). Writes from
    outside any step (the server's ``/store`` endpoints) pass through unfenced, as from an
    admin script.

    Raises:
        RuntimeError: an unsupported langgraph-api release.
        ValueError: a missing or malformed environment variable.
    """
    async with _instance() as instance:
        yield instance.store

"""Serving the console (or a worker's ``/metrics``) with uvicorn, on the caller's loop."""

from __future__ import annotations

import asyncio
import socket
from typing import Any

__all__ = ["bind", "serve_until"]


def bind(host: str, port: int, *, option: str) -> socket.socket:
    """A listening socket on ``host``:``port``; ``ValueError`` naming ``option`` (the
    command-line option that chose it) when the address cannot be had."""
    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
    except socket.gaierror as exc:
        raise ValueError(f"{option}: cannot resolve host {host!r} ({exc.strerror})") from None
    family, kind, proto, _, address = infos[0]
    sock = socket.socket(family, kind, proto)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind(address)
        sock.listen(128)
    except OSError as exc:
        sock.close()
        raise ValueError(
            f"{option}: cannot listen on {host}:{port} ({exc.strerror}); choose another port"
        ) from None
    sock.setblocking(False)
    return sock


async def serve_until(app: Any, sock: socket.socket, stop: asyncio.Event) -> None:
    """Serve ``app`` on ``sock`` until ``stop`` is set; leaves signals to the caller."""
    import uvicorn

    config = uvicorn.Config(app, lifespan="off", log_level="warning", access_log=False)
    config.load()
    server = uvicorn.Server(config)
    # What Server.serve() does before its start-up, without its signal handlers: the
    # caller's stop event (a worker's SIGTERM drain) decides when it ends.
    server.lifespan = config.lifespan_class(config)
    await server.startup(sockets=[sock])
    try:
        await stop.wait()
    finally:
        server.should_exit = True
        await server.shutdown()
        sock.close()

"""Serving a small aiohttp app on a port of its own (the admission server, the control channel).

:func:`serve_app` binds the listening socket itself, so the port the OS picked for port ``0`` is
read from the socket (not from aiohttp's private server object), and returns the runner to
clean up.
"""

from __future__ import annotations

import socket
from typing import Any

from aiohttp import web

__all__ = ["serve_app"]


async def serve_app(
    app: web.Application,
    host: str,
    port: int,
    *,
    handler_cancellation: bool,
    **runner_options: Any,
) -> tuple[web.AppRunner, int]:
    """Serve ``app`` on ``host:port`` (``0``: a free port); return ``(runner, port)``.

    ``handler_cancellation``: whether a caller that disconnects cancels its handler at once.
    ``runner_options`` go to :class:`aiohttp.web.AppRunner` (e.g. ``keepalive_timeout``).
    Call ``await runner.cleanup()`` to stop. Raises ``OSError`` if the port cannot be bound.
    """
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((host, port))
        sock.setblocking(False)
    except BaseException:
        sock.close()
        raise
    runner = web.AppRunner(
        app,
        access_log=None,
        handle_signals=False,
        handler_cancellation=handler_cancellation,
        **runner_options,
    )
    try:
        await runner.setup()
        await web.SockSite(runner, sock).start()
    except BaseException:
        await runner.cleanup()
        sock.close()
        raise
    return runner, int(sock.getsockname()[1])

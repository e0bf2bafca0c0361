"""Serving an app on a port of its own: :func:`serve_app` (a small aiohttp app on the caller's
loop: the admission server, the control channel) and :class:`ThreadServer` (an ASGI app served
by uvicorn on a thread of its own: a role gateway, the registry server)."""

from __future__ import annotations

import socket
import threading
import time
from typing import Any, Self

from aiohttp import web

from relax_core.net import free_port


def bound_socket(host: str, port: int, *, reuse_port: bool = False) -> socket.socket:
    """A TCP socket bound to ``(host, port)`` (``0``: a free port) with ``SO_REUSEADDR``, and
    ``SO_REUSEPORT`` when ``reuse_port``; not listening yet. Raises ``OSError`` if it cannot
    be bound."""
    sock = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET, socket.SOCK_STREAM)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        if reuse_port:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
        sock.bind((host, port))
    except BaseException:
        sock.close()
        raise
    return sock


def uvicorn_config(app: Any, host: str, port: int, **options: Any) -> Any:
    """A uvicorn config for a gateway: uvloop and httptools when installed, quiet access log."""
    import uvicorn

    quiet = {"log_level": "warning", "access_log": False, "timeout_keep_alive": 30}
    options = {**quiet, "proxy_headers": False, **options}  # a gateway on loopback/cluster network
    return uvicorn.Config(app, host=host, port=port, loop="auto", http="auto", **options)


class ThreadServer:
    """``app`` served by uvicorn on a thread of this process (``port`` ``None``: a free one)."""

    def __init__(self, app: Any, host: str = "127.0.0.1", port: int | None = None) -> None:
        import uvicorn

        self.host = host
        self.port: int = port or free_port(host)
        self._server = uvicorn.Server(uvicorn_config(app, host, self.port))
        self._thread: threading.Thread | None = None

    @property
    def url(self) -> str:
        """``http://host:port``."""
        return f"http://{self.host}:{self.port}"

    def start(self, timeout: float = 30.0) -> Self:
        """Start serving; raise ``RuntimeError`` if it does not come up within ``timeout``."""
        self._thread = threading.Thread(
            target=self._server.run, name=f"http-{self.port}", daemon=True
        )
        self._thread.start()
        deadline = time.monotonic() + timeout
        while not self._server.started:
            if not self._thread.is_alive() or time.monotonic() > deadline:
                self.stop()
                raise RuntimeError(
                    f"the server on {self.host}:{self.port} did not start (is the port free?)"
                )
            time.sleep(0.02)
        return self

    def stop(self, timeout: float = 15.0) -> None:
        """Stop serving and wait for the server thread. Idempotent."""
        self._server.should_exit = True
        if self._thread is not None:
            self._thread.join(timeout=timeout)
            self._thread = None


async def serve_app(
    app: web.Application, host: str, port: int, *, handler_cancellation: bool, **runner_options: Any
) -> tuple[web.AppRunner, int]:
    """Serve ``app`` on ``host:port`` (``0``: a free port); ``(runner, port)``, stopped by
    ``await runner.cleanup()``. ``runner_options`` go to ``aiohttp.web.AppRunner``. Raises
    ``OSError`` if the port cannot be bound."""
    sock = bound_socket(host, port)
    sock.setblocking(False)
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

"""One role gateway served by several processes that share its port (``SO_REUSEPORT``).

A gateway is one Python event loop, so it forwards with at most one core. With ``workers=N``
(:class:`~relax_core.gateway_app.GatewayServer`) N processes each run the same app on the same
host and port: every worker binds its own listening socket with ``SO_REUSEPORT`` and the kernel
spreads incoming connections over them. Each worker builds its own app by calling the
``app_factory`` it is given, so each has its own client, connection pool and snapshot cache;
discovery must therefore work from another process (a registry URL, see
:func:`registry_gateway_app`, or a provider that can be pickled and called anywhere).

The parent holds the port (bound, never listening, so it never takes a connection) while the
workers run. A worker stops when the parent asks or when the parent goes away (its pipe to the
parent closes), so no worker outlives the process that started it.
"""

from __future__ import annotations

import contextlib
import multiprocessing
import socket
import threading
import time
from collections.abc import Callable, Mapping
from multiprocessing.connection import Connection
from typing import Any

__all__ = ["AppFactory", "WorkerPool", "registry_gateway_app", "reuseport_socket"]

#: A picklable callable (module-level function or ``functools.partial`` of one) returning the
#: ASGI app a worker serves; it is called once in each worker process.
AppFactory = Callable[[], Any]


def reuseport_socket(host: str, port: int) -> socket.socket:
    """A TCP socket bound to ``(host, port)`` with ``SO_REUSEADDR`` and ``SO_REUSEPORT`` set.

    ``port`` 0 lets the kernel choose (read it with ``getsockname()``). Not listening yet.
    :raises RuntimeError: this platform has no ``SO_REUSEPORT``.
    """
    if not hasattr(socket, "SO_REUSEPORT"):
        raise RuntimeError(
            "workers > 1 needs SO_REUSEPORT, which this platform lacks; run one worker"
        )
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
        sock.bind((host, port))
    except BaseException:
        sock.close()
        raise
    return sock


def _serve_worker(
    factory: AppFactory,
    host: str,
    port: int,
    options: Mapping[str, Any],
    conn: Connection,
) -> None:
    """A worker process: serve ``factory()`` on its own SO_REUSEPORT socket until told to stop."""
    import asyncio

    import uvicorn

    from relax_core.gateway_app import uvicorn_config

    sock = reuseport_socket(host, port)
    sock.listen(int(options.get("backlog", 2048)))
    server = uvicorn.Server(uvicorn_config(factory(), host, port, **options))

    def watch_parent() -> None:
        # Any message, or the parent going away (EOF), stops the worker.
        with contextlib.suppress(EOFError, OSError):
            conn.recv()
        server.should_exit = True

    async def serve() -> None:
        task = asyncio.ensure_future(server.serve(sockets=[sock]))
        while not server.started and not task.done():
            await asyncio.sleep(0.01)
        if server.started:
            conn.send("ready")
            threading.Thread(target=watch_parent, name="parent-watch", daemon=True).start()
        await task

    with asyncio.Runner(loop_factory=server.config.get_loop_factory()) as runner:
        runner.run(serve())


class WorkerPool:
    """``workers`` processes serving ``app_factory()`` on one port; see the module docstring.

    ``port`` ``None`` or 0: a free port, chosen once for all workers. ``options``: passed to
    :func:`~relax_core.gateway_app.uvicorn_config` in each worker. :meth:`start` blocks until
    every worker accepts connections (or raises); :meth:`stop` is idempotent.
    """

    def __init__(
        self,
        app_factory: AppFactory,
        host: str = "127.0.0.1",
        port: int | None = None,
        *,
        workers: int = 2,
        **options: Any,
    ) -> None:
        if workers < 1:
            raise ValueError(f"workers={workers!r}: give at least 1")
        self.app_factory = app_factory
        self.host = host
        self.workers = workers
        self.options = options
        # Holding the port: bound with SO_REUSEPORT but never listening, so the kernel never
        # hands it a connection, while no process outside the group can take the port.
        self._holder = reuseport_socket(host, port or 0)
        self.port: int = self._holder.getsockname()[1]
        self._procs: list[Any] = []
        self._conns: list[Connection] = []

    @property
    def pids(self) -> list[int]:
        """The worker processes' ids."""
        return [p.pid for p in self._procs if p.pid is not None]

    def start(self, timeout: float = 60.0) -> WorkerPool:
        """Start the workers; raise ``RuntimeError`` naming the one that failed to come up."""
        ctx = multiprocessing.get_context("spawn")
        for i in range(self.workers):
            parent, child = ctx.Pipe()
            proc = ctx.Process(
                target=_serve_worker,
                args=(self.app_factory, self.host, self.port, self.options, child),
                name=f"gateway-{self.port}-worker-{i}",
                daemon=True,
            )
            proc.start()
            child.close()
            self._procs.append(proc)
            self._conns.append(parent)
        deadline = time.monotonic() + timeout
        for i, (proc, conn) in enumerate(zip(self._procs, self._conns, strict=True)):
            ready = False
            while not ready:
                left = deadline - time.monotonic()
                try:
                    ready = conn.poll(min(max(left, 0.0), 0.2)) and conn.recv() == "ready"
                except (EOFError, OSError):
                    break
                if not ready and (not proc.is_alive() or left <= 0):
                    break
            if not ready:
                proc.join(min(5.0, max(deadline - time.monotonic(), 0.5)))
                code = proc.exitcode
                self.stop()
                where = f"gateway worker {i} of {self.workers} on {self.host}:{self.port}"
                if code is not None:
                    raise RuntimeError(
                        f"{where} exited with code {code} before it accepted connections; its "
                        "error is in the log above (a failing app_factory, or the port is taken)"
                    )
                raise RuntimeError(f"{where} did not start within {timeout:.0f}s")
        return self

    def stop(self, timeout: float = 15.0) -> None:
        """Ask every worker to stop, wait for them (killing stragglers), free the port."""
        for conn in self._conns:
            with contextlib.suppress(OSError):
                conn.send("stop")
        deadline = time.monotonic() + timeout
        for proc in self._procs:
            proc.join(max(0.0, deadline - time.monotonic()))
            if proc.is_alive():
                proc.kill()
                proc.join(5)
        for conn in self._conns:
            conn.close()
        self._procs, self._conns = [], []
        self._holder.close()


def registry_gateway_app(
    role: str,
    registry_url: str,
    *,
    token: str | None = None,
    timeout: float = 300.0,
    snapshot_ttl: float = 0.5,
    model_paths: Mapping[str, str] | None = None,
    stream_idle_timeout: float | None = 60.0,
    stream_first_chunk_timeout: float | None = None,
    stream_coalesce: float | None = None,
    max_body_bytes: int | None = None,
) -> Any:
    """The app of ``role``'s gateway reading the role's snapshot from ``registry_url``.

    ``registry_url`` serves ``GET {registry_url}/engines?schema=2`` (a role gateway's
    ``http://host:port/{role}``, or a registry server). The role's adapter comes from the
    plugins installed in this process. Meant as an :data:`AppFactory` for workers::

        GatewayServer(app_factory=functools.partial(registry_gateway_app, "genrm", url),
                      port=8100, workers=2)
    """
    from relax_core.client import InferenceClient
    from relax_core.gateway import (
        DEFAULT_MAX_BODY_BYTES,
        DEFAULT_STREAM_COALESCE_S,
        InferenceGatewayHandler,
        adapter_for_role,
    )
    from relax_core.gateway_app import create_gateway_app
    from relax_core.plugins import PluginManager

    client = InferenceClient(registry_url, role=role, ttl=snapshot_ttl, timeout=timeout)
    handler = InferenceGatewayHandler(
        role,
        client=client,
        adapter=adapter_for_role(PluginManager.create(), role),
        model_paths=model_paths,
        timeout=timeout,
        token=token,
        max_body_bytes=max_body_bytes or DEFAULT_MAX_BODY_BYTES,
        stream_idle_timeout=stream_idle_timeout,
        stream_first_chunk_timeout=stream_first_chunk_timeout,
        stream_coalesce=DEFAULT_STREAM_COALESCE_S if stream_coalesce is None else stream_coalesce,
    )
    return create_gateway_app(handler)

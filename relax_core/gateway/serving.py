"""Serving a role gateway: uvicorn on a thread, ``SO_REUSEPORT`` worker processes (each building
its app from a picklable factory), or a CPU-only Ray actor; every way builds :func:`gateway_app`
(docs/gateway.md)."""

from __future__ import annotations

import contextlib
import multiprocessing
import os
import socket
import threading
import time
from collections.abc import Callable, Mapping
from multiprocessing.connection import Connection
from typing import Any

import attrs

from relax_core._http.server import ThreadServer, bound_socket, uvicorn_config
from relax_core.discovery.schema import RoleSnapshot
from relax_core.errors import LifecycleError
from relax_core.gateway.app import create_gateway_app
from relax_core.gateway.handler import GatewayOptions, Waker, build_gateway_handler
from relax_core.plugins import PluginManager

#: A picklable callable (module-level function or ``functools.partial`` of one) returning the
#: ASGI app a worker serves; it is called once in each worker process.
AppFactory = Callable[[], Any]


def _serve_worker(
    factory: AppFactory, host: str, port: int, options: Mapping[str, Any], conn: Connection
) -> None:
    """A worker process: serve ``factory()`` on its own SO_REUSEPORT socket until told to stop."""
    import asyncio

    import uvicorn

    sock = bound_socket(host, port, reuse_port=True)
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
    :func:`~relax_core.gateway.app.uvicorn_config` in each worker. :meth:`start` blocks until
    every worker accepts connections (or raises); :meth:`stop` is idempotent."""

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
        if not hasattr(socket, "SO_REUSEPORT"):
            raise RuntimeError(
                "workers > 1 needs SO_REUSEPORT, which this platform lacks; run one worker"
            )
        self.app_factory = app_factory
        self.host = host
        self.workers = workers
        self.options = options
        # Holding the port: bound with SO_REUSEPORT but never listening, so the kernel never
        # hands it a connection, while no process outside the group can take the port.
        self._holder = bound_socket(host, port or 0, reuse_port=True)
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


def gateway_app(
    role: str,
    discovery: str | Callable[[], RoleSnapshot],
    *,
    plugin_manager: PluginManager,
    options: GatewayOptions | None = None,
    waker: Waker | None = None,
) -> Any:
    """The Starlette app of ``role``'s gateway (arguments: see
    :func:`~relax_core.gateway.handler.build_gateway_handler`)."""
    handler = build_gateway_handler(
        role, discovery, plugin_manager=plugin_manager, options=options, waker=waker
    )
    return create_gateway_app(handler, spec=plugin_manager.role(role))


def registry_gateway_app(
    role: str, registry_url: str, options: GatewayOptions | None = None
) -> Any:
    """The app of ``role``'s gateway reading the role's snapshot from ``registry_url``.

    An :data:`AppFactory` for another process (a worker, the Ray actor): it loads that
    process's own plugin manager (``PluginManager.create()``). ``registry_url`` serves
    ``GET {registry_url}/engines?schema=2``. ::

        GatewayServer(app_factory=functools.partial(registry_gateway_app, "genrm", url, options),
                      port=8100, workers=2)
    """
    return gateway_app(role, registry_url, plugin_manager=PluginManager.create(), options=options)


class GatewayServer:
    """A role gateway served by uvicorn: on a thread of this process, or by worker processes.

    ``workers=1`` (the default): ``app`` (or ``app_factory()``) is served on its own thread in
    this process. ``workers=N > 1``: a :class:`WorkerPool` (``app_factory`` must be picklable).
    :meth:`start` blocks until it accepts connections (or raises); :meth:`stop` is idempotent."""

    def __init__(
        self,
        app: Any = None,
        host: str = "127.0.0.1",
        port: int | None = None,
        *,
        workers: int = 1,
        app_factory: Any = None,
    ) -> None:
        if (app is None) == (app_factory is None):
            raise ValueError("GatewayServer: give exactly one of app and app_factory")
        if workers < 1:
            raise ValueError(f"workers={workers!r}: give at least 1")
        if workers > 1 and app_factory is None:
            raise ValueError(
                f"workers={workers}: each worker process builds its own app, so give "
                "app_factory= (a picklable callable returning the app, e.g. functools.partial("
                "relax_core.gateway.serving.registry_gateway_app, role, registry_url)) instead "
                "of an app object"
            )
        self.host = host
        self.workers = workers
        self._server = (
            WorkerPool(app_factory, host, port, workers=workers)
            if workers > 1
            else ThreadServer(app if app is not None else app_factory(), host, port)
        )
        self.port: int = self._server.port

    @property
    def url(self) -> str:
        """``http://host:port``."""
        return f"http://{self.host}:{self.port}"

    @property
    def pids(self) -> list[int]:
        """The processes serving the gateway (this one, or the workers)."""
        return self._server.pids if isinstance(self._server, WorkerPool) else [os.getpid()]

    def start(self, timeout: float = 30.0) -> GatewayServer:
        """Start serving; raise ``RuntimeError`` if it does not come up within ``timeout``
        (at least 60 s for worker processes)."""
        self._server.start(max(timeout, 60.0) if self.workers > 1 else timeout)
        return self

    def stop(self, timeout: float = 15.0) -> None:
        """Stop serving and wait for the server thread (or the worker processes)."""
        self._server.stop(timeout)


@attrs.define
class RunningGateway:
    """A role gateway that is serving (``mode``: ``thread`` or ``ray-actor``; ``pid``: its
    process)."""

    role: str
    url: str
    mode: str
    pid: int
    _stop: Callable[[], None] = attrs.field(repr=False)
    _stopped: bool = attrs.field(default=False, repr=False)

    def stop(self) -> None:
        """Stop serving (and end the actor, if any). Idempotent."""
        if not self._stopped:
            self._stopped = True
            self._stop()


def start_thread_gateway(
    role: str,
    snapshot_provider: Callable[[], RoleSnapshot],
    *,
    plugin_manager: PluginManager,
    host: str = "127.0.0.1",
    port: int | None = None,
    options: GatewayOptions | None = None,
    waker: Waker | None = None,
) -> RunningGateway:
    """Serve ``role``'s gateway on a thread of this process; blocks until it accepts.

    :raises RuntimeError: uvicorn did not come up (the port is taken)."""
    app = gateway_app(
        role, snapshot_provider, plugin_manager=plugin_manager, options=options, waker=waker
    )
    server = GatewayServer(app, host, port).start()
    return RunningGateway(role, server.url, "thread", os.getpid(), server.stop)


class GatewayActor:
    """The body of the gateway actor: builds the app (:func:`registry_gateway_app`) and serves
    it with uvicorn in its own Ray worker process."""

    def __init__(
        self, role: str, registry_url: str, host: str, port: int | None, options: GatewayOptions
    ) -> None:
        app = registry_gateway_app(role, registry_url, options)
        self._server = GatewayServer(app, host, port).start()

    def address(self) -> tuple[str, int]:
        """``(url, pid)`` of the gateway this actor serves."""
        return self._server.url, os.getpid()

    def stop(self) -> None:
        """Stop uvicorn (the actor is killed afterwards)."""
        self._server.stop()


def start_actor_gateway(
    role: str,
    registry_url: str,
    *,
    host: str = "127.0.0.1",
    port: int | None = None,
    options: GatewayOptions | None = None,
    timeout: float = 120.0,
) -> RunningGateway:
    """Serve ``role``'s gateway in a CPU-only Ray actor on this node; blocks until it accepts.

    ``registry_url`` is where the actor discovers the role (``{registry}/{role}``, serving
    ``/engines?schema=2``). Needs a connected Ray.

    :raises LifecycleError: the actor did not come up within ``timeout`` (its error says why)."""
    import ray
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    node = ray.get_runtime_context().get_node_id()
    actor_class: Any = ray.remote(num_cpus=0, num_gpus=0, max_restarts=0)(GatewayActor)
    actor: Any = actor_class.options(
        name=None, scheduling_strategy=NodeAffinitySchedulingStrategy(node_id=node, soft=False)
    ).remote(role, registry_url, host, port, options or GatewayOptions())
    try:
        url, pid = ray.get(actor.address.remote(), timeout=timeout)
    except Exception as exc:
        ray.kill(actor, no_restart=True)
        raise LifecycleError(
            f"the {role} gateway actor did not start within {timeout:.0f}s: "
            f"{type(exc).__name__}: {exc}"
        ) from exc

    def stop() -> None:
        try:
            ray.get(actor.stop.remote(), timeout=30)
        finally:
            ray.kill(actor, no_restart=True)

    return RunningGateway(role, url, "ray-actor", int(pid), stop)

"""Pytest fixtures and helpers for testing Relax and its plugins.

Loaded automatically as a pytest plugin (entry point ``pytest11``). Fixtures:

- ``plugin_manager``: a fresh :class:`~relax_core.plugins.PluginManager` with the core's
  built-ins and every installed ``relax`` entry point; never the process-wide one.
- ``core_plugin_manager``: a fresh manager with the core's built-ins only.
- ``ray_local``: one local Ray per test session with fake GPUs declared (``num_gpus=8``).

Helpers: :func:`free_port`, :func:`serve_app` (a real uvicorn server on a free loopback port).
"""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

import pytest

from relax_core.net import free_port, keep_local_ray_on_loopback
from relax_core.plugins import PluginManager

__all__ = [
    "core_plugin_manager",
    "free_port",
    "plugin_manager",
    "ray_local",
    "serve_app",
    "wait_for",
]


def wait_for(
    predicate: Callable[[], bool], *, timeout: float, what: str, interval: float = 0.02
) -> None:
    """Poll ``predicate`` until true; raise ``TimeoutError`` naming ``what`` after ``timeout``."""
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            raise TimeoutError(f"timed out after {timeout:.1f}s waiting for {what}")
        time.sleep(interval)


@contextlib.contextmanager
def serve_app(
    app: Any, *, host: str = "127.0.0.1", timeout: float = 20.0, **config: Any
) -> Iterator[str]:
    """Serve an ASGI app with a real uvicorn server in a thread; yield its base URL.

    The server is stopped (and its thread joined) when the block ends.
    """
    import uvicorn

    port = free_port(host)
    cfg = uvicorn.Config(app, host=host, port=port, log_level="warning", lifespan="auto", **config)
    server = uvicorn.Server(cfg)
    thread = threading.Thread(target=server.run, name=f"uvicorn-{port}", daemon=True)
    thread.start()
    try:
        wait_for(
            lambda: server.started or not thread.is_alive(),
            timeout=timeout,
            what=f"uvicorn on {port}",
        )
        if not server.started:
            raise RuntimeError(f"uvicorn on {host}:{port} exited before it started")
        yield f"http://{host}:{port}"
    finally:
        server.should_exit = True
        thread.join(timeout=timeout)


@pytest.fixture
def plugin_manager() -> PluginManager:
    """A fresh plugin manager with built-ins and installed entry points."""
    return PluginManager.create()


@pytest.fixture
def core_plugin_manager() -> PluginManager:
    """A fresh plugin manager with the core's built-ins only (no entry points)."""
    return PluginManager.create(entry_points=False)


@pytest.fixture(scope="session")
def ray_local() -> Iterator[Any]:
    """One local Ray per test session, 8 fake GPUs declared; shut down at session end."""
    keep_local_ray_on_loopback()
    import ray

    if not ray.is_initialized():
        ray.init(
            # A new local Ray: a bare init would attach to any cluster another process started.
            address="local",
            num_cpus=8,
            num_gpus=8,
            include_dashboard=False,
            log_to_driver=False,
            configure_logging=False,
        )
    try:
        yield ray
    finally:
        ray.shutdown()

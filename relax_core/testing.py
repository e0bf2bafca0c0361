"""Pytest fixtures (``plugin_manager``, ``core_plugin_manager``, ``ray_local``; defined only
where pytest is installed) and helpers (:func:`free_port`, :func:`serve_app`, :func:`wait_for`,
:func:`run_stages`) for testing Relax and its plugins (a ``pytest11`` entry point)."""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any

from relax_core.net import free_port, keep_local_ray_on_loopback
from relax_core.plugins import PluginManager

try:
    import pytest
except ModuleNotFoundError as exc:  # the helpers work without it; the fixtures need it
    if exc.name != "pytest":
        raise
    pytest = None  # type: ignore[assignment]

__all__ = ["free_port", "run_stages", "serve_app", "wait_for"]


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

    The server is stopped (and its thread joined) when the block ends."""
    import uvicorn

    port = free_port(host)
    cfg = uvicorn.Config(app, host=host, port=port, log_level="warning", lifespan="auto", **config)
    server = uvicorn.Server(cfg)
    thread = threading.Thread(target=server.run, name=f"uvicorn-{port}", daemon=True)
    thread.start()
    try:
        what = f"uvicorn on {port}"
        wait_for(lambda: server.started or not thread.is_alive(), timeout=timeout, what=what)
        if not server.started:
            raise RuntimeError(f"uvicorn on {host}:{port} exited before it started")
        yield f"http://{host}:{port}"
    finally:
        server.should_exit = True
        thread.join(timeout=timeout)


if pytest is not None:
    __all__ += ["core_plugin_manager", "plugin_manager", "ray_local"]

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
                address="local",  # a bare init would attach to a cluster another process started
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


# -- stages ----------------------------------------------------------------------------------


class _ConfirmingManager:
    """An in-process stand-in for a model's manager: every onload and offload is confirmed at
    once for one replica, and recorded (stage logic is what is under test, not engines)."""

    def __init__(self, name: str, log: list[str]) -> None:
        self.name = name
        self.log = log

    async def _switch(self, operation: str, state: str) -> Any:
        from relax_core.manager.results import LifecycleResult, Outcome, ReplicaResult

        self.log.append(f"{self.name}.{operation}")
        replica = ReplicaResult(f"{self.name}/replica-0", Outcome.DONE, state)
        return LifecycleResult(operation, self.name, (replica,))

    async def onload(self) -> Any:
        return await self._switch("onload", "READY")

    async def offload(self) -> Any:
        return await self._switch("offload", "SLEEPING")

    async def weight_version(self) -> str | None:
        return None


async def run_stages(
    samples: Sequence[Any],
    stages: Sequence[Any],
    *,
    roles: Mapping[str, Sequence[str]] | None = None,
    producer: Any = None,
    target_groups: int | None = None,
    clients: Any = None,
    batch_id: int = 0,
    residency: Any = None,
    generation_role: str = "generation",
) -> tuple[Any, list[Any], list[str]]:
    """Run ``stages`` on ``samples`` in a real :class:`~relax_core.DeferredBatch` under a real
    :class:`~relax_core.LifecycleCoordinator` (every role on one slice with ``generation_role``),
    with an in-process sink and managers that confirm every lease switch at once; return
    ``(BatchResult, the committed samples, the switches in order)``, e.g.
    ``["generation.offload", "judge.model.onload", "judge.model.offload"]``.

    ``roles``: deferred role -> its models (default: each stage's role, one model ``model``);
    ``producer`` and ``clients``: as the batch takes them; ``residency``: a ``ResidencyPlan``
    over the slice ``shared`` (default: one role at a time). Raises what the batch raises."""
    from relax_core.coordination import DeferredBatch, LifecycleCoordinator, MemoryBatchSink

    log: list[str] = []
    wanted = dict(roles or {})
    for stage in stages:
        if stage.role is not None and stage.role not in wanted and stage.role != generation_role:
            wanted[stage.role] = list(stage.models) or ["model"]
    managers = {
        role: [_ConfirmingManager(f"{role}.{m}", log) for m in models]
        for role, models in wanted.items()
    }
    coordinator = LifecycleCoordinator(
        slices={generation_role: "shared", **dict.fromkeys(managers, "shared")},
        managers=managers,
        generation_role=generation_role,
        residency=residency,
    )
    sink = MemoryBatchSink()
    await coordinator.begin_batch(batch_id)
    batch = DeferredBatch(
        batch_id,
        samples,
        coordinator=coordinator,
        rollout=_ConfirmingManager(generation_role, log),
        stages=stages,
        sink=sink,
        clients=clients,
        producer=producer,
        target_groups=target_groups,
    )
    result = await batch.run()
    return result, await sink.get(result.receipt.partition), log

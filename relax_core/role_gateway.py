"""How ``relax serve`` runs a role's gateway: in a thread of its own process, or in a Ray actor.

Both serve the same Starlette app (:func:`~relax_core.gateway_app.create_gateway_app`) with
uvicorn; they differ in where the process is and where discovery comes from:

- :func:`start_thread_gateway`: uvicorn on a thread of the serving process; the handler reads
  the role service's snapshot in process.
- :func:`start_actor_gateway`: uvicorn inside a CPU-only Ray actor (``num_gpus=0``,
  ``num_cpus=0``, like Ray Serve's HTTP proxies) pinned to the serving process's node, so the
  gateway's event loop never shares a GIL with the managers. Discovery is over HTTP: the
  serving process runs a :class:`RegistryServer` on loopback that serves every role's schema-2
  snapshot at ``/{role}/engines``, and the actor's :class:`~relax_core.client.InferenceClient`
  reads it (cached for ``snapshot_ttl`` seconds). If the registry goes away the gateway stays
  up and answers 503 ("registry unavailable"), as the failure table says.

Each returns a :class:`RunningGateway`: its URL, the pid of the process serving it, and
``stop()`` (idempotent; an actor is also killed).
"""

from __future__ import annotations

import os
from collections.abc import Callable, Mapping
from typing import Any

import attrs

from relax_core.errors import LifecycleError
from relax_core.schema import RoleSnapshot

__all__ = [
    "GatewayActor",
    "RegistryServer",
    "RunningGateway",
    "registry_app",
    "start_actor_gateway",
    "start_thread_gateway",
]


@attrs.define
class RunningGateway:
    """A role gateway that is serving.

    ``mode`` is ``thread`` or ``ray-actor``; ``pid`` the process that serves it.
    """

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


def _handler(role: str, *, plugin_manager: Any, **options: Any) -> Any:
    from relax_core.gateway import InferenceGatewayHandler, adapter_for_role

    return InferenceGatewayHandler(role, adapter=adapter_for_role(plugin_manager, role), **options)


def start_thread_gateway(
    role: str,
    snapshot_provider: Callable[[], RoleSnapshot],
    *,
    plugin_manager: Any,
    host: str = "127.0.0.1",
    port: int | None = None,
    model_paths: Mapping[str, str] | None = None,
    token: str | None = None,
) -> RunningGateway:
    """Serve ``role``'s gateway on a thread of this process; blocks until it accepts.

    :raises RuntimeError: uvicorn did not come up (the port is taken).
    """
    from relax_core.gateway_app import GatewayServer, create_gateway_app

    handler = _handler(
        role,
        plugin_manager=plugin_manager,
        snapshot_provider=snapshot_provider,
        model_paths=model_paths,
        token=token,
    )
    server = GatewayServer(create_gateway_app(handler), host, port).start()
    return RunningGateway(role, server.url, "thread", os.getpid(), server.stop)


class GatewayActor:
    """The body of the gateway actor: builds the handler and serves it with uvicorn.

    Runs in its own Ray worker process; the plugins are loaded there (the role's adapter).
    """

    def __init__(
        self,
        role: str,
        registry_url: str,
        host: str,
        port: int | None,
        model_paths: Mapping[str, str],
        token: str | None,
        snapshot_ttl: float,
    ) -> None:
        from relax_core.client import InferenceClient
        from relax_core.gateway_app import GatewayServer, create_gateway_app
        from relax_core.plugins import PluginManager

        pm = PluginManager.create()
        client = InferenceClient(registry_url, role=role, ttl=snapshot_ttl, weight_sources=pm)
        handler = _handler(
            role, plugin_manager=pm, client=client, model_paths=model_paths, token=token
        )
        self._server = GatewayServer(create_gateway_app(handler), host, port).start()

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
    model_paths: Mapping[str, str] | None = None,
    token: str | None = None,
    snapshot_ttl: float = 0.5,
    timeout: float = 120.0,
) -> RunningGateway:
    """Serve ``role``'s gateway in a CPU-only Ray actor on this node; blocks until it accepts.

    ``registry_url`` is where the actor discovers the role (``{registry}/{role}``, serving
    ``/engines?schema=2``). Needs a connected Ray.

    :raises LifecycleError: the actor did not come up within ``timeout`` (its error says why).
    """
    import ray
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    node = ray.get_runtime_context().get_node_id()
    actor_class: Any = ray.remote(num_cpus=0, num_gpus=0, max_restarts=0)(GatewayActor)
    actor: Any = actor_class.options(
        name=None,
        scheduling_strategy=NodeAffinitySchedulingStrategy(node_id=node, soft=False),
    ).remote(role, registry_url, host, port, dict(model_paths or {}), token, snapshot_ttl)
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


def registry_app(providers: Mapping[str, Callable[[], RoleSnapshot]]) -> Any:
    """A Starlette app serving each role's snapshot at ``GET /{role}/engines`` (schema 2;
    ``?schema=1`` for the filtered diagnostic view). Unknown roles are 404."""
    from starlette.applications import Starlette
    from starlette.requests import Request
    from starlette.responses import JSONResponse, Response
    from starlette.routing import Route

    async def engines(request: Request) -> Response:
        role = request.path_params["role"]
        provider = providers.get(role)
        if provider is None:
            return JSONResponse(
                {"error": f"no role {role!r} here; roles: {sorted(providers)}"}, status_code=404
            )
        snap = provider()
        schema1 = request.query_params.get("schema") == "1"
        return JSONResponse(snap.schema1() if schema1 else snap.to_json())

    return Starlette(routes=[Route("/{role}/engines", engines, methods=["GET"])])


class RegistryServer:
    """The serving process's registry: every role's snapshot over HTTP, on loopback.

    Gateways in Ray actors discover their role here (``{url}/{role}``).
    """

    def __init__(self, providers: Mapping[str, Callable[[], RoleSnapshot]]) -> None:
        from relax_core.gateway_app import GatewayServer

        self._server = GatewayServer(registry_app(providers), "127.0.0.1")

    @property
    def url(self) -> str:
        """``http://127.0.0.1:port``; a role's registry base URL is ``{url}/{role}``."""
        return str(self._server.url)

    def start(self) -> RegistryServer:
        """Start serving; blocks until it accepts."""
        self._server.start()
        return self

    def stop(self) -> None:
        """Stop serving. Idempotent."""
        self._server.stop()

"""The registry server: every role's schema-2 snapshot over HTTP on loopback, at
``{url}/{role}/engines``, for gateways in other processes."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

from relax_core._http.server import ThreadServer
from relax_core.discovery.schema import RoleSnapshot


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


class RegistryServer(ThreadServer):
    """The serving process's registry (see the module docstring), on a free port of
    ``127.0.0.1``: a role's registry base URL is ``{url}/{role}``. :meth:`start` blocks until it
    accepts; :meth:`stop` is idempotent."""

    def __init__(self, providers: Mapping[str, Callable[[], RoleSnapshot]]) -> None:
        super().__init__(registry_app(providers), "127.0.0.1")

"""The role gateway: request handling, the Starlette app, serving it, role adapters, OpenAPI
and metrics."""

from relax_core.gateway.adapters import AdaptContext, Adapted, InvalidRequestError, RoleAdapter
from relax_core.gateway.app import create_gateway_app
from relax_core.gateway.handler import InferenceGatewayHandler
from relax_core.gateway.serving import GatewayServer

__all__ = [
    "AdaptContext",
    "Adapted",
    "GatewayServer",
    "InferenceGatewayHandler",
    "InvalidRequestError",
    "RoleAdapter",
    "create_gateway_app",
]

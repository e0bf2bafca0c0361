"""The role gateway: request handling, the Starlette app, serving it, role adapters, OpenAPI
and metrics."""

from relax_core._exports import claim as _claim
from relax_core.gateway import adapters
from relax_core.gateway.adapters import *  # noqa: F403
from relax_core.gateway.app import create_gateway_app
from relax_core.gateway.handler import (
    GatewayOptions,
    InferenceGatewayHandler,
    build_gateway_handler,
)
from relax_core.gateway.serving import GatewayServer, gateway_app

__all__ = [
    "GatewayOptions",
    "GatewayServer",
    "InferenceGatewayHandler",
    "build_gateway_handler",
    "create_gateway_app",
    "gateway_app",
]

__all__ += adapters.__all__

_claim(__name__, globals(), __all__)

"""The role gateway: request handling, the Starlette app, serving it, role adapters, OpenAPI
and metrics."""

from relax_core._exports import claim as _claim
from relax_core.gateway.adapters import (
    AdaptContext,
    Adapted,
    RoleAdapter,
    check_chat_payload,
    check_generate_payload,
    check_messages,
)
from relax_core.gateway.app import create_gateway_app
from relax_core.gateway.handler import (
    GatewayOptions,
    InferenceGatewayHandler,
    build_gateway_handler,
)
from relax_core.gateway.serving import GatewayServer, gateway_app

__all__ = [
    "AdaptContext",
    "Adapted",
    "GatewayOptions",
    "GatewayServer",
    "InferenceGatewayHandler",
    "RoleAdapter",
    "build_gateway_handler",
    "check_chat_payload",
    "check_generate_payload",
    "check_messages",
    "create_gateway_app",
    "gateway_app",
]

_claim(__name__, globals(), __all__)

"""Discovery: schema 2 (the routing snapshot of a role), its publisher, the registry server,
the route resolver and the DIRECT routing policies."""

from relax_core._exports import claim as _claim
from relax_core.discovery.publisher import RegistryPublisher
from relax_core.discovery.routing import RouteResolver, RouteTarget
from relax_core.discovery.schema import EngineView, ModelState, ModelView, RoleSnapshot, RoutingSpec
from relax_core.discovery.server import RegistryServer
from relax_core.records import RouteMode

__all__ = [
    "EngineView",
    "ModelState",
    "ModelView",
    "RegistryPublisher",
    "RegistryServer",
    "RoleSnapshot",
    "RouteMode",
    "RouteResolver",
    "RouteTarget",
    "RoutingSpec",
]

_claim(__name__, globals(), __all__)

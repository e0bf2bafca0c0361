"""Relax: the inference side of LLM RL post-training — one core for rollout, genrm and teacher."""

from relax_core.errors import (
    CapabilityError,
    ConfigError,
    InferenceRecoveryRequired,
    LifecycleError,
    PlacementError,
    PluginError,
    RelaxError,
    RequestNotReplayedError,
    RoutingError,
    SnapshotError,
    UpstreamError,
)
from relax_core.hookspecs import hookimpl
from relax_core.plugins import PluginManager, get_plugin_manager
from relax_core.records import (
    EngineBackend,
    EngineLaunchSpec,
    EngineProcess,
    PlacementMode,
    RewardSpec,
    RoleSpec,
    RoutingPolicy,
    WeightSource,
)
from relax_core.registry import RegistryPublisher
from relax_core.routing import RouteResolver, RouteTarget
from relax_core.schema import (
    EngineState,
    EngineView,
    ModelState,
    ModelView,
    RoleSnapshot,
    RouteMode,
    RoutingSpec,
)

__version__ = "0.1.0"

__all__ = [
    "CapabilityError",
    "ConfigError",
    "EngineBackend",
    "EngineLaunchSpec",
    "EngineProcess",
    "EngineState",
    "EngineView",
    "InferenceRecoveryRequired",
    "LifecycleError",
    "ModelState",
    "ModelView",
    "PlacementError",
    "PlacementMode",
    "PluginError",
    "PluginManager",
    "RegistryPublisher",
    "RelaxError",
    "RequestNotReplayedError",
    "RewardSpec",
    "RoleSnapshot",
    "RoleSpec",
    "RouteMode",
    "RouteResolver",
    "RouteTarget",
    "RoutingError",
    "RoutingPolicy",
    "RoutingSpec",
    "SnapshotError",
    "UpstreamError",
    "WeightSource",
    "__version__",
    "get_plugin_manager",
    "hookimpl",
]

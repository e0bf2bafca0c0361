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

__version__ = "0.1.0"

__all__ = [
    "CapabilityError",
    "ConfigError",
    "EngineBackend",
    "EngineLaunchSpec",
    "EngineProcess",
    "InferenceRecoveryRequired",
    "LifecycleError",
    "PlacementError",
    "PlacementMode",
    "PluginError",
    "PluginManager",
    "RelaxError",
    "RequestNotReplayedError",
    "RewardSpec",
    "RoleSpec",
    "RoutingError",
    "RoutingPolicy",
    "SnapshotError",
    "UpstreamError",
    "WeightSource",
    "__version__",
    "get_plugin_manager",
    "hookimpl",
]

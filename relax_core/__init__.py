"""Relax: the inference side of LLM RL post-training — one core for rollout, genrm and teacher."""

from relax_core._http.upstream import UpstreamStatusError, UpstreamUnreachableError
from relax_core.client.client import InferenceClient
from relax_core.client.pool import close_clients, get_client
from relax_core.config import JobConfig, load_config
from relax_core.discovery.publisher import RegistryPublisher
from relax_core.discovery.routing import RouteResolver, RouteTarget
from relax_core.discovery.schema import (
    EngineState,
    EngineView,
    ModelState,
    ModelView,
    RoleSnapshot,
    RouteMode,
    RoutingSpec,
)
from relax_core.engine.admission import AdmissionServer
from relax_core.engine.spec import InferenceEngineSpec
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
from relax_core.manager import (
    InferenceManager,
    LifecycleResult,
    ManagerTimeouts,
    ModelLaunch,
    ReplicaPlacement,
    ReplicaState,
    ResidentTag,
)
from relax_core.placement import (
    InferencePlacementPlan,
    ModelPlacement,
    plan_inference_placement,
    validate_bound_placement,
)
from relax_core.plugins import PluginManager, get_plugin_manager
from relax_core.records import (
    EngineBackend,
    EngineLaunchSpec,
    EngineProcess,
    PlacementMode,
    RewardSpec,
    RoleSpec,
    RouterBackend,
    RouterLaunchSpec,
    RouterMembership,
    RouterProcess,
    RoutingPolicy,
    WeightSource,
)

__version__ = "0.1.0"

__all__ = [
    "AdmissionServer",
    "CapabilityError",
    "ConfigError",
    "EngineBackend",
    "EngineLaunchSpec",
    "EngineProcess",
    "EngineState",
    "EngineView",
    "InferenceClient",
    "InferenceEngineSpec",
    "InferenceManager",
    "InferencePlacementPlan",
    "InferenceRecoveryRequired",
    "JobConfig",
    "LifecycleError",
    "LifecycleResult",
    "ManagerTimeouts",
    "ModelLaunch",
    "ModelPlacement",
    "ModelState",
    "ModelView",
    "PlacementError",
    "PlacementMode",
    "PluginError",
    "PluginManager",
    "RegistryPublisher",
    "RelaxError",
    "ReplicaPlacement",
    "ReplicaState",
    "RequestNotReplayedError",
    "ResidentTag",
    "RewardSpec",
    "RoleSnapshot",
    "RoleSpec",
    "RouteMode",
    "RouteResolver",
    "RouteTarget",
    "RouterBackend",
    "RouterLaunchSpec",
    "RouterMembership",
    "RouterProcess",
    "RoutingError",
    "RoutingPolicy",
    "RoutingSpec",
    "SnapshotError",
    "UpstreamError",
    "UpstreamStatusError",
    "UpstreamUnreachableError",
    "WeightSource",
    "__version__",
    "close_clients",
    "get_client",
    "get_plugin_manager",
    "hookimpl",
    "load_config",
    "plan_inference_placement",
    "validate_bound_placement",
]

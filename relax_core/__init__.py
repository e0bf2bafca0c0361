"""Relax: the inference side of LLM RL post-training — one core for rollout, genrm and teacher.

This module is the public API: everything a caller or a plugin needs is exported here (and
``relax_core.testing`` holds the pytest fixtures and helpers for plugins' tests). The packages
below it (``relax_core.discovery``, ``.client``, ``.gateway``, ``.engine``, ``.manager``,
``.placement``) export more for readers of the core; modules not exported are private.
"""

from relax_core._exports import claim as _claim
from relax_core.client import InferenceClient, close_clients, get_client
from relax_core.config import JobConfig, load_config
from relax_core.discovery import (
    EngineView,
    ModelState,
    ModelView,
    RegistryPublisher,
    RoleSnapshot,
    RouteResolver,
    RouteTarget,
    RoutingSpec,
)
from relax_core.engine import (
    AdmissionServer,
    ControlClient,
    InferenceEngineSpec,
    SubprocessEngineProcess,
    serialize_named_tensors,
)
from relax_core.errors import (
    CapabilityError,
    ChannelError,
    ConfigError,
    ConfigValidationError,
    GatewayError,
    InferenceRecoveryRequired,
    InvalidRequestError,
    LifecycleError,
    NotApplicable,
    PlacementError,
    PluginError,
    RelaxError,
    RequestNotReplayedError,
    RoutingError,
    SnapshotError,
    StreamStalledError,
    UpstreamError,
    UpstreamStatusError,
    UpstreamUnreachableError,
)
from relax_core.gateway import (
    AdaptContext,
    Adapted,
    GatewayOptions,
    InferenceGatewayHandler,
    RoleAdapter,
    check_chat_payload,
    check_generate_payload,
    check_messages,
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
from relax_core.net import free_port
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
    OpenAPINotes,
    PlacementMode,
    RewardSpec,
    RoleSpec,
    RouteMode,
    RoutingPolicy,
    WeightSource,
)

__version__ = "0.1.0"

__all__ = [
    "AdaptContext",
    "Adapted",
    "AdmissionServer",
    "CapabilityError",
    "ChannelError",
    "ConfigError",
    "ConfigValidationError",
    "ControlClient",
    "EngineBackend",
    "EngineLaunchSpec",
    "EngineProcess",
    "EngineView",
    "GatewayError",
    "GatewayOptions",
    "InferenceClient",
    "InferenceEngineSpec",
    "InferenceGatewayHandler",
    "InferenceManager",
    "InferencePlacementPlan",
    "InferenceRecoveryRequired",
    "InvalidRequestError",
    "JobConfig",
    "LifecycleError",
    "LifecycleResult",
    "ManagerTimeouts",
    "ModelLaunch",
    "ModelPlacement",
    "ModelState",
    "ModelView",
    "NotApplicable",
    "OpenAPINotes",
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
    "RoleAdapter",
    "RoleSnapshot",
    "RoleSpec",
    "RouteMode",
    "RouteResolver",
    "RouteTarget",
    "RoutingError",
    "RoutingPolicy",
    "RoutingSpec",
    "SnapshotError",
    "StreamStalledError",
    "SubprocessEngineProcess",
    "UpstreamError",
    "UpstreamStatusError",
    "UpstreamUnreachableError",
    "WeightSource",
    "__version__",
    "check_chat_payload",
    "check_generate_payload",
    "check_messages",
    "close_clients",
    "free_port",
    "get_client",
    "get_plugin_manager",
    "hookimpl",
    "load_config",
    "plan_inference_placement",
    "serialize_named_tensors",
    "validate_bound_placement",
]

_claim(__name__, globals(), __all__)

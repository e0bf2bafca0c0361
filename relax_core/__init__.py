"""Relax: the inference side of LLM RL post-training — one core for rollout, genrm and teacher.

The public API: everything a caller or a plugin needs is exported here (and pytest helpers in
``relax_core.testing``); subpackages export more for the core's readers, other modules are
private."""

from relax_core import client, engine, errors, records
from relax_core._concurrent import gather_all
from relax_core._exports import claim as _claim
from relax_core._quote import quote_body
from relax_core.cli import main
from relax_core.client import *  # noqa: F403
from relax_core.config import ConfigReader, JobConfig, load_config, loads_config
from relax_core.coordination import (
    REWARD_FIELDS,
    BatchControl,
    BatchSink,
    Coordinator,
    DeferredBatch,
    DeferredCollector,
    DeferredWorkload,
    LeaseState,
    LifecycleCoordinator,
    ManagerHandle,
    MemoryBatchSink,
    MoreGroups,
    RewardContext,
    RewardResult,
    RewardStage,
    RoleClients,
    Sample,
    SampleField,
    SinkReceipt,
    Stage,
    StageContext,
    StageReport,
    Timeline,
    connect_coordinator,
    partition_name,
    start_coordinator,
    validate_samples,
)
from relax_core.coordination.residency import ResidencyPlan
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
from relax_core.engine import *  # noqa: F403
from relax_core.errors import *  # noqa: F403
from relax_core.errors import ConfigProblem
from relax_core.gateway import (
    AdaptContext,
    Adapted,
    GatewayOptions,
    GatewayServer,
    InferenceGatewayHandler,
    RoleAdapter,
    check_chat_payload,
    check_generate_payload,
    check_messages,
    gateway_app,
)
from relax_core.gateway.handler import DEFAULT_STREAM_COALESCE_S
from relax_core.hookspecs import hookimpl
from relax_core.jobs.managers import engine_launch_specs
from relax_core.manager import (
    InferenceManager,
    LifecycleResult,
    ManagerTimeouts,
    ModelLaunch,
    Outcome,
    ReplicaPlacement,
    ReplicaResult,
    ReplicaState,
    ResidentTag,
)
from relax_core.net import free_port, keep_local_ray_on_loopback
from relax_core.placement import (
    InferencePlacementPlan,
    ModeContext,
    ModelPlacement,
    ModeResult,
    PoolRequest,
    Slice,
    plan_inference_placement,
    preflight,
    validate_bound_placement,
)
from relax_core.plugins import PluginManager, get_plugin_manager, module_plugin
from relax_core.records import *  # noqa: F403
from relax_core.run import (
    GroupRequest,
    Prompt,
    PromptSource,
    RolloutShape,
    RolloutShapeConfig,
    RunConfig,
    SourceRequest,
    StageConfig,
    Trainer,
    TrainerContext,
    build_stages,
    parse_run_config,
    stage_problems,
)
from relax_core.run.driver import DriverSettings, StepDriver, StepOutcome
from relax_core.run.rollout import (
    TurnAnswer,
    add_segments,
    boundaries,
    continue_aborted,
    parse_answer,
    sampling_seed,
)
from relax_core.tracking import (
    ROLLOUT_METRICS,
    PhaseSpan,
    Tracker,
    TrackerContext,
    reward_by_key,
    rollout_metrics,
    sample_rows,
    step_metrics,
)

__version__ = "0.1.0"

__all__ = [
    "DEFAULT_STREAM_COALESCE_S",
    "REWARD_FIELDS",
    "ROLLOUT_METRICS",
    "AdaptContext",
    "Adapted",
    "BatchControl",
    "BatchSink",
    "ConfigProblem",
    "ConfigReader",
    "Coordinator",
    "DeferredBatch",
    "DeferredCollector",
    "DeferredWorkload",
    "DriverSettings",
    "EngineView",
    "GatewayOptions",
    "GatewayServer",
    "GroupRequest",
    "InferenceGatewayHandler",
    "InferenceManager",
    "InferencePlacementPlan",
    "JobConfig",
    "LeaseState",
    "LifecycleCoordinator",
    "LifecycleResult",
    "ManagerHandle",
    "ManagerTimeouts",
    "MemoryBatchSink",
    "ModeContext",
    "ModeResult",
    "ModelLaunch",
    "ModelPlacement",
    "ModelState",
    "ModelView",
    "MoreGroups",
    "Outcome",
    "PhaseSpan",
    "PluginManager",
    "PoolRequest",
    "Prompt",
    "PromptSource",
    "RegistryPublisher",
    "ReplicaPlacement",
    "ReplicaResult",
    "ReplicaState",
    "ResidencyPlan",
    "ResidentTag",
    "RewardContext",
    "RewardResult",
    "RewardStage",
    "RoleAdapter",
    "RoleClients",
    "RoleSnapshot",
    "RolloutShape",
    "RolloutShapeConfig",
    "RouteResolver",
    "RouteTarget",
    "RoutingSpec",
    "RunConfig",
    "Sample",
    "SampleField",
    "SinkReceipt",
    "Slice",
    "SourceRequest",
    "Stage",
    "StageConfig",
    "StageContext",
    "StageReport",
    "StepDriver",
    "StepOutcome",
    "Timeline",
    "Tracker",
    "TrackerContext",
    "Trainer",
    "TrainerContext",
    "TurnAnswer",
    "__version__",
    "add_segments",
    "boundaries",
    "build_stages",
    "check_chat_payload",
    "check_generate_payload",
    "check_messages",
    "connect_coordinator",
    "continue_aborted",
    "engine_launch_specs",
    "free_port",
    "gateway_app",
    "gather_all",
    "get_plugin_manager",
    "hookimpl",
    "keep_local_ray_on_loopback",
    "load_config",
    "loads_config",
    "main",
    "module_plugin",
    "parse_answer",
    "parse_run_config",
    "partition_name",
    "plan_inference_placement",
    "preflight",
    "quote_body",
    "reward_by_key",
    "rollout_metrics",
    "sample_rows",
    "sampling_seed",
    "stage_problems",
    "start_coordinator",
    "step_metrics",
    "validate_bound_placement",
    "validate_samples",
]

# The star-imported modules' names, listed once in their own __all__.
__all__ += client.__all__ + engine.__all__ + errors.__all__ + records.__all__

_claim(__name__, globals(), __all__)

"""Deferred scoring on shared GPUs: the LifecycleCoordinator, DeferredBatch, batch sinks, the
reward and distillation stages, the defer preflight and the batch timeline.

See ``docs/coordination.md`` for the two state machines, the sequence of a step and every
failure.
"""

from relax_core._exports import claim as _claim
from relax_core.coordination.batch import (
    DEFAULT_MAX_SAMPLES,
    BatchResult,
    DeferredBatch,
    DeferredCollector,
    abort_generation,
    release_generation,
)
from relax_core.coordination.coordinator import (
    COMMITTED_HISTORY,
    DEFAULT_OPERATION_TIMEOUT,
    RETIRED_HISTORY,
    CoordinatorStatus,
    LateReply,
    LifecycleCoordinator,
    RunFailure,
)
from relax_core.coordination.distill import (
    DistillationStage,
    PrefillResult,
    parse_prefill,
    prefill_payload,
)
from relax_core.coordination.handles import (
    LocalManagerHandle,
    ManagerHandle,
    RayManagerHandle,
    unconfirmed,
)
from relax_core.coordination.preflight import (
    DeferredWorkload,
    deferred_workload_problems,
    validate_deferred_workload,
)
from relax_core.coordination.remote import (
    NAMESPACE,
    CoordinatorActor,
    RemoteCoordinator,
    connect_coordinator,
    coordinator_name,
    start_coordinator,
)
from relax_core.coordination.rewards import RewardContext, RewardResult, RewardStage
from relax_core.coordination.sample import SCORED_FIELDS, Sample
from relax_core.coordination.sink import (
    BatchSink,
    MemoryBatchSink,
    RayBatchSink,
    SinkReceipt,
    partition_name,
)
from relax_core.coordination.slices import defer_slices
from relax_core.coordination.stages import (
    PHASES,
    RoleClients,
    Stage,
    StageContext,
    StageReport,
    check_stages,
)
from relax_core.coordination.states import BatchState, LeaseState
from relax_core.coordination.timeline import PHASE_HISTOGRAM, Timeline
from relax_core.coordination.validation import check_samples, validate_samples

__all__ = [
    "COMMITTED_HISTORY",
    "DEFAULT_MAX_SAMPLES",
    "DEFAULT_OPERATION_TIMEOUT",
    "NAMESPACE",
    "PHASES",
    "PHASE_HISTOGRAM",
    "RETIRED_HISTORY",
    "SCORED_FIELDS",
    "BatchResult",
    "BatchSink",
    "BatchState",
    "CoordinatorActor",
    "CoordinatorStatus",
    "DeferredBatch",
    "DeferredCollector",
    "DeferredWorkload",
    "DistillationStage",
    "LateReply",
    "LeaseState",
    "LifecycleCoordinator",
    "LocalManagerHandle",
    "ManagerHandle",
    "MemoryBatchSink",
    "PrefillResult",
    "RayBatchSink",
    "RayManagerHandle",
    "RemoteCoordinator",
    "RewardContext",
    "RewardResult",
    "RewardStage",
    "RoleClients",
    "RunFailure",
    "Sample",
    "SinkReceipt",
    "Stage",
    "StageContext",
    "StageReport",
    "Timeline",
    "abort_generation",
    "check_samples",
    "check_stages",
    "connect_coordinator",
    "coordinator_name",
    "defer_slices",
    "deferred_workload_problems",
    "parse_prefill",
    "partition_name",
    "prefill_payload",
    "release_generation",
    "start_coordinator",
    "unconfirmed",
    "validate_deferred_workload",
    "validate_samples",
]

_claim(__name__, globals(), __all__)

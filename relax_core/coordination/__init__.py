"""A step's batch on shared GPUs: the coordinator, DeferredBatch, batch sinks, stages, the reward
stage, the defer preflight and the batch timeline (``docs/coordination.md``)."""

from relax_core._exports import claim as _claim
from relax_core.coordination.batch import (
    DEFAULT_MAX_SAMPLES,
    BatchResult,
    DeferredBatch,
    DeferredCollector,
    Dropped,
    Producer,
    abort_generation,
    release_generation,
)
from relax_core.coordination.coordinator import (
    COMMITTED_HISTORY,
    DEFAULT_OPERATION_TIMEOUT,
    RETIRED_HISTORY,
    Coordinator,
    CoordinatorStatus,
    LifecycleCoordinator,
    RunFailure,
)
from relax_core.coordination.handles import (
    LocalManagerHandle,
    ManagerHandle,
    RayManagerHandle,
    unconfirmed,
)
from relax_core.coordination.leases import LateReply, LeaseEngine, SwitchRecord
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
from relax_core.coordination.residency import defer_slices
from relax_core.coordination.rewards import (
    REWARD,
    REWARD_FIELDS,
    REWARDS,
    RewardContext,
    RewardResult,
    RewardStage,
)
from relax_core.coordination.sample import Sample
from relax_core.coordination.sink import (
    BatchSink,
    MemoryBatchSink,
    RayBatchSink,
    SinkReceipt,
    partition_name,
)
from relax_core.coordination.stages import (
    BatchControl,
    MoreGroups,
    RoleClients,
    SampleField,
    Stage,
    StageContext,
    StageReport,
    check_samples,
    check_stages,
    stage_fields,
    validate_samples,
)
from relax_core.coordination.states import BatchState, LeaseState
from relax_core.coordination.timeline import PHASE_HISTOGRAM, PhaseEvent, Timeline

__all__ = [
    "COMMITTED_HISTORY",
    "DEFAULT_MAX_SAMPLES",
    "DEFAULT_OPERATION_TIMEOUT",
    "NAMESPACE",
    "PHASE_HISTOGRAM",
    "RETIRED_HISTORY",
    "REWARD",
    "REWARDS",
    "REWARD_FIELDS",
    "BatchControl",
    "BatchResult",
    "BatchSink",
    "BatchState",
    "Coordinator",
    "CoordinatorActor",
    "CoordinatorStatus",
    "DeferredBatch",
    "DeferredCollector",
    "DeferredWorkload",
    "Dropped",
    "LateReply",
    "LeaseEngine",
    "LeaseState",
    "LifecycleCoordinator",
    "LocalManagerHandle",
    "ManagerHandle",
    "MemoryBatchSink",
    "MoreGroups",
    "PhaseEvent",
    "Producer",
    "RayBatchSink",
    "RayManagerHandle",
    "RemoteCoordinator",
    "RewardContext",
    "RewardResult",
    "RewardStage",
    "RoleClients",
    "RunFailure",
    "Sample",
    "SampleField",
    "SinkReceipt",
    "Stage",
    "StageContext",
    "StageReport",
    "SwitchRecord",
    "Timeline",
    "abort_generation",
    "check_samples",
    "check_stages",
    "connect_coordinator",
    "coordinator_name",
    "defer_slices",
    "deferred_workload_problems",
    "partition_name",
    "release_generation",
    "stage_fields",
    "start_coordinator",
    "unconfirmed",
    "validate_deferred_workload",
    "validate_samples",
]

_claim(__name__, globals(), __all__)

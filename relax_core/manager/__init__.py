"""The InferenceManager and its parts: engine worker actors, states and tags, results
(``docs/manager.md``)."""

from relax_core._exports import claim as _claim
from relax_core.engine.tags import ALL_TAGS, TAG_ORDER, ResidentTag, normalize_tags
from relax_core.manager.fanout import CallOutcome, gather, is_terminal_actor_death
from relax_core.manager.manager import InferenceManager
from relax_core.manager.results import (
    HealthReport,
    LifecycleResult,
    Outcome,
    ReplicaHealth,
    ReplicaResult,
    UnconfirmedWorker,
)
from relax_core.manager.slots import (
    ManagerTimeouts,
    ModelLaunch,
    ReplicaPlacement,
    ReplicaSlot,
    WorkerSlot,
)
from relax_core.manager.state import (
    OffloadPlan,
    OnloadPlan,
    Replica,
    ReplicaState,
    plan_offload,
    plan_onload,
)
from relax_core.manager.weights import CheckpointDirectory
from relax_core.manager.worker import EngineWorker, ProbeResult, StartResult

__all__ = [
    "ALL_TAGS",
    "TAG_ORDER",
    "CallOutcome",
    "CheckpointDirectory",
    "EngineWorker",
    "HealthReport",
    "InferenceManager",
    "LifecycleResult",
    "ManagerTimeouts",
    "ModelLaunch",
    "OffloadPlan",
    "OnloadPlan",
    "Outcome",
    "ProbeResult",
    "Replica",
    "ReplicaHealth",
    "ReplicaPlacement",
    "ReplicaResult",
    "ReplicaSlot",
    "ReplicaState",
    "ResidentTag",
    "StartResult",
    "UnconfirmedWorker",
    "WorkerSlot",
    "gather",
    "is_terminal_actor_death",
    "normalize_tags",
    "plan_offload",
    "plan_onload",
]

_claim(__name__, globals(), __all__)

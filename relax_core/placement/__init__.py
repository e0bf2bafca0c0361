"""GPU placement: plan before anything starts (:func:`plan_inference_placement`), with placement
modes as plugins, then bind to real placement groups (:func:`bind_placement_group`)."""

from relax_core._exports import claim as _claim
from relax_core.placement.binding import (
    BoundModel,
    BoundPool,
    BoundWorker,
    BundleProbe,
    bind_placement_group,
    bundle_order,
    probe_placement_group,
    release_bound_pool,
    validate_bound_placement,
)
from relax_core.placement.budget import ModelFacts, count_parameters, kv_bytes_per_token
from relax_core.placement.modes import (
    GENERATION_PHASE,
    Demand,
    ModeContext,
    ModeResult,
    PoolRequest,
    Slice,
    SliceAllocator,
    relax_register_placement_modes,
)
from relax_core.placement.plan import (
    PHASE_RESIDENT,
    HostMemoryBudget,
    InferencePlacementPlan,
    MemoryBudget,
    MemoryItem,
    ModelPlacement,
    Pool,
    Violation,
)
from relax_core.placement.planner import Preflight, plan_inference_placement, preflight
from relax_core.placement.render import render_plan, role_titles

__all__ = [
    "GENERATION_PHASE",
    "PHASE_RESIDENT",
    "BoundModel",
    "BoundPool",
    "BoundWorker",
    "BundleProbe",
    "Demand",
    "HostMemoryBudget",
    "InferencePlacementPlan",
    "MemoryBudget",
    "MemoryItem",
    "ModeContext",
    "ModeResult",
    "ModelFacts",
    "ModelPlacement",
    "Pool",
    "PoolRequest",
    "Preflight",
    "Slice",
    "SliceAllocator",
    "Violation",
    "bind_placement_group",
    "bundle_order",
    "count_parameters",
    "kv_bytes_per_token",
    "plan_inference_placement",
    "preflight",
    "probe_placement_group",
    "relax_register_placement_modes",
    "release_bound_pool",
    "render_plan",
    "role_titles",
    "validate_bound_placement",
]

_claim(__name__, globals(), __all__)

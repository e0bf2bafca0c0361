"""GPU placement: plan before anything starts, then bind to real placement groups.

- :func:`plan_inference_placement` (pure preflight) turns a :class:`~relax_core.config.JobConfig`
  into an immutable :class:`InferencePlacementPlan`, or raises
  :class:`~relax_core.errors.PlacementError` with every violation.
- Placement modes are plugins (``relax_register_placement_modes``); ``decoupled``, ``split``
  and ``defer`` are built in (:mod:`relax_core.placement.modes`).
- :func:`validate_bound_placement` checks probe records of a ready placement group (pure);
  :func:`bind_placement_group` creates or borrows the group on Ray, probes every bundle,
  validates, and removes the group on failure only when it owns it.
"""

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

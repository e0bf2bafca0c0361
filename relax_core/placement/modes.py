"""Placement modes as plugins, and the three built-in ones: decoupled, split and defer. A mode's
``assign(ctx) -> ModeResult`` says where each GPU model goes (pool, phase, ``bundle_start``);
the planner checks every generic rule."""

from __future__ import annotations

from collections.abc import Callable, Iterable

import attrs

from relax_core.config import JobConfig
from relax_core.hookspecs import hookimpl
from relax_core.placement.plan import PHASE_RESIDENT, Violation, Violations
from relax_core.records import PlacementMode

#: The phase the batch-generating roles (``RoleSpec.generation_phase``) run in under ``defer``;
#: each deferred role gets a phase named after it.
GENERATION_PHASE = "generation"


@attrs.frozen
class Demand:
    """What one GPU model asks for: ``num_gpus`` bundles in engines of ``gpus_per_engine``;
    ``bundle_start`` when the config fixed it; ``deferred``: its role is deferred;
    ``generation_phase``: its role generates the training batch; ``path``: its config key path."""

    role: str
    model: str
    path: str
    num_gpus: int
    gpus_per_engine: int
    bundle_start: int | None = None
    deferred: bool = False
    generation_phase: bool = False


@attrs.frozen
class ModeContext:
    """What a mode's ``assign`` gets: ``demands`` in config order; ``training_pool``
    (``"actor"``, or ``None`` without an actor pool) and its size."""

    config: JobConfig
    demands: tuple[Demand, ...]
    gpus_per_node: int
    training_pool: str | None
    training_pool_size: int


@attrs.frozen
class Slice:
    """A mode's decision for one model: pool, first bundle and phase."""

    role: str
    model: str
    pool: str
    bundle_start: int
    phase: str = PHASE_RESIDENT


@attrs.frozen
class PoolRequest:
    """An inference-only pool a mode creates (the actor pool is the planner's)."""

    name: str
    size: int


@attrs.frozen
class ModeResult:
    """A mode's answer: slices, the pools it created, its phases in run order, its violations."""

    slices: tuple[Slice, ...] = ()
    pools: tuple[PoolRequest, ...] = ()
    phases: tuple[str, ...] = (PHASE_RESIDENT,)
    violations: tuple[Violation, ...] = ()


def engine_straddles(start: int, size: int, gpus_per_engine: int, gpus_per_node: int) -> bool:
    """Whether an engine of a slice breaks the node rules (inside one node, or whole nodes from a
    node boundary)."""
    if gpus_per_node <= 0 or gpus_per_engine <= 0:
        return False
    if gpus_per_engine > gpus_per_node:
        return start % gpus_per_node != 0 or gpus_per_engine % gpus_per_node != 0
    if gpus_per_node % gpus_per_engine == 0:
        # Engine and node boundaries are both multiples of gpus_per_engine when aligned.
        crosses = start // gpus_per_node != (start + size - 1) // gpus_per_node
        return start % gpus_per_engine != 0 and crosses
    for first in range(start, start + size, gpus_per_engine):
        if first // gpus_per_node != (first + gpus_per_engine - 1) // gpus_per_node:
            return True
    return False


class SliceAllocator:
    """First-fit runs of bundles in one pool (``size`` ``None``: unbounded) that keep engines
    inside nodes and overlap no reserved run."""

    def __init__(self, gpus_per_node: int, size: int | None = None) -> None:
        self.gpus_per_node = gpus_per_node
        self.size = size
        self._runs: list[tuple[int, int]] = []

    def reserve(self, start: int, num: int) -> None:
        """Mark ``[start, start + num)`` as taken (overlaps allowed: the planner reports them)."""
        self._runs.append((start, start + num))

    @property
    def end(self) -> int:
        """One past the last taken bundle."""
        return max((e for _, e in self._runs), default=0)

    def _free(self, start: int, num: int) -> bool:
        fits = self.size is None or start + num <= self.size
        return fits and all(end <= start or first >= start + num for first, end in self._runs)

    def place(self, num: int, gpus_per_engine: int) -> int | None:
        """Take the first free run of ``num`` bundles; its start, or ``None`` when there is none."""
        gpn = self.gpus_per_node
        for cand in sorted({0, *(e for _, e in self._runs)}):
            for start in _aligned_candidates(cand, num, gpus_per_engine, gpn):
                if self._free(start, num):
                    self.reserve(start, num)
                    return start
        return None


def _aligned_candidates(cand: int, num: int, gpe: int, gpn: int) -> Iterable[int]:
    if not engine_straddles(cand, num, gpe, gpn):
        yield cand
    if gpn > 0:
        boundary = -(-cand // gpn) * gpn
        if boundary != cand and not engine_straddles(boundary, num, gpe, gpn):
            yield boundary


def _place_group(
    demands: Iterable[Demand], alloc: SliceAllocator, pool: str, phase: str, out: list[Slice]
) -> list[Violation]:
    demands = list(demands)
    violations = Violations()
    for d in demands:
        if d.bundle_start is not None:
            alloc.reserve(d.bundle_start, d.num_gpus)
            out.append(Slice(d.role, d.model, pool, d.bundle_start, phase))
    for d in demands:
        if d.bundle_start is not None:
            continue
        start = alloc.place(d.num_gpus, d.gpus_per_engine)
        if start is None:
            taken = ", ".join(
                f"{s.role}.{s.model} {s.bundle_start}-"
                f"{s.bundle_start + _demand(demands, s).num_gpus - 1}"
                for s in out
                if s.pool == pool and s.phase == phase
            )
            violations.add(
                d.path,
                "no-room",
                f"no free run of {d.num_gpus} bundles (engines of {d.gpus_per_engine} GPUs, "
                f"inside nodes) is left in pool {pool!r} ({alloc.size} bundles) in phase "
                f"{phase!r}; taken: {taken or 'nothing'}. Lower num_gpus or grow the pool",
            )
        else:
            out.append(Slice(d.role, d.model, pool, start, phase))
    return violations


def _no_actor_pool(mode: str) -> ModeResult:
    message = (
        f"placement.mode = {mode!r} places inference inside the actor pool, but the job has "
        "no actor GPUs; set training.actor_gpus, or use mode = 'decoupled'"
    )
    return ModeResult(violations=(Violation("training.actor_gpus", "actor-pool", message),))


def assign_decoupled(ctx: ModeContext) -> ModeResult:
    """Each role gets a pool of its own, its models packed from bundle 0."""
    slices: list[Slice] = []
    pools: list[PoolRequest] = []
    violations: list[Violation] = []
    for role in dict.fromkeys(d.role for d in ctx.demands):
        alloc = SliceAllocator(ctx.gpus_per_node)
        group = [d for d in ctx.demands if d.role == role]
        violations += _place_group(group, alloc, role, PHASE_RESIDENT, slices)
        pools.append(PoolRequest(role, alloc.end))
    return ModeResult(tuple(slices), tuple(pools), (PHASE_RESIDENT,), tuple(violations))


DECOUPLED = PlacementMode(
    name="decoupled",
    assign=assign_decoupled,
    description="Each inference role in its own pool (placement group), offsets from 0.",
)


def assign_split(ctx: ModeContext) -> ModeResult:
    """Every role in the actor pool, in contiguous slices that never overlap."""
    if ctx.training_pool is None:
        return _no_actor_pool("split")
    slices: list[Slice] = []
    alloc = SliceAllocator(ctx.gpus_per_node, ctx.training_pool_size)
    violations = _place_group(ctx.demands, alloc, ctx.training_pool, PHASE_RESIDENT, slices)
    return ModeResult(tuple(slices), (), (PHASE_RESIDENT,), tuple(violations))


SPLIT = PlacementMode(
    name="split",
    assign=assign_split,
    shares_training_pool=True,
    description="Inference roles in disjoint contiguous slices of the actor pool.",
)


def assign_defer(ctx: ModeContext) -> ModeResult:
    """Generating roles in the generation phase, each deferred role in a phase of its own, all
    from bundle 0 of the actor pool; the others resident on bundles no phase uses."""
    if ctx.training_pool is None:
        return _no_actor_pool("defer")
    pool, size = ctx.training_pool, ctx.training_pool_size
    violations = Violations()
    deferred = tuple(ctx.config.placement.defer_roles)
    if not deferred:
        violations.add(
            "placement.defer_roles",
            "defer-roles",
            "mode = 'defer' needs at least one deferred role; list the deferrable roles "
            "to time-share the generation phase's GPUs in placement.defer_roles, or use "
            "mode = 'split'",
        )
    groups: dict[str, list[Demand]] = {GENERATION_PHASE: [], **{role: [] for role in deferred}}
    resident: list[Demand] = []
    for d in ctx.demands:
        if d.deferred and d.role in groups:
            groups[d.role].append(d)
        elif d.generation_phase:
            groups[GENERATION_PHASE].append(d)
        else:
            resident.append(d)
    slices: list[Slice] = []
    for phase, group in groups.items():
        alloc = SliceAllocator(ctx.gpus_per_node, size)
        violations += _place_group(group, alloc, pool, phase, slices)
    res_alloc = SliceAllocator(ctx.gpus_per_node, size)
    for s in slices:
        res_alloc.reserve(s.bundle_start, _demand(ctx.demands, s).num_gpus)
    violations += _place_group(resident, res_alloc, pool, PHASE_RESIDENT, slices)
    phases = (GENERATION_PHASE, *deferred) + ((PHASE_RESIDENT,) if resident else ())
    return ModeResult(tuple(slices), (), phases, tuple(violations))


DEFER = PlacementMode(
    name="defer",
    assign=assign_defer,
    shares_training_pool=True,
    supports_defer=True,
    description="Deferred roles reuse the generation phase's actor-pool bundles in later phases.",
)


def _demand(demands: Iterable[Demand], s: Slice) -> Demand:
    return next(d for d in demands if d.role == s.role and d.model == s.model)


@hookimpl
def relax_register_placement_modes(register: Callable[[PlacementMode], None]) -> None:
    """Register decoupled, split and defer."""
    for mode in (DECOUPLED, SPLIT, DEFER):
        register(mode)

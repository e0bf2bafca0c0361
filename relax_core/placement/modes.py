"""Placement modes as plugins, and the three built-in ones: decoupled, split and defer.

A mode is a :class:`~relax_core.records.PlacementMode` whose ``assign(ctx: ModeContext) ->
ModeResult`` decides, for every GPU model, its pool, its phase and (unless the config fixed it)
its ``bundle_start``. It may create inference pools of its own. The planner then checks every
generic rule (bounds, node boundaries, same-phase co-residence, Ray reservations, GPU and
memory budgets), so a mode only has to say where things go. Use :class:`SliceAllocator` for
first-fit allocation that keeps engines inside nodes.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable

import attrs

from relax_core.config import JobConfig
from relax_core.hookspecs import hookimpl
from relax_core.placement.plan import PHASE_RESIDENT, Violation
from relax_core.records import PlacementMode

__all__ = [
    "DECOUPLED",
    "DEFER",
    "GENERATION_PHASE",
    "SPLIT",
    "Demand",
    "ModeContext",
    "ModeResult",
    "PoolRequest",
    "Slice",
    "SliceAllocator",
    "relax_register_placement_modes",
]

#: The phase the batch-generating roles (``RoleSpec.generation_phase``) run in under ``defer``;
#: each deferred role gets a phase named after it.
GENERATION_PHASE = "generation"


@attrs.frozen
class Demand:
    """What one GPU model asks for: ``num_gpus`` bundles in engines of ``gpus_per_engine``.

    ``bundle_start`` is set when the config fixed it; ``deferred`` when its role is listed in
    ``placement.defer_roles``; ``generation_phase`` when its role's record says the role
    generates the training batch (``RoleSpec.generation_phase``); ``path`` is its config key
    path.
    """

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
    """Everything a mode's ``assign`` gets.

    ``demands`` are in the config's order: roles in file order, models in file order within
    a role. ``training_pool`` is ``"actor"`` when the job has an actor pool (``None`` when not)
    and ``training_pool_size`` its bundles.
    """

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
    """A mode's answer: slices, the pools it created, its phases in run order, and any
    violations of its own rules (the planner adds the generic ones)."""

    slices: tuple[Slice, ...] = ()
    pools: tuple[PoolRequest, ...] = ()
    phases: tuple[str, ...] = (PHASE_RESIDENT,)
    violations: tuple[Violation, ...] = ()


def engine_straddles(start: int, size: int, gpus_per_engine: int, gpus_per_node: int) -> bool:
    """Whether an engine of a slice breaks the node rules for pool-local nodes.

    An engine of at most ``gpus_per_node`` GPUs must sit inside one node; a larger one must
    start on a node boundary and cover whole nodes.
    """
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
    """First-fit allocation of contiguous bundle runs in one pool.

    ``size`` ``None`` means the pool grows as needed (a mode's own pool). Every run it hands out
    keeps its engines inside nodes (or on whole nodes); it never overlaps a reserved run.
    """

    def __init__(self, gpus_per_node: int, size: int | None = None) -> None:
        self.gpus_per_node = gpus_per_node
        self.size = size
        self._runs: list[tuple[int, int]] = []

    def reserve(self, start: int, num: int) -> None:
        """Mark ``[start, start + num)`` as taken (explicit slices; overlaps are allowed here —
        the planner reports them)."""
        self._runs.append((start, start + num))

    @property
    def end(self) -> int:
        """One past the last taken bundle."""
        return max((e for _, e in self._runs), default=0)

    def _free(self, start: int, num: int) -> bool:
        if self.size is not None and start + num > self.size:
            return False
        return all(end <= start or first >= start + num for first, end in self._runs)

    def place(self, num: int, gpus_per_engine: int) -> int | None:
        """Take the first free run of ``num`` bundles that keeps engines inside nodes; return
        its start, or ``None`` when there is none."""
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
    violations: list[Violation] = []
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
                f"{s.role}.{s.model} {s.bundle_start}-{s.bundle_start + _num(demands, s) - 1}"
                for s in out
                if s.pool == pool and s.phase == phase
            )
            violations.append(
                Violation(
                    d.path,
                    "no-room",
                    f"no free run of {d.num_gpus} bundles (engines of {d.gpus_per_engine} GPUs, "
                    f"inside nodes) is left in pool {pool!r} ({alloc.size} bundles) in phase "
                    f"{phase!r}; taken: {taken or 'nothing'}. Lower num_gpus or grow the pool",
                )
            )
        else:
            out.append(Slice(d.role, d.model, pool, start, phase))
    return violations


def _num(demands: list[Demand], s: Slice) -> int:
    return next(d.num_gpus for d in demands if d.role == s.role and d.model == s.model)


def _need_actor_pool(ctx: ModeContext, mode: str) -> Violation | None:
    if ctx.training_pool is None:
        return Violation(
            "training.actor_gpus",
            "actor-pool",
            f"placement.mode = {mode!r} places inference inside the actor pool, but the job has "
            "no actor GPUs; set training.actor_gpus, or use mode = 'decoupled'",
        )
    return None


def assign_decoupled(ctx: ModeContext) -> ModeResult:
    """Each role gets a pool of its own, its models packed from bundle 0."""
    slices: list[Slice] = []
    pools: list[PoolRequest] = []
    violations: list[Violation] = []
    roles: list[str] = []
    for d in ctx.demands:
        if d.role not in roles:
            roles.append(d.role)
    for role in roles:
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
    missing = _need_actor_pool(ctx, "split")
    if missing is not None or ctx.training_pool is None:
        return ModeResult(violations=(missing,) if missing else ())
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
    """The batch-generating roles in the generation phase, each deferred role in a phase of its
    own, all from bundle 0 of the actor pool; the other roles stay resident on bundles no phase
    uses."""
    missing = _need_actor_pool(ctx, "defer")
    if missing is not None or ctx.training_pool is None:
        return ModeResult(violations=(missing,) if missing else ())
    pool, size = ctx.training_pool, ctx.training_pool_size
    violations: list[Violation] = []
    deferred = tuple(ctx.config.placement.defer_roles)
    if not deferred:
        violations.append(
            Violation(
                "placement.defer_roles",
                "defer-roles",
                "mode = 'defer' needs at least one deferred role; list the deferrable roles "
                "to time-share the generation phase's GPUs in placement.defer_roles, or use "
                "mode = 'split'",
            )
        )
    groups: dict[str, list[Demand]] = {GENERATION_PHASE: []}
    groups.update({role: [] for role in deferred})
    resident: list[Demand] = []
    for d in ctx.demands:
        if d.deferred and d.role in groups:
            groups[d.role].append(d)
        elif d.generation_phase:
            groups[GENERATION_PHASE].append(d)
        else:
            resident.append(d)
    slices: list[Slice] = []
    phase_runs: list[tuple[int, int]] = []
    for phase, group in groups.items():
        alloc = SliceAllocator(ctx.gpus_per_node, size)
        violations += _place_group(group, alloc, pool, phase, slices)
    phase_runs = [(s.bundle_start, s.bundle_start + _demand(ctx, s).num_gpus) for s in slices]
    res_alloc = SliceAllocator(ctx.gpus_per_node, size)
    for start, end in phase_runs:
        res_alloc.reserve(start, end - start)
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


def _demand(ctx: ModeContext, s: Slice) -> Demand:
    return next(d for d in ctx.demands if d.role == s.role and d.model == s.model)


@hookimpl
def relax_register_placement_modes(register: Callable[[PlacementMode], None]) -> None:
    """Register decoupled, split and defer."""
    for mode in (DECOUPLED, SPLIT, DEFER):
        register(mode)

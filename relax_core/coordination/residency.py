"""Defer slices and residency: which roles share GPUs (those whose models' bundle runs overlap in
one pool while placed in different non-resident phases, transitively: the layout the coordinator
leases), and which roles of a slice may be resident together, from the placement's memory budget
(``docs/coordination.md``)."""

from __future__ import annotations

import itertools
from collections.abc import Collection, Mapping
from typing import Any

import attrs

from relax_core.config import RESIDENCY_MODES
from relax_core.placement.plan import PHASE_RESIDENT, InferencePlacementPlan


def _demand(value: Mapping[str, Mapping[int, float] | None]) -> dict[str, dict[int, float] | None]:
    return {r: None if d is None else dict(d) for r, d in value.items()}


@attrs.frozen
class SliceResidency:
    """One defer slice: its roles, the GiB each needs on each bundle (``None``: not known, so
    it is resident alone), what training keeps resident per bundle, the GPU's capacity."""

    slice: str
    roles: tuple[str, ...]
    capacity_gib: float | None = None
    demand: Mapping[str, Mapping[int, float] | None] = attrs.field(factory=dict, converter=_demand)
    training: Mapping[int, float] = attrs.field(factory=dict)
    #: role -> why its need is not known
    unknown: Mapping[str, str] = attrs.field(factory=dict)

    def fits(self, roles: Collection[str]) -> bool:
        """Whether ``roles`` (of this slice) may be resident at once."""
        chosen = [r for r in roles if r in self.roles]
        if len(chosen) <= 1:
            return True
        if self.capacity_gib is None:
            return False
        needs: list[Mapping[int, float]] = []
        for role in chosen:
            need = self.demand.get(role)
            if need is None:
                return False
            needs.append(need)
        capacity = self.capacity_gib
        bundles = {b for need in needs for b in need}
        return all(
            sum(need.get(b, 0.0) for need in needs) + self.training.get(b, 0.0) <= capacity + 1e-9
            for b in bundles
        )

    def groups(self) -> list[tuple[str, ...]]:
        """The largest sets of the slice's roles that fit together, each sorted, largest first."""
        roles = sorted(self.roles)
        found: list[tuple[str, ...]] = []
        for size in range(len(roles), 0, -1):
            for combo in itertools.combinations(roles, size):
                if self.fits(combo) and not any(set(combo) <= set(g) for g in found):
                    found.append(combo)
        return found


@attrs.frozen
class ResidencyPlan:
    """Per defer slice, which of its roles may be resident together; the roles that never
    switch (``free``). ``mode``: ``planned`` or ``exclusive`` (one role of a slice at a time).
    Picklable."""

    slices: Mapping[str, SliceResidency] = attrs.field(factory=dict)
    free: frozenset[str] = frozenset()
    mode: str = attrs.field(default="exclusive", validator=attrs.validators.in_(RESIDENCY_MODES))

    def fits(self, slice_id: str, roles: Collection[str]) -> bool:
        """Whether ``roles`` of slice ``slice_id`` may be resident at once (free roles need
        nothing; in ``exclusive`` mode, one role at a time)."""
        held = [r for r in roles if r not in self.free]
        if len(held) <= 1:
            return True
        if self.mode == "exclusive":
            return False
        found = self.slices.get(slice_id)
        return found is not None and found.fits(held)

    def describe(self) -> list[str]:
        """One line per slice and per free role, for ``relax plan`` and the trace."""
        if self.mode == "exclusive":
            lines = [
                f'{s.slice}: {", ".join(s.roles)} resident one at a time (residency = "exclusive")'
                for s in self.slices.values()
            ]
        else:
            lines = []
            for s in self.slices.values():
                groups = s.groups()
                why = ""
                if s.unknown:
                    reasons = "; ".join(f"{r}: {w}" for r, w in sorted(s.unknown.items()))
                    why = f" (not budgeted, so alone: {reasons})"
                if all(len(g) == 1 for g in groups):
                    what = "one at a time: " + ", ".join(g[0] for g in groups)
                else:
                    what = "resident together: " + " | ".join(" + ".join(g) for g in groups)
                lines.append(f"{s.slice}: {what}{why}")
        lines += [f"{role}: never switches (no GPU it shares)" for role in sorted(self.free)]
        return lines

    def to_dict(self) -> dict[str, Any]:
        """The plan as JSON-ready data (the trace's record of it)."""
        return {
            "mode": self.mode,
            "free": sorted(self.free),
            "slices": {
                sid: {
                    "roles": list(s.roles),
                    "capacity_gib": s.capacity_gib,
                    "demand": _demand(s.demand),
                    "groups": [list(g) for g in s.groups()],
                    "unknown": dict(s.unknown),
                }
                for sid, s in self.slices.items()
            },
        }


def plan_residency(
    plan: Any, slices: Mapping[str, str], *, mode: str = "planned", roles: Collection[str] = ()
) -> ResidencyPlan:
    """The residency of ``plan`` (an :class:`~relax_core.placement.InferencePlacementPlan`)
    over its defer ``slices`` (role -> slice id); of ``roles``, those on no shared slice are
    free. Pure.

    :raises ValueError: an unknown ``mode``."""
    if mode not in RESIDENCY_MODES:
        raise ValueError(f"residency {mode!r}: must be one of {RESIDENCY_MODES}")
    members: dict[str, list[str]] = {}
    for role, sid in slices.items():
        members.setdefault(sid, []).append(role)
    shared = {sid: rs for sid, rs in members.items() if len(rs) > 1}
    free: frozenset[str] = frozenset()
    if mode == "planned":
        free = frozenset(r for r in roles if r not in slices or slices[r] not in shared)
    budgets: dict[str, list[Any]] = {}
    for budget in plan.memory:
        budgets.setdefault(budget.role, []).append(budget)
    out: dict[str, SliceResidency] = {}
    for sid, rs in shared.items():
        capacity = None
        demand: dict[str, dict[int, float] | None] = {}
        training: dict[int, float] = {}
        unknown: dict[str, str] = {}
        for role in rs:
            per_bundle: dict[int, float] | None = {}
            models = [p for p in plan.placements if p.role == role and p.pool is not None]
            for p in models:
                budget = next((b for b in budgets.get(role, []) if b.model == p.model), None)
                if budget is not None and budget.status != "ok":
                    unknown[role] = budget.note or f"its budget is {budget.status}"
                if budget is None or budget.status != "ok" or per_bundle is None:
                    per_bundle = None
                    continue
                capacity = budget.capacity_gib
                engine = sum(i.gib for i in budget.items if not i.kept)
                kept = sum(i.gib for i in budget.items if i.kept)
                for bundle in range(budget.bundles[0], budget.bundles[1]):
                    per_bundle[bundle] = per_bundle.get(bundle, 0.0) + engine
                    training[bundle] = max(training.get(bundle, 0.0), kept)
            demand[role] = per_bundle if models else None
        out[sid] = SliceResidency(sid, tuple(sorted(rs)), capacity, demand, training, unknown)
    return ResidencyPlan(out, free, mode)


def defer_slices(plan: InferencePlacementPlan) -> Mapping[str, str]:
    """Role -> slice id (``pool:first-last``) for every role placed in a non-resident phase."""
    runs: dict[str, list[tuple[str, int, int]]] = {}
    for p in plan.placements:
        if p.pool is None or p.phase == PHASE_RESIDENT or p.bundle_start is None:
            continue
        runs.setdefault(p.role, []).append((p.pool, p.bundle_start, p.bundle_end))
    groups: list[set[str]] = []  # the roles that share GPUs, transitively
    for role in sorted(runs):
        touching = [g for g in groups if any(_overlap(runs[role], runs[r]) for r in g)]
        groups = [g for g in groups if g not in touching] + [{role}.union(*touching)]
    names: dict[str, str] = {}
    for group in groups:
        spans = [span for r in sorted(group) for span in runs[r]]
        start, end = min(s for _, s, _ in spans), max(e for _, _, e in spans)
        names.update(dict.fromkeys(group, f"{spans[0][0]}:{start}-{end - 1}"))
    return {role: names[role] for role in sorted(runs)}


def _overlap(a: list[tuple[str, int, int]], b: list[tuple[str, int, int]]) -> bool:
    return any(pa == pb and sa < eb and sb < ea for pa, sa, ea in a for pb, sb, eb in b)

"""Defer slices: roles whose models' bundle runs overlap in one pool while placed in different
non-resident phases share GPUs (transitively): the layout the coordinator leases.
"""

from __future__ import annotations

from collections.abc import Mapping

from relax_core.placement.plan import PHASE_RESIDENT, InferencePlacementPlan

__all__ = ["defer_slices"]


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

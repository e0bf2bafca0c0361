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
    parent = {role: role for role in runs}

    def find(role: str) -> str:
        while parent[role] != role:
            parent[role] = parent[parent[role]]
            role = parent[role]
        return role

    roles = sorted(runs)
    for i, a in enumerate(roles):
        for b in roles[i + 1 :]:
            if any(
                pa == pb and sa < eb and sb < ea for pa, sa, ea in runs[a] for pb, sb, eb in runs[b]
            ):
                parent[find(a)] = find(b)
    members: dict[str, list[tuple[str, int, int]]] = {}
    for role in roles:
        members.setdefault(find(role), []).extend(runs[role])
    names = {}
    for root, spans in members.items():
        pool = spans[0][0]
        names[root] = f"{pool}:{min(s for _, s, _ in spans)}-{max(e for _, _, e in spans) - 1}"
    return {role: names[find(role)] for role in roles}

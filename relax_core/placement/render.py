"""A human-readable view of a plan: bundle maps per pool and the memory budget per GPU."""

from __future__ import annotations

import collections
from collections.abc import Mapping, Sequence

from relax_core.placement.budget import node_ranges
from relax_core.placement.plan import (
    HostMemoryBudget,
    InferencePlacementPlan,
    MemoryBudget,
    ModelPlacement,
    Pool,
)
from relax_core.plugins import PluginManager


def role_titles(plugin_manager: PluginManager) -> dict[str, str]:
    """``{role: RoleSpec.title}`` of every role ``plugin_manager`` has registered."""
    return {name: reg.record.title for name, reg in plugin_manager.registered("roles").items()}


#: Pools wider than this are shown as bundle ranges instead of one column per bundle.
MAX_MAP_WIDTH = 64


def _role_title(role: str, titles: Mapping[str, str]) -> str:
    return titles.get(role) or role.capitalize()


def _title(p: ModelPlacement, one_model: bool, multi_phase: bool, titles: Mapping[str, str]) -> str:
    label = _role_title(p.role, titles)
    if not one_model:
        label += f"/{p.model}"
    if multi_phase:
        label += f" ({p.phase})"
    return label + ":"


def _rows(
    plan: InferencePlacementPlan, pool: Pool, titles: Mapping[str, str]
) -> list[tuple[str, ModelPlacement]]:
    placed = plan.placements_in(pool.name)
    per_role = collections.Counter(p.role for p in placed)
    multi_phase = len({p.phase for p in placed}) > 1
    return [(_title(p, per_role[p.role] == 1, multi_phase, titles), p) for p in placed]


def _pool_lines(
    plan: InferencePlacementPlan, pool: Pool, width: int, titles: Mapping[str, str]
) -> list[str]:
    rows = _rows(plan, pool, titles)
    owners = ", ".join(pool.training)
    shared = ""
    if pool.training:
        shared = f", shared with training {owners}" if pool.inference else f", training {owners}"
    nodes = f"; cluster node(s) {node_ranges(pool.nodes)}" if pool.nodes else ""
    lines = [f"pool {pool.name}: {pool.size} bundles{shared}{nodes}"]
    if not rows:
        return lines
    if pool.size <= MAX_MAP_WIDTH:
        lines.append("bundle:".ljust(width) + " ".join(str(i) for i in range(pool.size)))
        for title, p in rows:
            letter = _role_title(p.role, titles)[0].upper()
            cells = [
                (letter if (p.bundle_start or 0) <= i < p.bundle_end else ".").rjust(len(str(i)))
                for i in range(pool.size)
            ]
            lines.append(title.ljust(width) + " ".join(cells))
    else:
        for title, p in rows:
            lines.append(
                title.ljust(width)
                + f"bundles {p.bundle_start}-{p.bundle_end - 1} ({p.num_engines} engines of "
                f"{p.gpus_per_engine} GPUs)"
            )
    return lines


def _section(title: str, lines: list[str]) -> list[str]:
    return ["", title, *lines] if lines else []


def _memory_line(m: MemoryBudget) -> str:
    head = f"  {m.role}.{m.model} [{m.pool} {m.bundles[0]}-{m.bundles[1] - 1}, {m.phase}]"
    if m.status == "skipped":
        return f"{head}: skipped: {m.note}"
    users = " + ".join(f"{i.label} {i.gib:.1f}" for i in m.items)
    return f"{head}: {m.total_gib:.1f} of {m.capacity_gib:g} ({m.status}) = {users}"


def _host_line(h: HostMemoryBudget) -> str:
    users = " + ".join(f"{i.label} {i.gib:.1f}" for i in h.items)
    cap = f" of {h.capacity_gib:g}" if h.capacity_gib is not None else ""
    return f"  node(s) {node_ranges(h.nodes)}: {h.total_gib:.1f}{cap} ({h.status}) = {users}"


def render_plan(
    plan: InferencePlacementPlan,
    notes: Sequence[str] = (),
    *,
    titles: Mapping[str, str] | None = None,
) -> str:
    """The plan as text: a header, a bundle map per pool, CPU models, memory and notes.
    ``titles``: each role's name (:func:`role_titles`; default: the role, capitalised)."""
    titles = titles or {}
    lines = [
        f"mode: {plan.mode}   cluster: {plan.num_nodes} node(s) x {plan.gpus_per_node} GPUs   "
        f"job uses {plan.total_gpus} of {plan.cluster_gpus} GPUs   phases: "
        + " -> ".join(plan.phases)
    ]
    labels = [t for pool in plan.pools for t, _ in _rows(plan, pool, titles)]
    width = max([len("bundle:"), *(len(t) for t in labels)]) + 1
    for pool in plan.pools:
        lines.append("")
        lines += _pool_lines(plan, pool, width, titles)
    if cpu := [p for p in plan.placements if p.pool is None]:
        lines.append("")
        lines += [f"{p.role}.{p.model}: {p.num_engines} engine(s) on {p.device}" for p in cpu]
    lines += _section("memory per GPU (GiB):", [_memory_line(m) for m in plan.memory])
    lines += _section("host memory per node (GiB):", [_host_line(h) for h in plan.host_memory])
    lines += _section("notes:", [f"  - {n}" for n in dict.fromkeys([*plan.notes, *notes])])
    return "\n".join(lines)

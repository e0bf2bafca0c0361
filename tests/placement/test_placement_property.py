"""Properties of every plan the planner accepts, over random clusters, modes and models."""

from __future__ import annotations

from typing import Any

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from relax_core.config import parse_config
from relax_core.placement import InferencePlacementPlan, preflight
from relax_core.placement.plan import phases_conflict
from tests.support.roles import builtin_roles

#: The roles jobs are drawn from, and which of them may be deferred: from their records.
PM = builtin_roles()
ROLES = {name: reg.record for name, reg in PM.registered("roles").items()}


@st.composite
def jobs(draw: st.DrawFn) -> dict[str, Any]:
    gpn = draw(st.sampled_from([2, 4, 8]))
    nodes = draw(st.integers(1, 4))
    total = gpn * nodes
    mode = draw(st.sampled_from(["decoupled", "split", "defer"]))
    shared = mode != "decoupled"
    actor = draw(st.integers(1 if shared else 0, total))
    roles: dict[str, Any] = {}
    for role in draw(
        st.lists(st.sampled_from(sorted(ROLES)), min_size=1, max_size=len(ROLES), unique=True)
    ):
        models: dict[str, Any] = {}
        for i in range(draw(st.integers(1, 2))):
            gpe = draw(st.sampled_from([1, 2, 4, 8, 16]))
            pp = draw(st.sampled_from([1, 2])) if gpe % 2 == 0 else 1
            m: dict[str, Any] = {
                "backend": "sglang",
                "model_path": "/models/none",
                "gpus_per_engine": gpe,
                "tp": gpe // pp,
                "pp": pp,
                "num_gpus": gpe * draw(st.integers(1, 3)),
            }
            how = draw(st.sampled_from(["auto", "auto", "aligned", "aligned", "any"]))
            if how == "aligned":  # a start that respects node rules and (mostly) the pool
                align = gpe if gpe <= gpn else gpn
                room = (actor if shared else total) - m["num_gpus"]
                m["bundle_start"] = align * draw(st.integers(0, max(room, 0) // align))
            elif how == "any":
                m["bundle_start"] = draw(st.integers(0, total))
            models[f"m{i}"] = m
        roles[role] = {"models": models}
    placement: dict[str, Any] = {"mode": mode}
    if mode == "defer":
        placement["defer_roles"] = [r for r in roles if ROLES[r].deferrable]
    return {
        "cluster": {"num_nodes": nodes, "gpus_per_node": gpn, "gpu_memory_gib": 80},
        "training": {"actor_gpus": actor, "colocate": shared, "offload": True},
        "placement": placement,
        "roles": roles,
    }


def check_invariants(plan: InferencePlacementPlan) -> None:
    gpn = plan.gpus_per_node
    pools = {p.name: p for p in plan.pools}
    placed = [p for p in plan.placements if p.pool is not None]
    # no two slices that are resident at the same time share a bundle
    for i, a in enumerate(placed):
        for b in placed[i + 1 :]:
            if a.pool == b.pool and phases_conflict(a.phase, b.phase):
                assert a.bundle_end <= (b.bundle_start or 0) or b.bundle_end <= (
                    a.bundle_start or 0
                )
    for p in placed:
        pool = pools[p.pool]  # type: ignore[index]
        assert (p.bundle_start or 0) >= 0 and p.bundle_end <= pool.size
        assert [b for r in p.replicas for b in r] == list(range(p.bundle_start or 0, p.bundle_end))
        for replica, workers in zip(p.replicas, p.workers, strict=True):
            nodes = {b // gpn for b in replica}
            # every engine inside one node, or on whole nodes of its own
            assert len(nodes) == 1 or (replica[0] % gpn == 0 and len(replica) == len(nodes) * gpn)
            assert [b for w in workers for b in w] == list(replica)
            assert len(workers) == len(nodes)
    # pools fit the cluster node by node
    used = [0] * plan.num_nodes
    for pool in plan.pools:
        assert len(pool.nodes) == -(-pool.size // gpn)
        for k, node in enumerate(pool.nodes):
            used[node] += min(gpn, pool.size - k * gpn)
    assert max(used, default=0) <= gpn
    # Ray reservations never exceed one GPU per bundle
    for pool in plan.pools:
        load = [pool.training_ray_gpu_fraction * len(pool.training)] * pool.size
        for p in plan.placements_in(pool.name):
            for workers in p.workers:
                for w in workers:
                    load[w[0]] += p.ray_gpu_fraction
        assert max(load, default=0) <= 1 + 1e-6


def test_accepted_plans_never_share_a_bundle_within_a_phase_and_keep_engines_on_nodes() -> None:
    pm = PM
    outcomes = {"accepted": 0, "rejected": 0}

    @settings(
        max_examples=400,
        deadline=None,
        derandomize=True,
        suppress_health_check=[HealthCheck.too_slow],
    )
    @given(jobs())
    def check(data: dict[str, Any]) -> None:
        result = preflight(parse_config(data), pm)
        if result.plan is None:
            outcomes["rejected"] += 1
            assert result.violations and all(v.path and v.rule for v in result.violations)
            return
        outcomes["accepted"] += 1
        check_invariants(result.plan)

    check()
    # the strategy must exercise both sides, or the property says nothing
    assert outcomes["accepted"] >= 40 and outcomes["rejected"] >= 40, outcomes

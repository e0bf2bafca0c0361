"""The preflight planner: the reference's examples, and one test per rejection rule.

Each rejection test asserts the key path and the rule name of the violation, and that
``plan_inference_placement`` raises a ``PlacementError`` whose message carries both.
"""

from __future__ import annotations

import copy
import json
from collections.abc import Callable
from typing import Any

import pytest

from relax_core.config import JobConfig, parse_config
from relax_core.errors import PlacementError
from relax_core.placement import (
    InferencePlacementPlan,
    ModeContext,
    ModeResult,
    Slice,
    plan_inference_placement,
    preflight,
    render_plan,
    role_titles,
)
from relax_core.plugins import PluginManager, module_plugin
from relax_core.records import PlacementMode, RoleSpec
from tests.support.plugin_managers import registering
from tests.support.roles import builtin_roles

DROP = object()


def model(num_gpus: int, gpe: int, **extra: Any) -> dict[str, Any]:
    return {
        "backend": "sglang",
        "model_path": "/models/none",
        "num_gpus": num_gpus,
        "gpus_per_engine": gpe,
        "tp": gpe,
        **extra,
    }


SPLIT_8: dict[str, Any] = {
    "cluster": {"num_nodes": 1, "gpus_per_node": 8, "gpu_memory_gib": 80},
    "training": {"actor_gpus": 8, "colocate": True, "offload": True},
    "placement": {"mode": "split"},
    "roles": {
        "rollout": {"models": {"policy": model(4, 2)}},
        "genrm": {"models": {"judge": model(2, 2)}},
        "teacher": {"models": {"math": model(2, 2)}},
    },
}


def job(base: dict[str, Any] = SPLIT_8, **changes: Any) -> JobConfig:
    """``base`` with dotted-key changes (``roles__genrm__models__judge__tp=3``); DROP deletes."""
    data = copy.deepcopy(base)
    for dotted, value in changes.items():
        *parents, leaf = dotted.split("__")
        node = data
        for key in parents:
            node = node.setdefault(key, {})
        if value is DROP:
            node.pop(leaf, None)
        else:
            node[leaf] = value
    return parse_config(data)


def rejects(cfg: JobConfig, pm: PluginManager, path: str, rule: str) -> str:
    result = preflight(cfg, pm)
    assert result.plan is None
    hits = [v for v in result.violations if v.path == path and v.rule == rule]
    assert hits, [str(v) for v in result.violations]
    with pytest.raises(PlacementError) as info:
        plan_inference_placement(cfg, pm)
    assert f"{path}: [{rule}]" in str(info.value)
    return hits[0].message


def rows(text: str) -> list[str]:
    return [line.rstrip() for line in text.splitlines()]


# -- the reference's examples ------------------------------------------------------------------


def test_split_puts_rollout_genrm_and_teacher_in_disjoint_actor_slices(
    roles_plugin_manager: PluginManager,
) -> None:
    plan = plan_inference_placement(job(), roles_plugin_manager)
    assert plan.mode == "split" and plan.total_gpus == 8
    assert [p.name for p in plan.pools] == ["actor"]
    got = {(p.role, p.bundle_start, p.num_gpus, p.phase) for p in plan.placements}
    assert got == {
        ("rollout", 0, 4, "resident"),
        ("genrm", 4, 2, "resident"),
        ("teacher", 6, 2, "resident"),
    }
    assert plan.model_placement("rollout", "policy").replicas == ((0, 1), (2, 3))
    text = rows(render_plan(plan, titles=role_titles(roles_plugin_manager)))
    assert "bundle:  0 1 2 3 4 5 6 7" in text
    assert "Rollout: R R R R . . . ." in text
    assert "GenRM:   . . . . G G . ." in text
    assert "Teacher: . . . . . . T T" in text


DEFER_8 = copy.deepcopy(SPLIT_8)
DEFER_8["placement"] = {"mode": "defer", "defer_roles": ["genrm", "teacher"]}
DEFER_8["roles"] = {
    "rollout": {"models": {"policy": model(8, 2)}},
    "genrm": {"models": {"judge": model(8, 2)}},
    "teacher": {"models": {"math": model(8, 2)}},
}


def test_defer_reuses_all_eight_bundles_in_three_phases(
    roles_plugin_manager: PluginManager,
) -> None:
    plan = plan_inference_placement(job(DEFER_8), roles_plugin_manager)
    assert plan.phases == ("generation", "genrm", "teacher")
    got = {(p.role, p.pool, p.bundle_start, p.num_gpus, p.phase) for p in plan.placements}
    assert got == {
        ("rollout", "actor", 0, 8, "generation"),
        ("genrm", "actor", 0, 8, "genrm"),
        ("teacher", "actor", 0, 8, "teacher"),
    }
    text = rows(render_plan(plan, titles=role_titles(roles_plugin_manager)))
    assert "Rollout (generation): R R R R R R R R" in text
    assert "GenRM (genrm):        G G G G G G G G" in text
    assert "Teacher (teacher):    T T T T T T T T" in text


def test_defer_keeps_a_role_that_is_not_deferred_resident_beside_the_phases(
    roles_plugin_manager: PluginManager,
) -> None:
    cfg = job(
        DEFER_8,
        placement__defer_roles=["genrm"],
        roles__rollout__models__policy=model(4, 2),
        roles__genrm__models__judge=model(4, 2),
        roles__teacher__models__math=model(4, 2),
    )
    plan = plan_inference_placement(cfg, roles_plugin_manager)
    assert plan.phases == ("generation", "genrm", "resident")
    assert plan.model_placement("teacher", "math").bundle_start == 4
    assert plan.model_placement("genrm", "judge").bundle_start == 0


DECOUPLED_16 = copy.deepcopy(SPLIT_8)
DECOUPLED_16["cluster"]["num_nodes"] = 2
DECOUPLED_16["training"] = {"actor_gpus": 8}
DECOUPLED_16["placement"] = {"mode": "decoupled"}


def test_decoupled_gives_each_role_its_own_pool_from_bundle_zero(
    roles_plugin_manager: PluginManager,
) -> None:
    plan = plan_inference_placement(job(DECOUPLED_16), roles_plugin_manager)
    sizes = {p.name: (p.size, p.inference, p.nodes) for p in plan.pools}
    assert sizes == {
        "actor": (8, False, (0,)),
        "rollout": (4, True, (1,)),
        "genrm": (2, True, (1,)),
        "teacher": (2, True, (1,)),
    }
    for p in plan.placements:
        assert (p.pool, p.bundle_start) == (p.role, 0)
    assert plan.total_gpus == 16
    text = rows(render_plan(plan, titles=role_titles(roles_plugin_manager)))
    assert "Rollout: R R R R" in text and "GenRM:   G G" in text


def test_a_sixteen_gpu_replica_spans_two_whole_eight_gpu_nodes(
    roles_plugin_manager: PluginManager,
) -> None:
    cfg = parse_config(
        {
            "cluster": {"num_nodes": 4, "gpus_per_node": 8, "gpu_memory_gib": 80},
            "placement": {"mode": "decoupled"},
            "roles": {"rollout": {"models": {"big": model(32, 16, tp=8, pp=2)}}},
        }
    )
    plan = plan_inference_placement(cfg, roles_plugin_manager)
    big = plan.model_placement("rollout", "big")
    assert big.replicas == (tuple(range(16)), tuple(range(16, 32)))
    assert big.workers == (
        (tuple(range(8)), tuple(range(8, 16))),
        (tuple(range(16, 24)), tuple(range(24, 32))),
    )
    assert big.nodes_per_engine == 2
    assert plan.pool("rollout").nodes == (0, 1, 2, 3)
    assert len(plan.bundle_specs("rollout")) == 32
    assert plan.bundle_specs("rollout")[0] == {"GPU": 1.0, "CPU": 1.0}


def test_cpu_models_are_planned_without_a_pool(roles_plugin_manager: PluginManager) -> None:
    cfg = parse_config(
        {
            "roles": {
                "genrm": {
                    "models": {
                        "j": {
                            "backend": "hf",
                            "model_path": "/m",
                            "device": "cpu",
                            "num_engines": 2,
                        }
                    }
                }
            }
        }
    )
    plan = plan_inference_placement(cfg, roles_plugin_manager)
    j = plan.model_placement("genrm", "j")
    assert (j.pool, j.device, j.num_engines, plan.total_gpus) == (None, "cpu", 2, 0)


def test_a_plan_round_trips_through_json(roles_plugin_manager: PluginManager) -> None:
    plan = plan_inference_placement(job(DEFER_8), roles_plugin_manager)
    again = InferencePlacementPlan.from_dict(json.loads(plan.to_json()))
    assert again == plan
    data = plan.to_dict()
    assert {"mode", "total_gpus", "placements", "memory"} <= set(data)
    assert set(data["placements"][0]) >= {
        "role",
        "model",
        "pool",
        "bundle_start",
        "num_gpus",
        "gpus_per_engine",
        "phase",
    }


def test_unknown_plan_lookups_name_what_exists(roles_plugin_manager: PluginManager) -> None:
    plan = plan_inference_placement(job(), roles_plugin_manager)
    with pytest.raises(KeyError, match=r"rollout\.policy"):
        plan.model_placement("rollout", "nope")
    with pytest.raises(KeyError, match="actor"):
        plan.pool("nope")


def test_auto_placement_fills_around_an_explicit_slice(roles_plugin_manager: PluginManager) -> None:
    plan = plan_inference_placement(
        job(roles__genrm__models__judge=model(2, 2, bundle_start=0)), roles_plugin_manager
    )
    starts = {p.role: p.bundle_start for p in plan.placements}
    assert starts == {"genrm": 0, "rollout": 2, "teacher": 6}


def test_every_violation_is_reported_not_just_the_first(
    roles_plugin_manager: PluginManager,
) -> None:
    cfg = job(
        roles__genrm__models__judge=model(2, 2, tp=3),
        roles__rollout__models__policy=model(3, 2),
        training__offload=False,
    )
    result = preflight(cfg, roles_plugin_manager)
    rules = {v.rule for v in result.violations}
    assert {"tp-pp", "divisibility", "offload-required"} <= rules


# -- one test per rejection rule ---------------------------------------------------------------


def test_rejects_tp_times_pp_different_from_gpus_per_engine(
    roles_plugin_manager: PluginManager,
) -> None:
    msg = rejects(
        job(roles__genrm__models__judge=model(2, 2, tp=3)),
        roles_plugin_manager,
        "roles.genrm.models.judge.tp",
        "tp-pp",
    )
    assert "tp 3 x pp 1 = 3" in msg and "gpus_per_engine = 2" in msg


def test_rejects_num_gpus_not_divisible_by_engine_size(roles_plugin_manager: PluginManager) -> None:
    msg = rejects(
        job(roles__rollout__models__policy=model(3, 2)),
        roles_plugin_manager,
        "roles.rollout.models.policy.num_gpus",
        "divisibility",
    )
    assert "1.5 engines" in msg


def test_rejects_dp_without_dp_attention(roles_plugin_manager: PluginManager) -> None:
    rejects(
        job(roles__genrm__models__judge=model(2, 2, dp=2)),
        roles_plugin_manager,
        "roles.genrm.models.judge.dp",
        "dp-attention",
    )


def test_rejects_dp_attention_when_tp_is_not_divisible_by_dp(
    roles_plugin_manager: PluginManager,
) -> None:
    msg = rejects(
        job(roles__genrm__models__judge=model(2, 2, dp=3, dp_attention=True)),
        roles_plugin_manager,
        "roles.genrm.models.judge.dp",
        "dp-attention",
    )
    assert "tp 2" in msg and "dp 3" in msg


def test_rejects_a_cross_node_engine_that_is_not_whole_nodes(
    roles_plugin_manager: PluginManager,
) -> None:
    cfg = job(
        DECOUPLED_16,
        training=DROP,
        roles__rollout__models__policy=model(12, 12),
    )
    msg = rejects(
        cfg, roles_plugin_manager, "roles.rollout.models.policy.gpus_per_engine", "whole-nodes"
    )
    assert "12 GPUs" in msg and "multiple of 8" in msg


def test_rejects_an_engine_that_straddles_a_node_boundary(
    roles_plugin_manager: PluginManager,
) -> None:
    cfg = job(
        cluster__num_nodes=2,
        cluster__gpus_per_node=4,
        roles__rollout__models__policy=model(2, 2, bundle_start=3),
    )
    msg = rejects(
        cfg, roles_plugin_manager, "roles.rollout.models.policy.bundle_start", "node-boundary"
    )
    assert "slice 3-4" in msg


def test_rejects_a_cross_node_engine_that_does_not_start_on_a_node(
    roles_plugin_manager: PluginManager,
) -> None:
    cfg = job(
        cluster__num_nodes=4,
        cluster__gpus_per_node=4,
        training__actor_gpus=16,
        roles__rollout__models__policy=model(8, 8, bundle_start=2),
    )
    rejects(cfg, roles_plugin_manager, "roles.rollout.models.policy.bundle_start", "node-boundary")


def test_rejects_a_role_budget_its_models_do_not_add_up_to(
    roles_plugin_manager: PluginManager,
) -> None:
    cfg = job(roles__genrm__num_gpus=4)
    msg = rejects(cfg, roles_plugin_manager, "roles.genrm.num_gpus", "role-budget")
    assert "budget of 4" in msg and "judge 2" in msg


def test_rejects_colocate_with_a_mode_that_keeps_inference_apart(
    roles_plugin_manager: PluginManager,
) -> None:
    cfg = job(DECOUPLED_16, training__colocate=True)
    rejects(cfg, roles_plugin_manager, "training.colocate", "colocate-mode")


def test_rejects_a_shared_placement_without_training_offload(
    roles_plugin_manager: PluginManager,
) -> None:
    msg = rejects(
        job(training__offload=False), roles_plugin_manager, "training.offload", "offload-required"
    )
    assert "training.offload = true" in msg


def test_rejects_a_shared_mode_without_an_actor_pool(roles_plugin_manager: PluginManager) -> None:
    cfg = job(training__actor_gpus=0, training__colocate=DROP)
    rejects(cfg, roles_plugin_manager, "training.actor_gpus", "actor-pool")


def test_rejects_defer_roles_in_a_mode_that_does_not_defer(
    roles_plugin_manager: PluginManager,
) -> None:
    cfg = job(placement__defer_roles=["genrm"])
    rejects(cfg, roles_plugin_manager, "placement.defer_roles", "defer-mode")


def test_rejects_deferring_rollout(roles_plugin_manager: PluginManager) -> None:
    cfg = job(DEFER_8, placement__defer_roles=["genrm", "rollout"])
    msg = rejects(cfg, roles_plugin_manager, "placement.defer_roles[1]", "defer-role")
    assert "'rollout' cannot be deferred" in msg


def test_rejects_defer_mode_with_nothing_deferred(roles_plugin_manager: PluginManager) -> None:
    cfg = job(DEFER_8, placement__defer_roles=[])
    rejects(cfg, roles_plugin_manager, "placement.defer_roles", "defer-roles")


def test_rejects_split_slices_that_do_not_fit_in_the_actor_pool(
    roles_plugin_manager: PluginManager,
) -> None:
    cfg = job(roles__rollout__models__policy=model(8, 2))
    msg = rejects(cfg, roles_plugin_manager, "roles.genrm.models.judge", "no-room")
    assert "pool 'actor' (8 bundles)" in msg


def test_rejects_an_explicit_split_slice_outside_the_actor_pool(
    roles_plugin_manager: PluginManager,
) -> None:
    cfg = job(roles__genrm__models__judge=model(2, 2, bundle_start=8))
    msg = rejects(cfg, roles_plugin_manager, "roles.genrm.models.judge.bundle_start", "pool-bounds")
    assert "slice 8-9" in msg and "training.actor_gpus = 8" in msg


def test_rejects_overlapping_split_slices_as_same_phase_co_residence(
    roles_plugin_manager: PluginManager,
) -> None:
    cfg = job(
        roles__rollout__models__policy=model(4, 2, bundle_start=0),
        roles__genrm__models__judge=model(2, 2, bundle_start=2),
    )
    msg = rejects(
        cfg, roles_plugin_manager, "roles.genrm.models.judge.bundle_start", "co-residence"
    )
    assert "bundles 2-3" in msg and "roles.rollout.models.policy" in msg
    assert "defer_roles" in msg


def test_rejects_two_models_of_one_deferred_phase_on_the_same_bundles(
    roles_plugin_manager: PluginManager,
) -> None:
    cfg = job(
        DEFER_8,
        roles__genrm__models={"a": model(4, 2, bundle_start=0), "b": model(4, 2, bundle_start=2)},
    )
    msg = rejects(cfg, roles_plugin_manager, "roles.genrm.models.b.bundle_start", "co-residence")
    assert "phase 'genrm'" in msg


def test_rejects_ray_gpu_reservations_above_one_gpu_per_bundle(
    roles_plugin_manager: PluginManager,
) -> None:
    cfg = job(DEFER_8, roles__teacher__models__math=model(8, 2, ray_gpu_fraction=0.5))
    msg = rejects(
        cfg, roles_plugin_manager, "roles.teacher.models.math.ray_gpu_fraction", "ray-gpu-fraction"
    )
    assert "1.3 Ray GPUs" in msg and "training actor 0.4" in msg


def test_rejects_pools_that_need_more_gpus_than_the_cluster_has(
    roles_plugin_manager: PluginManager,
) -> None:
    cfg = job(DECOUPLED_16, cluster__num_nodes=1)
    msg = rejects(cfg, roles_plugin_manager, "cluster", "gpu-budget")
    assert "needs 16 GPUs" in msg and "has 8" in msg


def test_rejects_pools_that_cannot_be_packed_onto_nodes(
    roles_plugin_manager: PluginManager,
) -> None:
    cfg = job(
        DECOUPLED_16,
        training=DROP,
        roles__rollout__models__policy=model(6, 2),
        roles__genrm__models__judge=model(6, 2),
        roles__teacher__models__math=model(4, 2),
    )
    msg = rejects(cfg, roles_plugin_manager, "cluster", "node-fit")
    assert "no node has 4 free GPUs" in msg


def test_rejects_gpu_models_on_a_cluster_without_gpus(roles_plugin_manager: PluginManager) -> None:
    cfg = job(cluster__gpus_per_node=0)
    rejects(cfg, roles_plugin_manager, "cluster.gpus_per_node", "gpu-budget")


def test_rejects_an_unknown_mode_with_a_hint(roles_plugin_manager: PluginManager) -> None:
    msg = rejects(
        job(placement__mode="splt"), roles_plugin_manager, "placement.mode", "unknown-mode"
    )
    assert "did you mean 'split'?" in msg


def test_rejects_an_unknown_weight_source(roles_plugin_manager: PluginManager) -> None:
    cfg = job(roles__genrm__models__judge=model(2, 2, weight_source="S3"))
    rejects(cfg, roles_plugin_manager, "roles.genrm.models.judge.weight_source", "weight-source")


def test_rejects_a_weight_source_the_role_does_not_allow() -> None:
    def roles(register: Callable[[RoleSpec], None]) -> None:
        register(
            RoleSpec(
                name="genrm",
                allowed_weight_sources={"STATIC"},
                default_route_mode="DIRECT",
                deferrable=True,
            )
        )

    pm = PluginManager.create(
        entry_points=False, plugins=[("roles", module_plugin("roles", relax_register_roles=roles))]
    )
    cfg = job(roles__genrm__models__judge=model(2, 2, weight_source="ACTOR"))
    msg = rejects(cfg, pm, "roles.genrm.models.judge.weight_source", "weight-source")
    assert "'ACTOR'" in msg


def test_rejects_an_unregistered_routing_policy(roles_plugin_manager: PluginManager) -> None:
    rejects(job(roles__genrm__policy="nope"), roles_plugin_manager, "roles.genrm.policy", "policy")


# -- roles are known only from their records ---------------------------------------------------


def _roles_pm(*specs: RoleSpec) -> PluginManager:
    return registering("roles", "relax_register_roles", *specs)


def test_rejects_a_role_no_plugin_registers_suggesting_the_close_one(
    roles_plugin_manager: PluginManager,
) -> None:
    data = copy.deepcopy(SPLIT_8)
    data["roles"]["genrn"] = data["roles"].pop("genrm")
    msg = rejects(parse_config(data), roles_plugin_manager, "roles.genrn", "unknown-role")
    assert "did you mean 'genrm'?" in msg and "registered: genrm, rollout, teacher" in msg


def test_without_role_plugins_no_role_is_known(core_plugin_manager: PluginManager) -> None:
    result = preflight(job(), core_plugin_manager)
    assert result.plan is None
    assert {(v.path, v.rule) for v in result.violations} == {
        (f"roles.{name}", "unknown-role") for name in ("rollout", "genrm", "teacher")
    }


def test_defer_phases_follow_the_role_records_not_their_names() -> None:
    # Third-party roles: "sampler" generates the batch, "critic" and "judge" may be deferred.
    pm = _roles_pm(
        RoleSpec(
            name="sampler",
            allowed_weight_sources={"ACTOR"},
            default_route_mode="DIRECT",
            default_weight_source="ACTOR",
            generation_phase=True,
        ),
        RoleSpec(name="critic", allowed_weight_sources={"STATIC"}, default_route_mode="DIRECT"),
        RoleSpec(
            name="judge",
            allowed_weight_sources={"STATIC"},
            default_route_mode="DIRECT",
            deferrable=True,
        ),
    )
    data = {
        **copy.deepcopy(DEFER_8),
        "placement": {"mode": "defer", "defer_roles": ["judge"]},
        "roles": {
            "sampler": {"models": {"s": model(4, 2)}},
            "critic": {"models": {"c": model(4, 2)}},
            "judge": {"models": {"j": model(4, 2)}},
        },
    }
    plan = plan_inference_placement(parse_config(data), pm)
    got = {(p.role, p.bundle_start, p.phase) for p in plan.placements}
    assert got == {("sampler", 0, "generation"), ("judge", 0, "judge"), ("critic", 4, "resident")}
    # The critic's record does not make it deferrable.
    data["placement"]["defer_roles"] = ["judge", "critic"]
    msg = rejects(parse_config(data), pm, "placement.defer_roles[1]", "defer-role")
    assert "'critic' cannot be deferred" in msg and "(installed: judge)" in msg


def test_slices_follow_the_roles_in_file_order(roles_plugin_manager: PluginManager) -> None:
    data = copy.deepcopy(SPLIT_8)
    data["roles"] = {name: data["roles"][name] for name in ("teacher", "genrm", "rollout")}
    plan = plan_inference_placement(parse_config(data), roles_plugin_manager)
    got = {p.role: (p.bundle_start, p.num_gpus) for p in plan.placements}
    assert got == {"teacher": (0, 2), "genrm": (2, 2), "rollout": (4, 4)}


def test_the_bundle_map_names_each_role_by_its_records_title() -> None:
    pm = _roles_pm(
        RoleSpec(
            name="prm-v2",
            allowed_weight_sources={"STATIC"},
            default_route_mode="DIRECT",
            title="Step scorer",
        ),
        RoleSpec(name="critic", allowed_weight_sources={"STATIC"}, default_route_mode="DIRECT"),
    )
    data = {
        **copy.deepcopy(SPLIT_8),
        "roles": {
            "prm-v2": {"models": {"m": model(4, 2)}},
            "critic": {"models": {"c": model(4, 2)}},
        },
    }
    plan = plan_inference_placement(parse_config(data), pm)
    text = rows(render_plan(plan, titles=role_titles(pm)))
    assert "Step scorer: S S S S . . . ." in text
    assert "Critic:      . . . . C C C C" in text
    # Without titles each role is shown by its name, capitalised.
    assert "Prm-v2: P P P P . . . ." in rows(render_plan(plan))


# -- placement modes are plugins ---------------------------------------------------------------


def _packed(ctx: ModeContext) -> ModeResult:
    """A third-party mode: every model in one pool of its own, back to back."""
    slices, cursor = [], 0
    for d in ctx.demands:
        slices.append(Slice(d.role, d.model, "packed", cursor))
        cursor += d.num_gpus
    from relax_core.placement import PoolRequest

    return ModeResult(tuple(slices), (PoolRequest("packed", cursor),))


def _mode_pm(mode: PlacementMode) -> PluginManager:
    def register(register: Callable[[PlacementMode], None]) -> None:
        register(mode)

    plugin = module_plugin("modes", relax_register_placement_modes=register)
    return builtin_roles(("modes", plugin))


def test_a_third_party_placement_mode_is_used_through_the_plugin_manager() -> None:
    pm = _mode_pm(PlacementMode(name="packed", assign=_packed))
    plan = plan_inference_placement(job(DECOUPLED_16, training=DROP, placement__mode="packed"), pm)
    assert [p.name for p in plan.pools] == ["packed"]
    assert {p.role: p.bundle_start for p in plan.placements} == {
        "rollout": 0,
        "genrm": 4,
        "teacher": 6,
    }


def test_a_placement_mode_that_crashes_is_reported_as_a_mode_error() -> None:
    def broken(ctx: ModeContext) -> ModeResult:
        raise ZeroDivisionError("oops")

    pm = _mode_pm(PlacementMode(name="broken", assign=broken))
    msg = rejects(
        job(DECOUPLED_16, training=DROP, placement__mode="broken"),
        pm,
        "placement.mode",
        "mode-error",
    )
    assert "ZeroDivisionError: oops" in msg


def test_the_core_registers_decoupled_split_and_defer(core_plugin_manager: PluginManager) -> None:
    modes = core_plugin_manager.registered("placement_modes")
    assert {"decoupled", "split", "defer"} <= set(modes)
    assert modes["defer"].plugin == "relax-core"
    assert modes["defer"].record.supports_defer and modes["split"].record.shares_training_pool

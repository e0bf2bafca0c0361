"""The memory budget: parameter and KV-cache arithmetic, and the budget's verdicts per GPU/node."""

from __future__ import annotations

import copy
import json
from pathlib import Path
from typing import Any

import attrs
import pytest
from relax_bench.manager import launch_sim

from relax_core import ControlClient, EngineBackend
from relax_core.config import parse_config
from relax_core.placement import (
    ModelFacts,
    count_parameters,
    kv_bytes_per_token,
    plan_inference_placement,
    preflight,
)
from relax_core.plugins import PluginManager, module_plugin
from tests.support.roles import builtin_roles

GIB = 1024**3

# Shapes of two public checkpoints (only their config.json numbers; no weights involved).
QWEN2_7B = {
    "model_type": "qwen2",
    "hidden_size": 3584,
    "intermediate_size": 18944,
    "num_hidden_layers": 28,
    "num_attention_heads": 28,
    "num_key_value_heads": 4,
    "vocab_size": 152064,
    "tie_word_embeddings": False,
    "torch_dtype": "bfloat16",
    "max_position_embeddings": 32768,
}
LLAMA3_8B = {
    "model_type": "llama",
    "hidden_size": 4096,
    "intermediate_size": 14336,
    "num_hidden_layers": 32,
    "num_attention_heads": 32,
    "num_key_value_heads": 8,
    "vocab_size": 128256,
    "tie_word_embeddings": False,
    "torch_dtype": "bfloat16",
}


def test_parameter_count_matches_published_checkpoints() -> None:
    assert count_parameters(QWEN2_7B) == 7_615_616_512
    assert count_parameters(LLAMA3_8B) == 8_030_261_248


def test_tied_embeddings_are_counted_once() -> None:
    tied = {**LLAMA3_8B, "tie_word_embeddings": True}
    assert count_parameters(LLAMA3_8B) - count_parameters(tied) == 128256 * 4096


def test_a_multimodal_config_is_counted_from_its_text_config() -> None:
    assert count_parameters({"model_type": "qwen2_vl", "text_config": LLAMA3_8B}) == 8_030_261_248


def test_kv_bytes_per_token_shard_by_tp_and_replicate_below_one_head() -> None:
    facts = ModelFacts(1, 28, 4, 128, 2, None, "test")
    assert kv_bytes_per_token(facts, tp=1, pp=1, kv_bytes=2) == 2 * 28 * 4 * 128 * 2
    assert kv_bytes_per_token(facts, tp=2, pp=1, kv_bytes=2) == 2 * 28 * 2 * 128 * 2
    # 4 KV heads over 8 ranks: each rank still holds one head.
    assert kv_bytes_per_token(facts, tp=8, pp=1, kv_bytes=2) == 2 * 28 * 1 * 128 * 2
    assert kv_bytes_per_token(facts, tp=1, pp=2, kv_bytes=1) == 2 * 14 * 4 * 128 * 1


@pytest.fixture
def models(tmp_path: Path) -> Path:
    for name, cfg in (("qwen", QWEN2_7B), ("llama", LLAMA3_8B)):
        (tmp_path / name).mkdir()
        (tmp_path / name / "config.json").write_text(json.dumps(cfg))
    return tmp_path


def split_job(models: Path, **rollout: Any) -> dict[str, Any]:
    def m(n: int, gpe: int, **extra: Any) -> dict[str, Any]:
        return {
            "backend": "sglang",
            "model_path": str(models / "qwen"),
            "num_gpus": n,
            "gpus_per_engine": gpe,
            "tp": gpe,
            **extra,
        }

    return {
        "cluster": {
            "num_nodes": 1,
            "gpus_per_node": 8,
            "gpu_memory_gib": 80,
            "host_memory_gib": 512,
        },
        "training": {
            "actor_gpus": 8,
            "colocate": True,
            "offload": True,
            "offload_resident_gib": 2.5,
        },
        "placement": {"mode": "split"},
        "roles": {
            "rollout": {"models": {"policy": m(4, 2, mem_fraction_static=0.8, **rollout)}},
            "genrm": {"models": {"judge": m(2, 2, mem_fraction_static=0.7)}},
            "teacher": {"models": {"math": m(2, 2, max_running_requests=16, context_length=8192)}},
        },
    }


def violation(data: dict[str, Any], pm: PluginManager, path: str, rule: str) -> str:
    result = preflight(parse_config(data), pm)
    hits = [v for v in result.violations if (v.path, v.rule) == (path, rule)]
    assert hits and result.plan is None, [str(v) for v in result.violations]
    return hits[0].message


def test_an_accepted_plan_carries_the_budget_per_gpu(
    models: Path, roles_plugin_manager: PluginManager
) -> None:
    plan = plan_inference_placement(parse_config(split_job(models)), roles_plugin_manager)
    budget = {(m.role, m.model): m for m in plan.memory}
    policy = budget["rollout", "policy"]
    assert policy.status == "ok" and policy.capacity_gib == 80 and policy.bundles == (0, 4)
    labels = [i.label for i in policy.items]
    assert labels[0].startswith("static pool") and "CUDA graphs" in labels
    assert "training actor (offloaded, resident)" in labels
    assert policy.total_gib == pytest.approx(0.8 * 80 + 1.0 + 2.5)
    math = budget["teacher", "math"]
    weights = 7_615_616_512 * 2 / 2 / GIB
    kv = 2 * 28 * 2 * 128 * 2 * 8192 * 16 / GIB
    assert [i.gib for i in math.items] == pytest.approx([weights, kv, 1.0, 2.5])


def test_rejects_an_engine_whose_gpu_memory_users_exceed_the_gpu(
    models: Path, roles_plugin_manager: PluginManager
) -> None:
    data = split_job(models)
    math = data["roles"]["teacher"]["models"]["math"]
    # KV: 2 x 28 layers x 2 heads/GPU x 128 x 2 B = 28 KiB/token; x 32768 x 64 = 56 GiB: fits.
    math.update(max_running_requests=64, context_length=32768)
    plan = plan_inference_placement(parse_config(data), roles_plugin_manager)
    entry = next(m for m in plan.memory if m.role == "teacher")
    assert entry.total_gib == pytest.approx(7_615_616_512 / GIB + 56 + 1 + 2.5)
    math.update(max_running_requests=128)  # 112 GiB of KV cache: does not
    msg = violation(data, roles_plugin_manager, "roles.teacher.models.math", "memory-gpu")
    assert "needs 122.6 GiB per GPU on bundles 6-7 of pool 'actor'" in msg
    assert "KV cache (128 requests x 32768 tokens) 112.0" in msg
    assert "training actor (offloaded, resident) 2.5" in msg and "has 80 GiB" in msg


def test_rejects_a_static_fraction_too_small_for_the_weights(
    models: Path, roles_plugin_manager: PluginManager
) -> None:
    data = split_job(models)
    data["roles"]["genrm"]["models"]["judge"].update(mem_fraction_static=0.05)
    msg = violation(
        data, roles_plugin_manager, "roles.genrm.models.judge.mem_fraction_static", "memory-static"
    )
    assert "7.1 GiB" in msg and "0.05 x 80 GiB = 4.0 GiB" in msg


def test_rejects_cpu_weight_backups_beyond_node_ram(
    models: Path, roles_plugin_manager: PluginManager
) -> None:
    data = split_job(models)
    data["cluster"]["host_memory_gib"] = 20
    msg = violation(data, roles_plugin_manager, "cluster.host_memory_gib", "memory-host")
    # genrm and teacher are STATIC: each keeps a CPU copy of its 2 x 7.1 GiB shards.
    assert "node(s) 0 each need 28.4 GiB" in msg
    assert "roles.genrm.models.judge CPU weight backup 14.2" in msg
    assert "roles.teacher.models.math CPU weight backup 14.2" in msg
    # A STATIC model that releases its weights cannot do without its copy: asking it to is refused
    # (the engines would keep one anyway), ...
    math = data["roles"]["teacher"]["models"]["math"]
    math["weights_cpu_backup"] = False
    path = "roles.teacher.models.math.weights_cpu_backup"
    msg = violation(data, roles_plugin_manager, path, "weight-source")
    assert "'STATIC' cannot bring back released weights" in msg and "offload_weights" in msg
    # ... keeping its weights on the GPU while it sleeps drops it.
    math["offload_weights"] = False
    plan = plan_inference_placement(parse_config(data), roles_plugin_manager)
    assert [h.total_gib for h in plan.host_memory] == pytest.approx([7_615_616_512 * 2 / GIB])
    assert [i.label for i in plan.host_memory[0].items] == [
        "roles.genrm.models.judge CPU weight backup"
    ]
    # A source with an update path keeps a copy only when asked: the rollout's adds its own.
    data["roles"]["rollout"]["models"]["policy"]["weights_cpu_backup"] = True
    msg = violation(data, roles_plugin_manager, "cluster.host_memory_gib", "memory-host")
    assert "roles.rollout.models.policy CPU weight backup" in msg and "math" not in msg


def test_offloaded_training_state_counts_against_host_memory(
    models: Path, roles_plugin_manager: PluginManager
) -> None:
    data = split_job(models)
    data["training"]["offload_host_gib"] = 70.0  # per GPU: 8 x 70 = 560 > 512
    msg = violation(data, roles_plugin_manager, "cluster.host_memory_gib", "memory-host")
    assert "training actor offloaded state 560.0" in msg


def test_the_budget_is_skipped_with_the_reason_when_config_json_is_missing(
    models: Path, roles_plugin_manager: PluginManager
) -> None:
    data = split_job(models)
    data["roles"]["rollout"]["models"]["policy"]["model_path"] = str(models / "absent")
    plan = plan_inference_placement(parse_config(data), roles_plugin_manager)
    entry = next(m for m in plan.memory if m.role == "rollout")
    assert entry.status == "skipped"
    assert f"no config.json at {models / 'absent' / 'config.json'}" in entry.note
    assert "num_parameters" in entry.note


def test_num_parameters_budgets_the_weights_without_a_config(
    models: Path, roles_plugin_manager: PluginManager
) -> None:
    data = split_job(models, num_parameters=70_000_000_000)
    data["roles"]["rollout"]["models"]["policy"]["model_path"] = str(models / "absent")
    msg = violation(
        data,
        roles_plugin_manager,
        "roles.rollout.models.policy.mem_fraction_static",
        "memory-static",
    )
    assert "65.2 GiB" in msg


def test_a_kv_budget_needs_the_model_shape(
    models: Path, roles_plugin_manager: PluginManager
) -> None:
    data = split_job(models)
    math = data["roles"]["teacher"]["models"]["math"]
    math.update(model_path=str(models / "absent"), num_parameters=7_000_000_000)
    plan = plan_inference_placement(parse_config(data), roles_plugin_manager)
    entry = next(m for m in plan.memory if m.role == "teacher")
    assert entry.status == "skipped" and "set mem_fraction_static" in entry.note


def test_the_gpu_budget_is_skipped_without_gpu_memory(
    models: Path, roles_plugin_manager: PluginManager
) -> None:
    data = copy.deepcopy(split_job(models))
    del data["cluster"]["gpu_memory_gib"]
    plan = plan_inference_placement(parse_config(data), roles_plugin_manager)
    assert {m.status for m in plan.memory} == {"skipped"}
    assert {m.note for m in plan.memory} == {"cluster.gpu_memory_gib is not set"}


def test_an_unreadable_config_json_is_reported(
    models: Path, roles_plugin_manager: PluginManager
) -> None:
    (models / "qwen" / "config.json").write_text("{not json")
    plan = plan_inference_placement(parse_config(split_job(models)), roles_plugin_manager)
    notes = {m.note for m in plan.memory}
    assert any("cannot read" in n and "config.json" in n for n in notes)


def test_weights_kept_while_asleep_are_budgeted_in_every_other_phase_of_their_gpus(
    models: Path, roles_plugin_manager: PluginManager
) -> None:
    # A defer layout: rollout on bundles 0-3, the judge (2 GPUs) and the teacher (2 GPUs) each in
    # their own phase on the same 8-GPU pool. The judge keeps its weights while it sleeps.
    data = split_job(models)
    data["placement"] = {"mode": "defer", "defer_roles": ["genrm", "teacher"]}
    judge = data["roles"]["genrm"]["models"]["judge"]
    judge["offload_weights"] = False
    plan = plan_inference_placement(parse_config(data), roles_plugin_manager)
    budget = {m.role: m for m in plan.memory}
    spans = {p.role: (p.bundle_start or 0, p.bundle_end, p.phase) for p in plan.placements}
    label = "roles.genrm.models.judge weights (kept while it sleeps)"
    shard = 7_615_616_512 * 2 / 2 / GIB  # bfloat16 over tp 2
    for role, entry in budget.items():
        kept = [i for i in entry.items if i.label == label]
        start, end, phase = spans[role]
        overlaps = start < spans["genrm"][1] and spans["genrm"][0] < end
        if role == "genrm" or not overlaps or phase == spans["genrm"][2]:
            assert kept == [], (role, entry.items)
        else:
            assert [(i.gib, i.kept) for i in kept] == [(pytest.approx(shard), True)], role
    assert any(label in [i.label for i in b.items] for b in plan.memory), spans
    # Kept resident beside a phase that has no room for it: refused, naming it.
    data["cluster"]["gpu_memory_gib"] = 80
    data["roles"]["rollout"]["models"]["policy"]["mem_fraction_static"] = 0.9
    judge["offload_weights"] = True
    assert preflight(parse_config(data), roles_plugin_manager).plan is not None
    judge["offload_weights"] = False
    msg = violation(data, roles_plugin_manager, "roles.rollout.models.policy", "memory-gpu")
    assert f"{label} {shard:.1f}" in msg


@attrs.frozen
class _KeeperOptions:
    handoff: bool = False


def _keeper(register: Any) -> None:
    # A backend whose engines keep their CUDA graphs while asleep with ``handoff`` (as hf's
    # --memory-handoff does), or with a ``--handoff`` flag among the extra args.
    register(
        EngineBackend(
            name="keeper",
            launch=launch_sim,
            control_client=ControlClient,
            options=_KeeperOptions,
            keeps_graphs=lambda o, extra: (o is not None and o.handoff) or "--handoff" in extra,
        )
    )


def test_cuda_graphs_a_backend_keeps_while_asleep_are_budgeted_in_the_other_phases(
    models: Path,
) -> None:
    pm = builtin_roles(("keeper", module_plugin("keeper", relax_register_engine_backends=_keeper)))
    data = split_job(models)
    data["placement"] = {"mode": "defer", "defer_roles": ["genrm", "teacher"]}
    judge, math = (
        data["roles"]["genrm"]["models"]["judge"],
        data["roles"]["teacher"]["models"]["math"],
    )
    judge.update(backend="keeper", engine={"handoff": True}, cuda_graph_gib=1.5)
    math.update(backend="keeper", extra_args=["--handoff"])

    def kept(role: str) -> list[tuple[str, float]]:
        plan = plan_inference_placement(parse_config(data), pm)
        entry = next(m for m in plan.memory if m.role == role)
        return [(i.label, i.gib) for i in entry.items if i.kept and "CUDA graphs" in i.label]

    judge_graphs = ("roles.genrm.models.judge CUDA graphs (kept while it sleeps)", 1.5)
    math_graphs = ("roles.teacher.models.math CUDA graphs (kept while it sleeps)", 1.0)
    assert kept("rollout") == [judge_graphs, math_graphs]
    assert kept("genrm") == [math_graphs] and kept("teacher") == [judge_graphs]
    # Without the handoff, or on a backend that does not say, nothing is kept.
    judge["engine"] = {"handoff": False}
    math.update(backend="sglang", extra_args=[])
    assert kept("rollout") == [] and kept("genrm") == []

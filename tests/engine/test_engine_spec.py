"""InferenceEngineSpec: what a STATIC, ACTOR or DCS engine may do, and the errors it gives."""

from __future__ import annotations

import pytest

from relax_core.builtins import ACTOR, DCS, STATIC
from relax_core.engine.spec import (
    GENERATION_OPERATIONS,
    LIFECYCLE_OPERATIONS,
    OPERATIONS,
    InferenceEngineSpec,
)
from relax_core.errors import CapabilityError
from relax_core.plugins import PluginManager
from relax_core.records import UPDATE_PATHS, RoleSpec, WeightSource


def test_static_spec_refuses_every_update_path_and_lora_naming_engine_and_source() -> None:
    spec = InferenceEngineSpec(role="genrm", weight_source=STATIC)
    for path in sorted(UPDATE_PATHS):
        with pytest.raises(CapabilityError) as info:
            spec.check(path, engine_id="judge/replica-0")
        message = str(info.value)
        assert "judge/replica-0" in message and "STATIC" in message and "genrm" in message
    assert "LoRA" in spec.refusal("lora", engine_id="e")


def test_static_spec_allows_generation_and_lifecycle() -> None:
    spec = InferenceEngineSpec(role="teacher", weight_source=STATIC)
    for op in sorted(GENERATION_OPERATIONS | LIFECYCLE_OPERATIONS):
        spec.check(op, engine_id="t/replica-0")
    assert spec.update_paths == frozenset()
    assert spec.is_static and not spec.publishes_version


def test_static_spec_always_keeps_a_cpu_weight_backup() -> None:
    assert InferenceEngineSpec(role="genrm", weight_source=STATIC).weights_cpu_backup is True
    assert InferenceEngineSpec(role="rollout", weight_source=ACTOR).weights_cpu_backup is False


def test_an_offload_releases_every_tag_unless_the_spec_keeps_the_weights() -> None:
    # What a manager's offload() releases when told no tags, and whether its weights are lost.
    rollout = InferenceEngineSpec(role="rollout", weight_source=ACTOR)
    assert rollout.offload_tags == {"weights", "kv_cache", "cuda_graph"}
    assert rollout.discards_weights
    kept = InferenceEngineSpec(role="rollout", weight_source=ACTOR, offload_weights=False)
    assert kept.offload_tags == {"kv_cache", "cuda_graph"} and not kept.discards_weights
    judge = InferenceEngineSpec(role="genrm", weight_source=STATIC)
    assert judge.offload_tags == {"weights", "kv_cache", "cuda_graph"}
    assert not judge.discards_weights  # its CPU backup brings them back
    # STATIC weights kept on the GPU need no CPU copy (unless asked for).
    kept_judge = InferenceEngineSpec(role="genrm", weight_source=STATIC, offload_weights=False)
    assert not kept_judge.weights_cpu_backup and not kept_judge.discards_weights
    asked = InferenceEngineSpec(
        role="genrm", weight_source=STATIC, offload_weights=False, weights_cpu_backup=True
    )
    assert asked.weights_cpu_backup
    # The one rule, where the planner's host-memory budget reads it too.
    assert [
        STATIC.cpu_backup(off, asked) for off in (True, False) for asked in (None, False, True)
    ] == [True, True, True, False, False, True]
    assert [ACTOR.cpu_backup(True, asked) for asked in (None, False, True)] == [False, False, True]


def test_static_spec_cannot_be_given_an_update_operation() -> None:
    with pytest.raises(ValueError, match=r"allowed_operations.*'tensor'.*STATIC"):
        InferenceEngineSpec(
            role="genrm", weight_source=STATIC, allowed_operations={"generate", "tensor"}
        )


def test_actor_spec_allows_tensor_distributed_and_disk_updates_and_publishes_version() -> None:
    spec = InferenceEngineSpec(role="rollout", weight_source=ACTOR)
    for path in ("tensor", "distributed", "disk"):
        spec.check(path, engine_id="policy/replica-0")
    assert spec.publishes_version


def test_restricted_actor_spec_refuses_what_it_leaves_out() -> None:
    spec = InferenceEngineSpec(
        role="rollout",
        weight_source=ACTOR,
        allowed_operations=GENERATION_OPERATIONS | LIFECYCLE_OPERATIONS | {"tensor"},
    )
    spec.check("tensor", engine_id="p")
    with pytest.raises(CapabilityError, match=r"'lora'.*allowed update paths: \['tensor'\]"):
        spec.check("lora", engine_id="p")


def test_dcs_spec_requires_a_checkpoint_dir() -> None:
    with pytest.raises(ValueError, match="checkpoint_dir"):
        InferenceEngineSpec(role="rollout", weight_source=DCS)
    spec = InferenceEngineSpec(role="rollout", weight_source=DCS, checkpoint_dir="ckpt")
    assert spec.update_paths == {"disk"} and spec.needs_checkpoint_dir
    with pytest.raises(CapabilityError):
        spec.check("tensor", engine_id="p")


def test_unknown_operation_is_rejected_with_the_known_list() -> None:
    with pytest.raises(ValueError, match="unknown operations"):
        InferenceEngineSpec(role="genrm", weight_source=STATIC, allowed_operations={"fly"})
    spec = InferenceEngineSpec(role="genrm", weight_source=STATIC)
    with pytest.raises(CapabilityError, match="unknown operation 'fly'"):
        spec.check("fly", engine_id="e")
    assert "generate" in OPERATIONS


def test_third_party_weight_source_from_the_plugin_manager_is_honoured(
    core_plugin_manager: PluginManager,
) -> None:
    s3 = WeightSource(name="S3CKPT", update_paths={"disk"}, publishes_version=False)
    spec = InferenceEngineSpec(role="teacher", weight_source=s3)
    spec.check("disk", engine_id="t")
    assert not spec.needs_checkpoint_dir
    static = core_plugin_manager.weight_source("STATIC")
    assert InferenceEngineSpec(role="genrm", weight_source=static).is_static


def test_for_role_rejects_a_weight_source_the_role_does_not_allow() -> None:
    genrm = RoleSpec(name="genrm", allowed_weight_sources={"STATIC"}, default_route_mode="DIRECT")
    assert InferenceEngineSpec.for_role(genrm, STATIC).role == "genrm"
    with pytest.raises(ValueError, match=r"role 'genrm' does not allow weight source 'ACTOR'"):
        InferenceEngineSpec.for_role(genrm, ACTOR)


def test_empty_role_is_rejected() -> None:
    with pytest.raises(ValueError, match="role"):
        InferenceEngineSpec(role="", weight_source=STATIC)

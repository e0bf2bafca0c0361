"""The defer preflight refuses, with key paths, what a deferred batch cannot stage; defer slices
come from the placement plan."""

from __future__ import annotations

import pytest

from relax_core.config import ConfigValidationError, loads_config
from relax_core.coordination import (
    DeferredWorkload,
    defer_slices,
    deferred_workload_problems,
    validate_deferred_workload,
)
from relax_core.placement import plan_inference_placement
from relax_core.plugins import PluginManager, module_plugin
from relax_core.records import RewardSpec


async def _remote_rm(response: str, label: str | None, *, context: object) -> float:
    return 0.0


def _plugins() -> PluginManager:
    def adapters(register: object) -> None:
        register(RewardSpec(name="remote-rm", fn=_remote_rm, mode="async"))  # type: ignore[operator]

    return PluginManager.create(
        plugins=[("remote", module_plugin("remote", relax_register_reward_adapters=adapters))]
    )


def test_a_stageable_workload_passes() -> None:
    workload = DeferredWorkload(
        defer_roles=("genrm", "teacher"),
        generation_models=("policy",),
        reward_adapters=("genrm-judge", "exact-match"),
        reward_role="genrm",
        reward_models=("judge",),
    )
    assert deferred_workload_problems(workload, PluginManager.create()) == []
    validate_deferred_workload(workload, PluginManager.create())


def test_every_unstageable_combination_is_refused_with_its_key_path() -> None:
    workload = DeferredWorkload(
        defer_roles=("genrm",),
        generation_models=("policy", "draft"),
        reward_adapters=("genrm-judge", "remote-rm", "no-such"),
        reward_role="genrm",
        reward_models=("judge", "judge-small"),
        partial_rollout=True,
        dynamic_batch=True,
        filter_hooks=("my_filter",),
        eval_data=True,
        paths={"reward_models": "roles.genrm.models"},
    )
    with pytest.raises(ConfigValidationError) as info:
        validate_deferred_workload(workload, _plugins())
    found = {(p.path, p.rule) for p in info.value.problems}
    assert found == {
        ("run.partial_rollout", "defer-unstageable"),
        ("run.dynamic_batch", "defer-unstageable"),
        ("run.filter_hooks", "defer-unstageable"),
        ("run.eval_data", "defer-unstageable"),
        ("run.generation_models", "defer-unstageable"),
        ("roles.genrm.models", "defer-unstageable"),
        ("run.reward_adapters[1]", "defer-adapter"),
        ("run.reward_adapters[2]", "plugin"),
    }
    text = str(info.value)
    assert "'remote-rm' (from remote) does not declare supports_deferred" in text
    assert "2 rollout groups (policy, draft)" in text
    assert "2 genrm models (judge, judge-small)" in text


def test_several_models_are_fine_when_the_reward_role_is_not_deferred() -> None:
    workload = DeferredWorkload(
        defer_roles=("teacher",), reward_role="genrm", reward_models=("a", "b")
    )
    assert deferred_workload_problems(workload, PluginManager.create()) == []


def test_defer_slices_group_the_roles_sharing_bundles() -> None:
    config = loads_config(
        """\
[cluster]
gpus_per_node = 8

[training]
actor_gpus = 8
colocate = true
offload = true

[placement]
mode = "defer"
defer_roles = ["genrm", "teacher"]

[roles.rollout.models.policy]
backend = "sglang"
model_path = "/m"
num_gpus = 8

[roles.genrm.models.judge]
backend = "sglang"
model_path = "/m"
num_gpus = 4

[roles.teacher.models.math]
backend = "sglang"
model_path = "/m"
num_gpus = 8
"""
    )
    plan = plan_inference_placement(config, PluginManager.create())
    assert defer_slices(plan) == {
        "genrm": "actor:0-7",
        "rollout": "actor:0-7",
        "teacher": "actor:0-7",
    }


def test_reward_spec_checks_its_fields_where_it_is_built() -> None:
    with pytest.raises(ValueError, match="mode='async' needs a coroutine function"):
        RewardSpec(name="x", fn=lambda r, label: 0.0, mode="async")
    with pytest.raises(ValueError, match="give mode='async'"):
        RewardSpec(name="x", fn=_remote_rm)
    with pytest.raises(ValueError, match="label_matcher=3: give a callable or None"):
        RewardSpec(name="x", fn=lambda r, label: 0.0, label_matcher=3)  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="pass_metadata"):
        RewardSpec(name="x", fn=lambda r, label: 0.0, pass_metadata="yes")  # type: ignore[arg-type]

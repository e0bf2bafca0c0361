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
from tests.support.jobs import colocated, defer, job_text, sglang


async def _remote_rm(response: str, label: str | None, *, context: object) -> float:
    return 0.0


def test_a_stageable_workload_passes() -> None:
    workload = DeferredWorkload(defer_roles=("genrm", "teacher"), generation_models=("policy",))
    assert deferred_workload_problems(workload) == []
    validate_deferred_workload(workload)


def test_what_still_has_no_stage_is_refused_with_its_key_path() -> None:
    workload = DeferredWorkload(
        defer_roles=("genrm",),
        generation_models=("policy", "draft"),
        partial_rollout=True,
        paths={"generation_models": "roles.rollout.models"},
    )
    with pytest.raises(ConfigValidationError) as info:
        validate_deferred_workload(workload)
    found = {(p.path, p.rule) for p in info.value.problems}
    assert found == {
        ("run.partial_rollout", "defer-unstageable"),
        ("roles.rollout.models", "defer-unstageable"),
    }
    assert "2 rollout groups (policy, draft)" in str(info.value)


def test_a_reward_stage_in_a_defer_layout_refuses_an_adapter_without_supports_deferred() -> None:
    from relax_core.run.config import RunConfig, StageTable
    from relax_core.run.stages import stage_problems

    def adapters(register: object) -> None:
        register(RewardSpec(name="remote-rm", fn=_remote_rm, mode="async"))  # type: ignore[operator]

    pm = PluginManager.create(
        plugins=[("remote", module_plugin("remote", relax_register_reward_adapters=adapters))]
    )
    rewards = [{"adapter": "genrm-judge"}, {"adapter": "remote-rm"}]
    run = RunConfig(stages=(StageTable("reward", "genrm", "genrm", (), {"rewards": rewards}),))
    assert stage_problems(run, pm) == []  # no defer layout: any adapter
    (problem,) = stage_problems(run, pm, deferred_roles=("genrm",))
    assert (problem.path, problem.rule) == ("run.rewards[1]", "defer-adapter")
    assert "'remote-rm' (from remote) does not declare supports_deferred" in problem.message


def test_defer_slices_group_the_roles_sharing_bundles() -> None:
    config = loads_config(
        job_text(
            **colocated(8),
            placement=defer("genrm", "teacher"),
            models={
                "rollout.policy": sglang("/m", num_gpus=8),
                "genrm.judge": sglang("/m", num_gpus=4),
                "teacher.math": sglang("/m", num_gpus=8),
            },
        )
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

"""Residency: from the placement's memory budget, which roles of a defer slice may be resident
together; the coordinator enforces it and a batch issues only the transitions it needs.

The batches here run on a real coordinator with in-process managers that confirm at once
(``relax_core.testing.run_stages``: the sequence of leases is the point, not engines; the same
sequence on real engines is in tests/run/test_residency_run.py)."""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from typing import Any

import pytest

from relax_core import PluginManager, Sample, StageContext, StageReport, loads_config
from relax_core.coordination import LifecycleCoordinator
from relax_core.coordination.residency import (
    ResidencyPlan,
    SliceResidency,
    defer_slices,
    plan_residency,
)
from relax_core.errors import CoordinationError
from relax_core.manager import LifecycleResult, Outcome, ReplicaResult
from relax_core.placement import plan_inference_placement
from relax_core.testing import run_stages
from tests.support.jobs import colocated, defer, hf, job_text


def _job(gib: float | None = 80, mode: str = "planned") -> str:
    """Three half-billion-parameter models on one declared GPU of ``gib`` GiB (None: not
    set), the judge's and the teacher's roles deferred, under residency ``mode``."""
    cluster = {} if gib is None else {"gpu_memory_gib": gib}
    return job_text(
        **colocated(1, **cluster),
        placement=defer("genrm", "teacher", residency=mode),
        models={
            "rollout.policy": hf(
                "/m", weight_source="ACTOR", num_parameters=500_000_000, mem_fraction_static=0.8
            ),
            "genrm.judge": hf("/m", num_parameters=500_000_000, mem_fraction_static=0.3),
            "teacher.math": hf("/m", num_parameters=500_000_000, mem_fraction_static=0.3),
        },
    )


def residency(gib: float = 80, mode: str = "planned") -> ResidencyPlan:
    config = loads_config(_job(gib, mode))
    plan = plan_inference_placement(config, PluginManager.create())
    slices = defer_slices(plan)
    return plan_residency(plan, slices, mode=config.placement.residency, roles=tuple(slices))


def test_two_judges_that_fit_beside_each_other_may_be_resident_together() -> None:
    # 0.3 x 80 + 1 GiB of CUDA graphs each, plus 1 GiB training keeps (once): 51 of 80 GiB.
    plan = residency()
    (s,) = plan.slices.values()
    assert s.groups() == [("genrm", "teacher"), ("rollout",)]
    assert plan.fits(s.slice, {"genrm", "teacher"})
    assert not plan.fits(s.slice, {"rollout", "genrm"})  # 0.8 + 0.3 of the GPU
    assert plan.describe() == ["actor:0-0: resident together: genrm + teacher | rollout"]


def test_without_a_gpu_size_or_under_exclusive_no_two_roles_share() -> None:
    unknown = residency(gib=80, mode="exclusive")
    (s,) = unknown.slices.values()
    assert not unknown.fits(s.slice, {"genrm", "teacher"})
    small = residency(gib=40)  # 0.3 x 40 x 2 + graphs + training: still fits; 0.8 x 40 alone
    (t,) = small.slices.values()
    assert small.fits(t.slice, {"genrm", "teacher"}) and not small.fits(
        t.slice, {"rollout", "genrm"}
    )
    config = loads_config(_job(gib=None))
    plan = plan_inference_placement(config, PluginManager.create())
    none = plan_residency(plan, defer_slices(plan), roles=("rollout", "genrm", "teacher"))
    (u,) = none.slices.values()
    assert u.capacity_gib is None and not none.fits(u.slice, {"genrm", "teacher"})
    assert "not budgeted, so alone: genrm: cluster.gpu_memory_gib is not set" in none.describe()[0]


def test_a_role_on_no_shared_gpu_never_switches_under_a_planned_residency_only() -> None:
    slices = {"rollout": "rollout:own", "genrm": "actor:0-0", "teacher": "actor:0-0"}
    config = loads_config(_job())
    plan = plan_inference_placement(config, PluginManager.create())
    assert plan_residency(plan, slices, roles=tuple(slices)).free == {"rollout"}
    assert plan_residency(plan, slices, mode="exclusive", roles=tuple(slices)).free == set()


def test_the_placement_table_refuses_an_unknown_residency() -> None:
    from relax_core import ConfigValidationError

    with pytest.raises(ConfigValidationError, match=r"placement.residency: \[choice\] must be one"):
        loads_config(_job(mode="shared"))


# -- the batch's transitions -----------------------------------------------------------------


class Judge:
    """A stage on a role that writes nothing (the leases are the point)."""

    models: tuple[str, ...] = ()
    fields = ()

    def __init__(self, role: str) -> None:
        self.name = self.role = role

    async def run(self, samples: Sequence[Sample], ctx: StageContext) -> StageReport:
        return StageReport(self.name)


def _samples() -> list[Sample]:
    return [Sample(f"g0-s{i}", "g0", [1], [2]) for i in range(2)]


def _run(plan: ResidencyPlan, stages: list[Any]) -> list[str]:
    _, _, log = asyncio.run(
        run_stages(_samples(), stages, residency=plan, generation_role="rollout")
    )
    return log


def _shared(**demand: float) -> ResidencyPlan:
    roles = ("genrm", "rollout", "teacher")
    slice_residency = SliceResidency(
        "shared", roles, 80.0, {r: {0: demand.get(r, 50.0)} for r in roles}
    )
    return ResidencyPlan({"shared": slice_residency}, mode="planned")


def test_judges_that_fit_together_switch_in_without_switching_out_in_between() -> None:
    log = _run(_shared(genrm=25, teacher=25, rollout=60), [Judge("genrm"), Judge("teacher")])
    assert log == [
        "rollout.offload",  # rollout does not fit beside the judges
        "genrm.model.onload",
        "teacher.model.onload",  # no genrm offload between the two stages
        "genrm.model.offload",
        "teacher.model.offload",  # both out before the commit
    ]


def test_roles_that_do_not_fit_take_turns_as_before() -> None:
    log = _run(_shared(), [Judge("genrm"), Judge("teacher")])
    assert log == [
        "rollout.offload", "genrm.model.onload", "genrm.model.offload",
        "teacher.model.onload", "teacher.model.offload",
    ]  # fmt: skip
    assert _run(ResidencyPlan(), [Judge("genrm"), Judge("teacher")]) == log  # exclusive


def test_a_rollout_that_fits_beside_the_judge_stays_awake_until_the_commit() -> None:
    log = _run(_shared(genrm=20, teacher=20, rollout=40), [Judge("genrm")])
    assert log == ["genrm.model.onload", "rollout.offload", "genrm.model.offload"]


def test_a_free_rollout_never_switches_and_its_batch_commits() -> None:
    plan = ResidencyPlan(
        {"shared": SliceResidency("shared", ("genrm", "teacher"), None, {})},
        free=frozenset({"rollout"}),
        mode="planned",
    )
    log = _run(plan, [Judge("genrm"), Judge("teacher")])
    assert log == [
        "genrm.model.onload", "genrm.model.offload", "teacher.model.onload",
        "teacher.model.offload",
    ]  # fmt: skip


def test_the_coordinator_refuses_an_activation_that_does_not_fit() -> None:
    log: list[str] = []

    class Handle:
        def __init__(self, name: str) -> None:
            self.name = name

        async def onload(self) -> LifecycleResult:
            log.append(f"{self.name}.onload")
            return LifecycleResult(
                "onload", self.name, (ReplicaResult("x", Outcome.DONE, "READY"),)
            )

        async def offload(self) -> LifecycleResult:
            return LifecycleResult(
                "offload", self.name, (ReplicaResult("x", Outcome.DONE, "SLEEPING"),)
            )

    c = LifecycleCoordinator(
        slices={"rollout": "shared", "genrm": "shared", "teacher": "shared"},
        managers={"genrm": [Handle("genrm.m")], "teacher": [Handle("teacher.m")]},
        generation_role="rollout",
        residency=_shared(genrm=30, teacher=60, rollout=20),
    )

    async def go() -> None:
        await c.begin_batch(0)
        await c.activate("genrm", "a", batch_id=0)  # rollout 20 + genrm 30 fit
        with pytest.raises(CoordinationError, match="still hold its GPUs"):
            await c.activate("teacher", "b", batch_id=0)  # + teacher 60 does not

    asyncio.run(go())
    assert log == ["genrm.m.onload"]

"""Residency in a real ``relax run`` (tiny hf models on CPU): a role switches only when memory
requires it.

- A rollout on no shared GPU (``device = "cpu"``) never switches: 0 onloads and offloads a step.
- A defer layout whose budget lets genrm and teacher be resident together but not beside
  rollout: rollout goes out once, genrm and teacher come in one after the other with no switch
  between them, both go out before the commit. (Without a GPU size the budget is not known and
  the roles take turns as before: ``tests/run/test_run_cli.py`` runs that job.)

The models' sizes for the budget come from ``num_parameters`` (the planner's override: the
engines are the tiny models, whose checkpoints are float32), so the budget's arithmetic is that
of a 14B policy (52 GiB) and two 7B judges (26 GiB each) on one 80 GiB GPU: the judges fit
together, neither fits beside the policy.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from tests.support import run as support
from tests.support.jobs import colocated, defer, hf, job_text, tiny, tiny_policy, tiny_run

CPU_ROLLOUT = job_text(
    models={
        "rollout.policy": hf(
            "tiny/policy", device="cpu", weight_source="ACTOR", weights_cpu_backup=True
        )
    },
    run=tiny_run(rewards=[{"adapter": "digits"}]),
)

#: Each model's size for the budget, and its engine's limits.
_14B = {"num_parameters": 14_000_000_000, "max_running_requests": 4, "context_length": 256}
_7B = {**_14B, "num_parameters": 7_000_000_000}

SHARED = job_text(
    **colocated(1, gpu_memory_gib=80),
    placement=defer("genrm", "teacher"),
    models={
        "rollout.policy": tiny_policy(**_14B),
        "genrm.judge": tiny("judge", **_7B),
        "teacher.math": tiny("math", **_7B),
    },
    run=tiny_run(
        rewards=[{"adapter": "genrm-judge"}, {"adapter": "digits"}],
        reward_role="genrm",
        teacher_role="teacher",
    ),
)


def _run(root: Path, text: str) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    job = root / "job.toml"
    job.write_text(text)
    with support.relax_run(job, "--json") as run:
        code = run.wait(timeout=600)
        rows = run.json_rows()
        left = support.left_running(run, rows[-1] if rows else None)
        out = "\n".join(run.out.lines + run.err.lines)
    assert code == 0, out
    assert left == [], left
    steps = [r for r in rows if "step" in r and "event" not in r]
    events = [r for r in rows if r.get("event") == "phase" and r["state"] == "begin"]
    return steps, events


@pytest.fixture(scope="module")
def models(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return support.make_models(tmp_path_factory.mktemp("residency"))


# Covered in the default session by tests/coordination/test_residency.py::
# test_a_free_rollout_never_switches_and_its_batch_commits (the coordinator under the plan)
# and tests/run/test_run_durable_cli.py (a split-layout run, rollout never switching).
@pytest.mark.ray
@pytest.mark.slow
@pytest.mark.e2e
def test_a_rollout_on_no_shared_gpu_never_switches(models: Path) -> None:
    steps, events = _run(models, CPU_ROLLOUT)
    assert [s["step"] for s in steps] == [0, 1]
    assert [s["switches"] for s in steps] == [0, 0]
    assert not [e for e in events if e["phase"].startswith("rollout.")]


# The switch order is covered in the default session by tests/coordination/test_residency.py::
# test_judges_that_fit_together_switch_in_without_switching_out_in_between (the coordinator)
# and the run of this module's other test (a residency plan in a real run).
@pytest.mark.ray
@pytest.mark.slow
@pytest.mark.e2e
def test_judges_that_fit_together_switch_in_one_after_the_other_without_a_switch_between(
    models: Path,
) -> None:
    steps, events = _run(models, SHARED)
    for step in steps:
        n = step["step"]
        leases = [
            e["phase"]
            for e in events
            if e["step"] == n and e["phase"].endswith((".onload", ".offload", "genrm", "teacher"))
        ]
        expected = [
            "rollout.offload",
            "genrm.onload", "genrm",
            "teacher.onload", "teacher",  # genrm stays: teacher fits beside it
            "genrm.offload", "teacher.offload",  # both out before the commit
        ]  # fmt: skip
        assert leases == (["rollout.onload"] if n else []) + expected, leases
        assert step["switches"] == len(expected) - 2 + (1 if n else 0)

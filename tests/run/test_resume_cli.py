"""``relax run --resume RUN_DIR`` on real runs (CPU, a local Ray, a tiny hf policy alone with a
rule reward, the reference trainer, the jsonl and tensorboard trackers): the driver process is
SIGKILLed during step 3 of 6, and the resumed run commits steps 3-5 — weight versions and the
trainer's optimizer steps go on, each step's prompts are those of the same job run without a
kill, and the trackers' files hold one run.
"""

from __future__ import annotations

import json
import os
import signal
from pathlib import Path
from typing import Any

import pytest

from tests.support import run as support

pytestmark = [pytest.mark.ray, pytest.mark.slow]

JOB = """\
[roles.rollout.models.policy]
backend = "hf"
device = "cpu"
model_path = "tiny/policy"
weight_source = "ACTOR"
route_mode = "DIRECT"

[run]
steps = 6
dataset = "arithmetic"
prompts_per_step = 2
samples_per_prompt = 2
max_new_tokens = 4
rewards = [{ adapter = "digits" }]
learning_rate = 1e-3
seed = 3
checkpoint_every = 1
trackers = ["jsonl", "tensorboard"]
"""


def _prompts(dump: Path, step: int) -> list[tuple[str, str]]:
    rows = [json.loads(line) for line in (dump / f"batch-{step}.jsonl").read_text().splitlines()]
    return sorted({(r["group_id"], r["prompt"]) for r in rows})


def _steps(rows: list[dict[str, Any]]) -> dict[int, dict[str, Any]]:
    return {
        r["step"]: r for r in rows if "step" in r and "summary" not in r and not r.get("failed")
    }


def _finish(proc: support.RunProcess) -> list[dict[str, Any]]:
    code = proc.wait(timeout=300)
    rows = proc.rows()
    assert code == 0, "\n".join(proc.err.lines[-30:])
    assert support.left_running(proc, rows[-1]) == []
    return rows


@pytest.fixture(scope="module")
def root(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("resume")
    support.make_policy(root)
    (root / "job.toml").write_text(JOB)
    return root


class Killed:
    """The run killed during step 3: its directory, its dumps and the steps it committed."""

    def __init__(self, run_dir: Path, dump: Path, steps: dict[int, dict[str, Any]]) -> None:
        self.run_dir, self.dump, self.steps = run_dir, dump, steps


@pytest.fixture(scope="module")
def killed(root: Path) -> Killed:
    run_dir, dump = root / "killed", root / "dump"
    args = ("--json", "--run-dir", str(run_dir), "--dump-samples", str(dump))
    with support.relax_run(root / "job.toml", *args) as proc:
        proc.out.wait_for(
            r'"event": "phase", "step": 3, "phase": "generate", "state": "begin"', 300
        )
        os.kill(proc.proc.pid, signal.SIGKILL)  # the driver alone, as the OOM killer would
        assert proc.wait(timeout=60) == -signal.SIGKILL
        steps = _steps(proc.rows())
    # what the killed run left: its engine, Ray's processes (the test kills them, as an
    # operator would, before going on)
    return Killed(run_dir, dump, steps)


# The contract is covered in the default session by tests/run/test_checkpoint.py (what a
# checkpoint holds, and the driver started at a checkpoint's step running the steps after it
# with the prompts of an uninterrupted run) and by the refusal test below, which runs the real
# kill; this compares the whole resumed run with an uninterrupted one.
@pytest.mark.e2e
def test_a_run_killed_during_step_3_of_6_resumes_at_step_3_as_if_it_had_never_stopped(
    root: Path, killed: Killed
) -> None:
    job, run_dir, dump = root / "job.toml", killed.run_dir, killed.dump
    assert sorted(killed.steps) == [0, 1, 2]
    assert json.loads((run_dir / "checkpoint.json").read_text())["step"] == 3
    # The same job without a kill: what every step's prompts must be.
    plain_dump = root / "plain-dump"
    args = ("--json", "--run-dir", str(root / "plain"), "--dump-samples", str(plain_dump))
    with support.relax_run(job, *args) as proc:
        assert sorted(_steps(_finish(proc))) == [0, 1, 2, 3, 4, 5]

    args = ("--json", "--resume", str(run_dir), "--dump-samples", str(dump))
    with support.relax_run(job, *args) as proc:
        rows = _finish(proc)
    resumed = _steps(rows)
    summary = rows[-1]
    assert sorted(resumed) == [3, 4, 5]  # no committed step trained again
    assert summary["first_step"] == 3 and summary["steps_committed"] == 3
    for step in range(6):  # the prompts of every step are the uninterrupted run's
        assert _prompts(dump, step) == _prompts(plain_dump, step), step
    # weight versions go on: step N generated with the weights trained on N - 1, pushed as N
    assert [resumed[n]["weight_version"] for n in (3, 4, 5)] == ["3", "4", "5"]
    assert summary["weight_versions"] == ["3", "4", "5", "6"]
    # the trainer's optimizer goes on from its checkpoint
    assert [killed.steps[n]["train"]["optimizer_steps"] for n in (0, 1, 2)] == [1, 2, 3]
    assert [resumed[n]["train"]["optimizer_steps"] for n in (3, 4, 5)] == [4, 5, 6]

    # the trackers hold one run: jsonl one header and steps 0-5 once each; tensorboard the same
    lines = [json.loads(line) for line in (run_dir / "run.jsonl").read_text().splitlines()]
    kinds = [r["type"] for r in lines]
    assert kinds.count("config") == 1 and kinds.count("resume") == 1 and kinds[-1] == "close"
    assert [r["step"] for r in lines if r["type"] == "metrics"] == [0, 1, 2, 3, 4, 5]
    from tensorboard.backend.event_processing import event_accumulator as ea

    acc = ea.EventAccumulator(str(run_dir / "tensorboard"))
    acc.Reload()
    assert [e.step for e in acc.Scalars("reward/mean")] == [0, 1, 2, 3, 4, 5]
    assert sorted(p.name for p in run_dir.iterdir() if p.is_dir()) == [
        "checkpoints",
        "engine-logs",
        "tensorboard",
    ]


def test_a_used_run_dir_is_refused_and_a_job_that_changed_what_the_run_trained_with_too(
    root: Path, killed: Killed
) -> None:
    with support.relax_run(root / "job.toml", "--run-dir", str(killed.run_dir)) as proc:
        assert proc.wait(timeout=60) == 2
    assert f"--resume {killed.run_dir}" in "\n".join(proc.err.lines)
    changed = root / "changed.toml"
    changed.write_text(JOB.replace("seed = 3", "seed = 4"))
    with support.relax_run(changed, "--resume", str(killed.run_dir), "--steps", "8") as proc:
        assert proc.wait(timeout=60) == 2
    err = "\n".join(proc.err.lines)
    assert "--resume: run.seed: the run in" in err and "had 3" in err and "now has 4" in err

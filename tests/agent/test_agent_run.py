"""Multi-turn agentic rollouts in a real ``relax run``: ``docs/examples/run-agent-cpu.toml``,
as its header says to run it, commits trajectories of at least two turns with a tool call among
them, loss-masked, and its step rows report them (turns, tool calls, the environment's seconds
and tokens); and a step whose environment raises fails naming the environment and the
trajectory, with nothing of it committed."""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import pytest

from tests.support import run as support

EXAMPLE = support.ROOT / "docs" / "examples" / "run-agent-cpu.toml"


def _run(job: Path, *args: str) -> tuple[int, list[dict[str, Any]], str, list[int]]:
    with support.relax_run(job, *args) as run:
        code = run.wait(timeout=500)
        rows = run.json_rows()
        out = "\n".join(run.out.lines + run.err.lines)
        summary = next((r for r in rows if r.get("summary")), None)
        left = support.left_running(run, summary)
    return code, rows, out, left


def _batch(path: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in path.read_text().splitlines()]


@pytest.mark.ray
@pytest.mark.slow
def test_the_agent_example_commits_multi_turn_trajectories_with_tool_calls(tmp_path: Path) -> None:
    text = EXAMPLE.read_text()
    assert "relax run docs/examples/run-agent-cpu.toml --steps 2 --json" in text
    job = tmp_path / "run-agent-cpu.toml"
    job.write_text(text)
    support.make_policy(tmp_path)
    dumps = tmp_path / "samples"
    code, rows, out, left = _run(job, "--steps", "2", "--json", "--dump-samples", str(dumps))
    assert code == 0, out
    assert left == [], left
    steps = [r for r in rows if "step" in r and "event" not in r]
    assert [s["step"] for s in steps] == [0, 1] and rows[-1]["steps_committed"] == 2
    for step in steps:
        n = step["step"]
        samples = _batch(dumps / f"batch-{n}.jsonl")
        assert len(samples) == step["samples"] == step["train"]["samples"] == 4
        assert step["tokens"] == sum(len(s["response_ids"]) for s in samples)
        calls = errors = environment = 0
        for s in samples:
            t = s["metadata"]["trajectory"]
            assert t["turns"] >= 2 and t["id"] == s["id"]
            calls += t["tool_calls"]
            errors += t["tool_errors"]
            mask = s["loss_mask"]
            environment += mask.count(0)
            assert len(mask) == len(s["response_ids"]) == len(s["rollout_logprobs"])
            # The policy's turns are mask 1, exactly; the tool's answers between them mask 0.
            policy = {i for a, b in t["turn_spans"] for i in range(a, b)}
            assert [i for i, m in enumerate(mask) if m] == sorted(policy)
            assert 0 in mask
            assert any(m["role"] == "tool" for m in t["messages"])
            # The environment's rewards per turn, beside the final one the stage wrote.
            env = sum(r for r in t["turn_rewards"] if r is not None)
            assert s["fields"]["rewards"]["environment"] == pytest.approx(env)
        assert calls >= 1
        # The step's row says so: turns per trajectory, tool calls, errors and timeouts, the
        # environment's seconds, the policy's tokens against the environment's.
        rollout = step["trajectories"]
        assert rollout["turns"]["max"] >= rollout["turns"]["mean"] >= 2
        assert rollout["tool_calls"]["total"] == calls
        assert rollout["tool_errors"]["total"] == errors
        assert rollout["tool_timeouts"]["total"] == 0
        assert rollout["environment_seconds"]["total"] > 0
        assert rollout["environment_tokens"]["total"] == environment > 0
        assert rollout["policy_tokens"]["total"] == step["tokens"] - environment


JOB = """\
[roles.rollout.models.policy]
backend = "hf"
device = "cpu"
model_path = "tiny/policy"
weight_source = "ACTOR"
weights_cpu_backup = true

[run]
prompts_per_step = 2
samples_per_prompt = 2
max_new_tokens = 8
trainer = "record-fields"
rewards = [{ adapter = "environment" }]

[run.generation]
shape = "multi-turn"
environment = "fails-on-step-1"
"""


# The contract is covered in the default session by
# plugins/relax-agent/tests/test_multiturn_engines.py::
# test_an_environment_that_raises_fails_with_its_name_and_the_trajectory_id (real engines)
# and tests/run/test_one_driver.py::
# test_a_failed_sync_step_commits_nothing_and_lists_its_samples; this is the whole CLI run.
@pytest.mark.ray
@pytest.mark.slow
@pytest.mark.e2e
def test_an_environment_that_raises_fails_the_step_and_nothing_of_it_is_committed(
    tmp_path: Path,
) -> None:
    job = tmp_path / "job.toml"
    job.write_text(JOB)
    support.make_policy(tmp_path)
    dumps = tmp_path / "samples"
    code, rows, out, left = _run(job, "--steps", "2", "--json", "--dump-samples", str(dumps))
    # The run reports the failed step and goes past it ([run] max_failed_steps, default 3):
    # it ends with status 0, the summary naming the step in failed_steps.
    assert code == 0, out
    assert left == [], left
    steps = [r for r in rows if "step" in r and "event" not in r and "error" not in r]
    assert [s["step"] for s in steps] == [0]  # step 0 committed
    (failed,) = [r for r in rows if r.get("failed") is True]
    # The batch was failed at the coordinator because of the environment, named with the
    # trajectory; the trainer was never asked for it (it trained on nothing).
    assert failed["step"] == 1 and failed["kind"] == "BatchFailedError"
    assert re.search(
        r"batch 1 FAILED: generation failed: EnvironmentStepError: environment "
        r"'fails-on-step-1', trajectory b1-p\d-s\d: step on turn 0 failed: RuntimeError: the "
        r"environment broke on purpose",
        failed["error"],
    ), failed["error"]
    assert failed["trainer"].startswith("not asked")
    assert failed["went_on"] is True
    summary = rows[-1]
    assert summary["summary"] is True and summary["steps_committed"] == 1
    assert summary["failed_steps"] == [1] and summary["failed_step"] is None
    assert sorted(p.name for p in dumps.iterdir()) == ["batch-0.jsonl", "failed-1.jsonl"]

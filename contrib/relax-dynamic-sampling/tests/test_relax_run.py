"""The dynamic-sampling stage in a real ``relax run``: a tiny policy on CPU (an hf engine), a
JSONL dataset whose prompts alternate between ones whose samples all get the same reward
(marked ``constant``: the test plugin's ``constant-or-checksum`` adapter gives them 0.5) and
ones whose samples get different rewards; the step's JSON line counts what was dropped and
generated, and only groups whose rewards vary are committed.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

JOB = """\
[roles.rollout.models.policy]
backend = "hf"
device = "cpu"
model_path = "tiny/policy"
weight_source = "ACTOR"
weights_cpu_backup = true

[run]
steps = 2
dataset = "prompts.jsonl"
prompts_per_step = 4
samples_per_prompt = 3
max_new_tokens = 8
trainer = "record-fields"

[[run.stages]]
stage = "reward"
rewards = [{ adapter = "constant-or-checksum" }]

[[run.stages]]
stage = "dynamic-sampling"
max_rounds = 4
"""


def _prompts(path: Path, count: int = 40) -> None:
    lines = [
        {"prompt": f"Question: what is {i} + {i}? Answer:", "metadata": {"constant": i % 2 == 0}}
        for i in range(count)
    ]
    path.write_text("".join(json.dumps(line) + "\n" for line in lines))


@pytest.mark.ray
@pytest.mark.slow
def test_flat_groups_are_dropped_and_refilled_with_the_counts_in_the_step_line(
    tmp_path: Path,
) -> None:
    made = subprocess.run(
        [sys.executable, "-m", "relax_hf", "make-tiny-model", str(tmp_path / "tiny" / "policy")],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert made.returncode == 0, made.stderr
    _prompts(tmp_path / "prompts.jsonl")
    (tmp_path / "job.toml").write_text(JOB)
    dumps = tmp_path / "samples"
    argv = [sys.executable, "-m", "relax_core", "run", "job.toml", "--json"]
    proc = subprocess.Popen(
        [*argv, "--dump-samples", str(dumps)],
        cwd=tmp_path,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )
    try:
        out, err = proc.communicate(timeout=600)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(30)
    assert proc.returncode == 0, out + err
    rows = [json.loads(line) for line in out.splitlines() if line.startswith("{")]
    steps = [r for r in rows if "step" in r and "event" not in r]
    assert [r["step"] for r in steps] == [0, 1]
    for row in steps:
        counts = row["stages"]["dynamic-sampling"]
        # Half of each step's first prompts are constant: dropped, then refilled from the file
        # (which alternates too), round after round, until 4 groups vary.
        assert counts["kept_groups"] == 4 and row["groups"] == 4 and row["samples"] == 12
        assert counts["dropped_groups"] >= 2 and counts["rounds"] >= 1
        assert counts["generated_groups"] == row["generated_groups"] >= 2
        dropped = row["dropped"]
        assert dropped["groups"] == counts["dropped_groups"] + counts["trimmed_groups"]
        assert dropped["samples"] == 3 * dropped["groups"]
        assert (
            dropped["reasons"]["dynamic-sampling: its rewards do not vary"]
            == (counts["dropped_groups"])
        )
        n = row["step"]
        committed = [json.loads(x) for x in (dumps / f"batch-{n}.jsonl").read_text().splitlines()]
        gone = [json.loads(x) for x in (dumps / f"dropped-{n}.jsonl").read_text().splitlines()]
        assert not any(s["metadata"]["constant"] for s in committed)
        flat = [s for s in gone if s["metadata"]["constant"]]
        assert len(flat) == 3 * counts["dropped_groups"]
        # Nothing lost: every generated sample is committed or dropped, once.
        ids = [s["id"] for s in committed + gone]
        assert len(ids) == len(set(ids)) == 3 * (4 + counts["generated_groups"])

"""``relax run`` rebuilds a dead rollout engine and goes on, for real: tiny hf engines on CPU,
a new local Ray per test.

- kill -9 of the policy's engine while step 1 of an async split run of 4 steps generates: the
  generation that met the dead engine is not sent again (its step fails at generation, and the
  run goes past it), the replica is rebuilt through its manager before the next step
  generates and the trainer's weights are pushed to it again; the later steps commit, the
  first one not reported yet with ``recoveries`` ``{"rollout": 1}`` (the rebuild is found by
  the push or the generation that meets the dead engine first).
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from tests.support import run as support

pytestmark = [pytest.mark.ray, pytest.mark.slow]


def test_kill_9_of_the_policy_engine_mid_step_1_rebuilds_rollout_and_the_run_goes_on(
    root: Path,
) -> None:
    job = support.job_file(
        root,
        example=support.ASYNC_EXAMPLE,
        steps=4,
        max_failed_steps=4,
        max_new_tokens=4,
        operation_timeout=60.0,
        request_timeout=60.0,
    )
    ran = support.kill_engine_when(
        root, job, r'^\{"event": "phase", "step": 1, "phase": "generate", "state": "begin"',
        "policy",
    )  # fmt: skip
    proc, code, rows, left, killed = ran.run, ran.code, ran.rows, ran.left, ran.killed
    summary = rows[-1]
    assert code == 0, f"{proc.out}\n{proc.err}"
    assert left == [], left
    steps = [r for r in rows if "reward_mean" in r]
    failed = [r for r in rows if r.get("failed")]
    committed = [r["step"] for r in steps]
    # the step that met the dead engine failed at generation, never sent again; the last ones
    # committed on the rebuilt replica
    assert committed and committed[-1] == 3, (committed, [r["error"] for r in failed])
    assert all("generation failed" in r["error"] for r in failed), failed
    assert summary["summary"] is True and summary["failed_step"] is None
    seen = [(r.get("step"), r.get("error"), r.get("recoveries")) for r in rows]
    assert summary["recoveries"] == {"rollout": 1}, (seen, str(proc.err)[-3000:])
    rebuilt = [r["step"] for r in steps if r["recoveries"] == {"rollout": 1}]
    assert len(rebuilt) == 1 and rebuilt[0] >= 1, (rebuilt, steps)
    assert all(r["samples"] == 16 for r in steps)
    assert not os.path.exists(f"/proc/{killed}") or killed not in summary["engine_pids"]

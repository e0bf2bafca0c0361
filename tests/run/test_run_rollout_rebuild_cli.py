"""``relax run`` rebuilds a dead rollout engine and goes on, for real: tiny hf engines on CPU,
a new local Ray per test.

- kill -9 of the policy's engine while step 1 of an async split run of 4 steps generates: no
  generation request that met the dead engine is sent again; each of its groups is
  regenerated as a new group of the same prompt once the replica was rebuilt through its
  manager and given the trainer's weights again (``[run] generation_retries``), so step 1
  commits too, its row showing ``retries`` ``{"generate": N}`` and ``recoveries``
  ``{"rollout": 1}``, and every step commits.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from tests.support import run as support

pytestmark = [pytest.mark.ray, pytest.mark.slow]


# The contract is covered in the default session by tests/run/test_generation_retries.py (a
# group whose engine died is regenerated as a new group, the weights pushed to the rebuilt
# replica first; the real driver over simulated engines) and tests/manager/test_manager_faults.py::
# test_kill_9_during_generation_fails_the_replica_and_rebuilds_it_after_cleanup (a real engine
# killed and rebuilt); this is the whole CLI run around it.
@pytest.mark.e2e
@pytest.mark.timeout(600)  # a rebuild of an engine on a loaded CPU machine
def test_kill_9_of_the_policy_engine_mid_step_1_regenerates_its_groups_and_every_step_commits(
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
    steps = {r["step"]: r for r in rows if "reward_mean" in r}
    failed = [r for r in rows if r.get("failed")]
    # every step committed: the groups that met the dead engine were generated again as new
    # groups on the rebuilt replica, within step 1
    assert sorted(steps) == [0, 1, 2, 3] and failed == [], (sorted(steps), failed)
    assert summary["summary"] is True and summary["failed_step"] is None
    assert summary["failed_steps"] == []
    # one rebuild, in the row of the step whose generation (or the push before it) met the
    # dead engine first: step 1, unless its requests were all answered before the kill
    rebuilt = [n for n, r in steps.items() if r["recoveries"]]
    assert summary["recoveries"] == {"rollout": 1}, (summary, str(proc.err)[-3000:])
    assert len(rebuilt) == 1 and rebuilt[0] >= 1, rebuilt
    # the groups regenerated (at most the step's 4), counted in that step's row
    assert set(summary["retries"]) <= {"generate"}, summary["retries"]
    assert summary["retries"] == steps[rebuilt[0]]["retries"]
    assert summary["retries"].get("generate", 0) <= 4
    assert all(r["samples"] == 16 and r["groups"] == 4 for r in steps.values())
    assert not os.path.exists(f"/proc/{killed}") or killed not in summary["engine_pids"]

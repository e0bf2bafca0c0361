"""``relax run`` survives what a retry cures, and never commits an empty batch, for real: tiny hf
engines on CPU, a new local Ray per test.

- kill -9 of the genrm engine while step 2 of an async run of 5 steps is judged: its
  judgements are sent again after the replica was rebuilt through its manager, and all 5 steps
  commit; step 2's row shows the retries and the rebuild;
- a stage that drops every group (dynamic sampling over a reward that never varies): each step
  is skipped (``on_empty_batch = "skip"``), nothing committed nor trained, exit status 0, the
  ``--json`` rows say so and the summary comes last; no traceback.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from tests.support import run as support

pytestmark = [pytest.mark.ray, pytest.mark.slow]


def test_kill_9_of_the_genrm_engine_mid_step_2_costs_retries_and_a_rebuild_not_the_run(
    root: Path,
) -> None:
    job = support.job_file(
        root, example=support.ASYNC_EXAMPLE, steps=5, operation_timeout=60.0, request_timeout=60.0
    )
    # once step 2's judging has begun (streamed: group by group as it is generated)
    ran = support.kill_engine_when(
        root, job, r'^\{"event": "phase", "step": 2, "phase": "genrm.stream", "state": "begin"',
        "judge",
    )  # fmt: skip
    proc, code, rows, left, killed = ran.run, ran.code, ran.rows, ran.left, ran.killed
    summary = rows[-1]
    assert code == 0, f"{proc.out}\n{proc.err}"
    assert left == [], left
    steps = [r for r in rows if "reward_mean" in r]
    failed = [(r["step"], r["error"]) for r in rows if r.get("failed")]
    assert failed == [] and [r["step"] for r in steps] == [0, 1, 2, 3, 4], (failed, str(proc.err))
    assert summary["summary"] is True and summary["steps_committed"] == 5
    assert summary["failed_steps"] == [] and summary["failed_step"] is None
    step2 = steps[2]
    # the judgements that met the dead engine were sent again, after its replica was rebuilt
    assert step2["retries"].get("genrm", 0) >= 1, step2
    assert step2["recoveries"] == {"genrm": 1}, step2
    assert summary["recoveries"] == {"genrm": 1}
    assert all(r["samples"] == 16 and r["fields"]["reward"] == 16 for r in steps)
    # asynchronous steps: every sample within the bound (max_staleness = 1), scored as streamed
    for r in steps:
        staleness = r["async"]["staleness"]
        assert sum(staleness.values()) == 16 and max(int(k) for k in staleness) <= 1, r["async"]
        assert r["async"]["max_staleness_seen"] <= 1
        assert r["async"]["streamed_stages"] == ["genrm", "teacher"]
    assert steps[0]["async"]["staleness"] == {"0": 16}
    assert killed not in summary["engine_pids"] or not os.path.exists(f"/proc/{killed}")


# The contract (an all-dropped batch is skipped, never committed nor trained, the run goes on)
# is covered in the default session by tests/run/test_durable_steps.py::
# test_an_all_dropped_batch_is_skipped_never_committed_nor_trained (the real driver and
# coordinator); this is the whole CLI run around it.
@pytest.mark.e2e
def test_a_stage_that_drops_every_group_skips_the_step_with_exit_0_and_the_summary_last(
    root: Path,
) -> None:
    job = support.job_file(
        root,
        steps=2,
        # exact-match of a tiny random policy's answers: 0.0 for every sample, so no group's
        # rewards vary and dynamic sampling drops them all
        **dict.fromkeys(("rewards", "reward_role", "teacher_role", "teacher_mode", "top_k")),
        stages=[
            {"stage": "reward", "rewards": [{"adapter": "exact-match"}]},
            {"stage": "dynamic-sampling", "max_rounds": 1},
        ],
        max_new_tokens=4,
    )
    with support.relax_run(job, "--json") as proc:
        code = proc.wait(timeout=400)
        rows = proc.rows()
        left = support.left_running(proc, rows[-1] if rows else None)
    assert code == 0, f"{proc.out}\n{proc.err}"
    assert left == [], left
    assert "Traceback" not in str(proc.err) and "Traceback" not in str(proc.out)
    *skipped, summary = rows
    assert [r["step"] for r in skipped] == [0, 1]
    for r in skipped:
        assert r["skipped"] is True and r["failed"] is False and r["went_on"] is True
        assert r["kind"] == "EmptyBatchError" and "dropped every group" in r["error"]
        assert r["samples_generated"] >= 16 and r["trainer"].startswith("not asked")
    assert summary["summary"] is True and summary["steps_committed"] == 0
    assert summary["skipped_steps"] == [0, 1] and summary["failed_steps"] == []
    assert summary["failed_step"] is None and summary["final_push"] is None
    assert "step 0 skipped, nothing committed or trained for it" in str(proc.err)

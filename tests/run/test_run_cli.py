"""``relax run`` as a user runs it, on the CPU example job (its three committed steps, every
field, the weight version moving, the trace and the switch measurement are checked on the run
of tests/run/test_tracking_run.py, which runs that example once with its trackers); the faults
that must end a run cleanly (kill -9 of the genrm engine mid-scoring, SIGSTOP of the teacher
engine during its offload); and Ctrl-C while genrm judges, with its requests in flight.

Each test runs ``python -m relax_core run`` in a session of its own on a new local Ray with the
example's tiny hf models (CPU engines placed on one declared GPU).
"""

from __future__ import annotations

import json
import os
import re
import signal
import urllib.request
from pathlib import Path
from typing import Any

import pytest

from relax_core.testing import wait_for
from tests.support import run as support
from tests.support import serve as processes
from tests.support.jobs import colocated, defer, job_text, tiny, tiny_policy

pytestmark = [pytest.mark.ray, pytest.mark.slow]


def _phase(run: support.RunProcess, step: int, phase: str, state: str, timeout: float) -> None:
    """Wait for ``--json``'s progress event of ``phase`` of ``step`` in ``state``."""
    run.out.wait_for(
        rf'^\{{"event": "phase", "step": {step}, "phase": "{re.escape(phase)}", '
        rf'"state": "{state}"',
        timeout=timeout,
    )


def _committed(directory: Path) -> dict[int, list[dict[str, Any]]]:
    return {
        int(p.stem.split("-")[1]): [json.loads(line) for line in p.read_text().splitlines()]
        for p in sorted(directory.glob("batch-*.jsonl"))
    }


#: The example's stages (its shorthand's) with no retries, and a run that ends at its first
#: failed step.
NO_RETRIES: dict[str, Any] = {
    **dict.fromkeys(("rewards", "reward_role", "teacher_role", "teacher_mode", "top_k")),
    "stages": [
        {
            "stage": "reward",
            "name": "genrm",
            "role": "genrm",
            "retries": 0,
            "rewards": [
                {"adapter": "genrm-judge", "weight": 1.0},
                {"adapter": "exact-match", "weight": 0.5},
                {"adapter": "digits", "weight": 0.5},
            ],
        },
        {"stage": "distill", "name": "teacher", "role": "teacher", "mode": "top-k",
         "top_k": 4, "retries": 0},
    ],
    "max_failed_steps": 0,
}  # fmt: skip


def _trigger_and_fail(
    root: Path, phase_end: str, fault: Any, *, timeout: float = 300, **run: Any
) -> tuple[support.RunProcess, list[dict[str, Any]], dict[str, Any]]:
    """Run two steps; when step 1's ``phase_end`` ends (its ``--json`` progress event),
    ``fault()``; the run must end with exit 1. Returns the run, its committed rows and the
    failed step's row."""
    # The faults here are ones no retry cures: its requests are sent once and the first
    # failed step ends the run (retries and recovery: tests/run/test_run_durable_cli.py).
    job = support.job_file(root, steps=2, **{**NO_RETRIES, **run})
    dumps = root / "samples"
    with support.relax_run(job, "--json", "--dump-samples", str(dumps)) as proc:
        _phase(proc, 1, phase_end, "end", timeout)
        fault()
        code = proc.wait(timeout=timeout)
        rows = proc.rows()
        summary = rows[-1]
        left = support.left_running(proc, summary)
    assert code == 1, f"{proc.out}\n{proc.err}"
    assert left == [], left
    assert "relax run: stopped; nothing left running" in str(proc.err)
    committed = [r for r in rows if "reward_mean" in r]
    failed = next(r for r in rows if r.get("failed"))
    assert summary["steps_committed"] == 1 and summary["failed_step"] == 1
    # Nothing committed for the failed step, nothing lost: every sample it generated is in its
    # report (and its dump), every sample of step 0 in the committed batch, none in both.
    assert [r["step"] for r in committed] == [0] and failed["step"] == 1
    assert sorted(p.name for p in dumps.iterdir()) == ["batch-0.jsonl", "failed-1.jsonl"]
    step0 = {s["id"] for s in _committed(dumps)[0]}
    lost = [json.loads(line)["id"] for line in (dumps / "failed-1.jsonl").read_text().splitlines()]
    assert len(step0) == 16 and sorted(lost) == sorted(failed["sample_ids"])
    assert len(lost) == failed["samples_generated"] == 16 and not step0 & set(lost)
    # The consumer never got the failed batch: it is asked for a batch once it committed.
    assert failed["trainer"].startswith("not asked"), failed["trainer"]
    return proc, committed, failed


# With retries off and no failed step gone past: covered in the default session by
# tests/run/test_one_driver.py::test_a_failed_sync_step_commits_nothing_and_lists_its_samples
# (a failed step commits nothing) and tests/run/test_run_durable_cli.py (a real kill -9 of genrm
# mid-step, with retries: rebuilt, committed).
@pytest.mark.e2e
def test_kill_9_of_the_genrm_engine_mid_scoring_ends_the_run_with_nothing_committed_for_it(
    root: Path,
) -> None:
    def kill() -> None:
        os.kill(support.engine_pid(root, "judge"), signal.SIGKILL)

    proc, _, failed = _trigger_and_fail(
        root, "genrm.onload", kill, operation_timeout=10.0, request_timeout=20.0
    )
    assert failed["kind"] == "ScoringError" and "genrm-judge" in failed["error"], failed
    assert "step 1 failed, nothing committed for it" in str(proc.err)


# The contract (an offload that never confirms leaves the lease BLOCKED, the role never
# activated, the step failed with what to do) is covered in the default session by
# tests/coordination/test_deferred_real.py::
# test_an_offload_timeout_blocks_the_lease_and_the_teacher_is_never_activated on real
# engines; this is the whole run around a real SIGSTOP.
@pytest.mark.e2e
def test_sigstop_of_the_teacher_engine_during_its_offload_blocks_it_and_says_what_to_do(
    root: Path,
) -> None:
    stopped: list[int] = []

    def stop() -> None:
        # While it prefills: its requests hang, then its offload does (the engine cannot
        # answer), and the coordinator's deadline leaves its lease BLOCKED.
        stopped.append(support.engine_pid(root, "math"))
        os.kill(stopped[0], signal.SIGSTOP)

    proc, _, failed = _trigger_and_fail(
        root,
        "teacher.onload",
        stop,
        operation_timeout=6.0,
        # Long enough for genrm to judge the batch on a loaded 2-core machine; the stopped
        # teacher's requests still fail, after it.
        request_timeout=15.0,
        prompts_per_step=4,
        max_new_tokens=48,
    )
    assert set(failed["blocked"]) == {"teacher"}, failed
    # The stopped engine confirms nothing within the deadline: its offload, or (when the
    # manager already marked its replica FAILED) the rebuild the lease engine tries first.
    reason = failed["blocked"]["teacher"]
    assert re.search(r"(offload|rebuild: recover) not confirmed within 6s", reason), failed
    text = failed["error"]
    assert "BLOCKED" in text and "relax coordinator reset" in text and "--role teacher" in text
    assert f"step 1 failed, nothing committed for it: {text}" in str(proc.err)
    # The stopped engine was killed by the shutdown, like every other.
    assert not any(os.path.exists(f"/proc/{p}") for p in stopped)


#: Rollout and a deferred genrm on the example's models (no teacher: a shorter start-up); the
#: judge scores 32 samples of 64 tokens each, seconds on this machine, while rollout's 4-token
#: answers take a fraction of that.
INTERRUPTED_JOB = job_text(
    **colocated(1),
    placement=defer("genrm"),
    models={"rollout.policy": tiny_policy(), "genrm.judge": tiny("judge")},
    run={
        "steps": 2,
        "prompts_per_step": 8,
        "samples_per_prompt": 4,
        "max_new_tokens": 4,
        "rewards": [{"adapter": "genrm-judge"}],
        "reward_role": "genrm",
    },
)

#: What Ray prints of an error no one handled, or of a failed task or actor.
RAY_ERROR_TEXT = ("Traceback", "Unhandled error", "RayTaskError", "RayActorError", "ray.exceptions")


def _requests_in_flight(url: str) -> int:
    with urllib.request.urlopen(f"{url}/get_load", timeout=5) as answer:
        return int(json.load(answer)[0]["num_reqs"])


# Covered in the default session by tests/coordination/test_deferred_real.py::
# test_a_batch_cancelled_while_genrm_judges_aborts_its_requests_and_genrm_serves_again (the
# abort on real engines) and tests/commands/test_demo.py (Ctrl-C of a whole run, exit 130).
@pytest.mark.e2e
def test_ctrl_c_while_genrm_judges_aborts_its_requests_and_stops_cleanly_with_exit_130(
    root: Path,
) -> None:
    job = root / "job.toml"
    job.write_text(INTERRUPTED_JOB)
    logs, records = root / "logs", root / "records"
    with support.relax_run(
        job, "--json", "--log-dir", str(logs), "--tracker", "jsonl", "--run-dir", str(records)
    ) as run:
        start = json.loads(run.out.wait_for(r'^\{"event": "start", .*', timeout=240).group(0))
        _phase(run, 0, "genrm", "begin", timeout=120)
        # The judge engine's own port (its log's first line): the stage's requests have
        # reached it, so Ctrl-C finds them in flight.
        log = next(logs.glob("judge_*.log")).read_text()
        engine = re.search(r"serving \S+ on cpu at (http://\S+)", log)
        assert engine is not None, log
        wait_for(lambda: _requests_in_flight(engine.group(1)) > 0, timeout=30, what="judging")
        run.interrupt()  # Ctrl-C, as a terminal sends it: to the whole process group
        code = run.wait(timeout=120)
        *_, summary = run.rows()
        left = support.left_running(run, summary)
    out, err = str(run.out), str(run.err)
    assert code == 130, f"{out}\n{err}"
    # The judge's requests were aborted, then genrm offloaded: its stage interrupted, its
    # offload confirmed (no FAILED, no BLOCKED lease), and not a trace of Ray's errors.
    assert re.search(r"^  · step 0 genrm [\d.]+s interrupted$", err, re.M), err
    assert not re.search(r"FAILED$", err, re.M) and "BLOCKED" not in out + err, err
    assert [t for t in RAY_ERROR_TEXT if t in out + err] == [], f"{out}\n{err}"
    events = [r for r in run.json_rows() if r.get("event") == "phase" and r["step"] == 0]
    states = {r["phase"]: r["state"] for r in events}
    assert states["genrm"] == "interrupted" and states["genrm.offload"] == "end", states
    failed = next(r for r in run.rows() if r.get("failed"))
    assert failed["interrupted"] and failed["error"] == "interrupted during genrm", failed
    assert failed["blocked"] == {} and failed["trainer"].startswith("not asked"), failed
    assert summary["interrupted_step"] == 0 and summary["steps_committed"] == 0
    assert "relax run: interrupted; shutting down" in err
    assert "relax run: stopped; nothing left running" in err
    # Nothing it started is left: every engine and router it announced, its Ray.
    assert sorted(summary["engine_pids"]) == start["engine_pids"] != []
    assert start["router_pids"] != []
    pids = start["engine_pids"] + start["router_pids"]
    assert [p for p in pids if processes.alive(p)] == [] and left == [], left
    # The tracker was closed with the interrupted run's summary, after the interrupted span.
    tracked = [json.loads(line) for line in (records / "run.jsonl").read_text().splitlines()]
    assert tracked[-1]["type"] == "close" and tracked[-1]["summary"]["interrupted_step"] == 0
    spans = [r for r in tracked if r["type"] == "span" and r["name"] == "genrm"]
    assert spans and spans[-1]["interrupted"] is True

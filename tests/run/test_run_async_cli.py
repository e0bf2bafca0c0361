"""``relax run`` with asynchronous steps (``docs/examples/run-async-cpu.toml``: the CPU
example's three tiny hf models in a split layout, ``mode = "async"``, ``max_staleness = 1``):
its steps commit with every sample within the staleness bound, and kill -9 of the genrm engine
mid-run, its requests sent once (``retries = 0``, ``max_failed_steps = 0``), ends it as cleanly
as a sync run — nothing committed for the failed step, every sample
of it reported, nothing left running.
"""

from __future__ import annotations

import json
import os
import signal
from pathlib import Path

import pytest

from tests.run.test_run_cli import NO_RETRIES
from tests.support import run as support

# Both runs are e2e (``nox -s e2e``). In the default session: a real asynchronous run of the
# same example, every sample within the staleness bound and streamed scoring, is
# tests/run/test_run_durable_cli.py (its kill -9 of genrm costs retries, not the run); a failed
# step that commits nothing and lists its samples, in both modes and in a defer layout taking
# turns, is tests/run/test_one_driver.py and tests/run/test_async_driver.py (the real
# coordinator and driver over simulated engines).
pytestmark = [pytest.mark.ray, pytest.mark.slow, pytest.mark.e2e]


def test_async_steps_commit_within_the_staleness_bound_and_kill_9_of_genrm_ends_it_cleanly(
    root: Path,
) -> None:
    """One run (one start-up, to keep the default session short): steps commit with every
    sample within the bound; then kill -9 of the judge's engine mid-run."""
    job = support.job_file(
        root,
        example=support.ASYNC_EXAMPLE,
        steps=6,
        operation_timeout=10.0,
        request_timeout=20.0,
        # sent once, the first failed step ends the run (what a retry cures:
        # tests/run/test_run_durable_cli.py)
        **NO_RETRIES,
    )
    dumps = root / "samples"
    with support.relax_run(job, "--json", "--dump-samples", str(dumps)) as proc:
        proc.out.wait_for(r'^\{"step": 1, "batch_id": 1', timeout=300)  # steps 0 and 1 trained
        os.kill(support.engine_pid(root, "judge"), signal.SIGKILL)
        code = proc.wait(timeout=300)
        rows = proc.rows()
        summary = rows[-1]
        left = support.left_running(proc, summary)
    assert code == 1, f"{proc.out}\n{proc.err}"
    assert left == [], left
    assert "relax run: stopped; nothing left running" in str(proc.err)
    steps = [r for r in rows if "reward_mean" in r]
    failed = next(r for r in rows if r.get("failed"))
    assert [r["step"] for r in steps] == list(range(failed["step"])) and len(steps) >= 2
    assert summary["failed_step"] == failed["step"]
    for r in steps:
        staleness = r["async"]["staleness"]
        assert sum(staleness.values()) == r["samples"] == 16
        assert max(int(k) for k in staleness) <= 1 and r["async"]["max_staleness_seen"] <= 1
        assert r["async"]["streamed_stages"] == ["genrm", "teacher"]
        assert set(r["async"]["idle"]) == {"rollout", "genrm", "teacher", "trainer"}
    # step 0 on the first weights; every later step generated one version behind its trainer
    assert steps[0]["async"]["staleness"] == {"0": 16}
    assert all(r["async"]["staleness"] == {"1": 16} for r in steps[1:])
    assert "genrm" in failed["error"] or "judge" in failed["error"], failed
    # Nothing lost: the failed step's samples (and those generated ahead) are in its report
    # and its dump; every committed sample in exactly one batch, none of them in the report.
    lost = [
        json.loads(line)["id"]
        for line in (dumps / f"failed-{failed['step']}.jsonl").read_text().splitlines()
    ]
    assert lost and sorted(lost) == sorted(failed["sample_ids"])
    kept = [
        json.loads(line)["id"]
        for p in sorted(dumps.glob("batch-*.jsonl"))
        for line in p.read_text().splitlines()
    ]
    assert len(kept) == len(set(kept)) == 16 * len(steps)
    assert not set(kept) & set(lost)


def _spans(trace: Path) -> dict[tuple[str, int], tuple[int, int]]:
    """(phase name, batch) -> (start, end) in µs, from the run's Perfetto trace."""
    doc = json.loads(trace.read_text())
    return {
        (e["name"], e["args"]["batch"]): (e["ts"], e["ts"] + e["dur"])
        for e in doc["traceEvents"]
        if e.get("ph") == "X"
    }


def test_async_steps_in_a_defer_layout_take_turns_and_overlap_training_only(root: Path) -> None:
    """The CPU example's defer layout (genrm and teacher deferred on rollout's one GPU) with
    ``mode = "async"``: every step commits within the staleness bound, each step's generation
    starts only once the previous batch committed, the deferred roles never run while rollout
    generates, and every push lands while rollout is onloaded (read off the run's trace)."""
    job = support.job_file(root, steps=3, mode="async", max_staleness=1)
    trace = root / "trace.json"
    with support.relax_run(job, "--json", "--trace", str(trace)) as proc:
        code = proc.wait(timeout=400)
        rows = proc.rows()
    assert code == 0, f"{proc.out}\n{proc.err}"
    assert "async: rollout takes turns with genrm, teacher on its GPUs" in str(proc.out) + str(
        proc.err
    )
    steps = [r for r in rows if "reward_mean" in r]
    assert [r["step"] for r in steps] == [0, 1, 2]
    for r in steps:
        assert sum(r["async"]["staleness"].values()) == r["samples"] == 16
        assert r["async"]["max_staleness_seen"] <= 1
        assert r["async"]["streamed_stages"] == []  # deferred roles never stream
    # version 2's push is skipped when it comes after rollout's last turn (the final push
    # gives rollout the last weights); version 1's never is: step 2 generates with it
    assert rows[-1]["weight_versions"] in (["default", "1", "2", "3"], ["default", "1", "3"])
    spans = _spans(trace)
    for n in (1, 2):
        # the step's turn: after the previous commit, rollout onloaded, then generation
        assert spans["commit", n - 1][1] <= spans["rollout.onload", n][0]
        assert spans["rollout.onload", n][1] <= spans["generate", n][0]
    awake = [(spans["generate", 0][0], spans["rollout.offload", 0][0])] + [
        (spans["rollout.onload", n][0], spans["rollout.offload", n][0]) for n in (1, 2)
    ]
    for (name, _), (a, b) in spans.items():
        if name in ("genrm", "teacher"):
            assert all(b <= lo or a >= hi for lo, hi in awake), (name, a, b, awake)
        if name == "weight_push":
            assert any(lo <= a and b <= hi for lo, hi in awake), (a, b, awake)

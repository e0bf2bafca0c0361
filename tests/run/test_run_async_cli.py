"""``relax run`` with asynchronous steps (``docs/examples/run-async-cpu.toml``: the CPU
example's three tiny hf models in a split layout, ``mode = "async"``, ``max_staleness = 1``):
its steps commit with every sample within the staleness bound, and kill -9 of the genrm engine
mid-run ends it as cleanly as a sync run — nothing committed for the failed step, every sample
of it reported, nothing left running.
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


@pytest.fixture(scope="module")
def models(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return support.make_models(tmp_path_factory.mktemp("run-async-models"))


@pytest.fixture
def root(models: Path, tmp_path: Path) -> Path:
    (tmp_path / "tiny").symlink_to(models / "tiny", target_is_directory=True)
    return tmp_path


def _rows(run: support.RunProcess) -> list[dict[str, Any]]:
    return [r for r in run.json_rows() if "event" not in r]


def test_async_steps_commit_within_the_staleness_bound(root: Path) -> None:
    job = support.job_file(root, example=support.ASYNC_EXAMPLE, steps=3)
    dumps = root / "samples"
    with support.relax_run(job, "--json", "--dump-samples", str(dumps)) as proc:
        code = proc.wait(timeout=600)
        rows = _rows(proc)
        left = support.left_running(proc, rows[-1] if rows else None)
    assert code == 0, f"{proc.out}\n{proc.err}"
    assert left == []
    steps = [r for r in rows if "reward_mean" in r]
    assert [r["step"] for r in steps] == [0, 1, 2]
    for r in steps:
        staleness = r["async"]["staleness"]
        assert sum(staleness.values()) == r["samples"] == 16
        assert max(int(k) for k in staleness) <= 1 and r["async"]["max_staleness_seen"] <= 1
        assert r["async"]["streamed_stages"] == ["genrm", "teacher"]
        assert set(r["async"]["idle"]) == {"rollout", "genrm", "teacher", "trainer"}
    # step 0 on the first weights; every later step generated one version behind its trainer
    assert [r["async"]["staleness"] for r in steps[1:]] == [{"1": 16}, {"1": 16}]
    ids = [
        json.loads(line)["id"]
        for p in sorted(dumps.glob("batch-*.jsonl"))
        for line in p.read_text().splitlines()
    ]
    assert len(ids) == len(set(ids)) == 48
    assert rows[-1]["steps_committed"] == 3 and rows[-1]["final_push"] is not None


def test_kill_9_of_the_genrm_engine_mid_run_ends_it_cleanly(root: Path) -> None:
    job = support.job_file(
        root, example=support.ASYNC_EXAMPLE, steps=4, operation_timeout=10.0, request_timeout=20.0
    )
    dumps = root / "samples"
    with support.relax_run(job, "--json", "--dump-samples", str(dumps)) as proc:
        proc.out.wait_for(r'^\{"step": 0, "batch_id": 0', timeout=300)  # step 0 committed
        os.kill(support.engine_pid(root, "judge"), signal.SIGKILL)
        code = proc.wait(timeout=300)
        rows = _rows(proc)
        summary = rows[-1]
        left = support.left_running(proc, summary)
    assert code == 1, f"{proc.out}\n{proc.err}"
    assert left == [], left
    assert "relax run: stopped; nothing left running" in str(proc.err)
    failed = next(r for r in rows if r.get("failed"))
    committed = [r["step"] for r in rows if "reward_mean" in r]
    assert committed == list(range(failed["step"])) and summary["failed_step"] == failed["step"]
    assert "genrm" in failed["error"] or "judge" in failed["error"], failed
    # Nothing lost: the failed step's samples (and those generated ahead) are in its report
    # and its dump, none of them in a committed batch.
    lost = [
        json.loads(line)["id"]
        for line in (dumps / f"failed-{failed['step']}.jsonl").read_text().splitlines()
    ]
    assert lost and sorted(lost) == sorted(failed["sample_ids"])
    kept = {
        json.loads(line)["id"]
        for p in dumps.glob("batch-*.jsonl")
        for line in p.read_text().splitlines()
    }
    assert not kept & set(lost)

"""The chaos session's accounting (``tests/chaos.py``) over synthetic records: no engine runs.

A resumed run is two drivers' records; what the accounting must catch is a sample in no
committed batch and no failure report (lost), one in two committed batches (trained twice) and a
step nobody reported.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from tests.chaos import DriverRecords, account, expected_ids, read_dumps, verdict


def _row(step: int, **extra: Any) -> dict[str, Any]:
    return {"step": step, "samples": 4, "retries": {}, "recoveries": {}, **extra}


def _batches(*steps: int) -> dict[int, list[str]]:
    return {s: sorted(expected_ids(s)) for s in steps}


def test_a_killed_driver_and_its_resume_that_commit_every_step_once_pass() -> None:
    first = DriverRecords(
        [_row(0), _row(1, retries={"genrm": 2}, recoveries={"genrm": 1})], _batches(0, 1)
    )
    second = DriverRecords(
        [
            _row(2),
            {"step": 3, "failed": True, "error": "ScoringError: x", "kind": "ScoringError",
             "sample_ids": sorted(expected_ids(3))},
            {"summary": True, "step": 99},
        ],
        _batches(2),
    )  # fmt: skip
    report = account(4, [first, second])
    assert report["problems"] == []
    assert report["steps_committed"] == 3 and report["samples_committed"] == 12
    assert report["steps_failed"] == [
        {"step": 3, "kind": "ScoringError", "reason": "ScoringError: x"}
    ]
    assert report["retries"] == {"genrm": 2} and report["recoveries"] == {"genrm": 1}
    assert report["samples_lost"] == 0 and report["samples_trained_twice"] == 0
    report["faults"] = {"kill9": 1, "driver-kill": 1}
    assert verdict(report, steps=4, min_faults=1) == []
    assert verdict(report, steps=100, min_faults=10) == [
        "4 steps run, 100 asked",
        "1 faults injected, at least 10 asked",
    ]


def test_a_step_committed_again_after_the_resume_is_trained_twice() -> None:
    # the checkpoint said step 1 was finished, yet the resumed driver committed it again
    first = DriverRecords([_row(0), _row(1)], _batches(0, 1))
    second = DriverRecords([_row(1), _row(2)], _batches(1, 2), resumed_at=2)
    report = account(3, [first, second])
    assert report["samples_trained_twice"] == 4 and report["steps_committed_twice"] == [1]
    assert report["samples_lost"] == 0 and report["steps_rolled_back_by_resume"] == []


def test_a_step_committed_after_the_last_checkpoint_and_run_again_is_rolled_back() -> None:
    # killed after step 1 was committed (and trained) but before its checkpoint: the resume
    # reloads the trainer's state of before step 1 and runs it again; the weights see it once
    first = DriverRecords([_row(0), _row(1)], _batches(0, 1))
    second = DriverRecords([_row(1), _row(2)], _batches(1, 2), resumed_at=1)
    report = account(3, [first, second])
    assert report["problems"] == []
    assert report["steps_rolled_back_by_resume"] == [1]
    assert report["steps_committed"] == 3 and report["samples_committed"] == 12
    assert report["samples_trained_twice"] == 0 and report["steps_committed_twice"] == []
    # a rolled-back step the resumed driver did not run again is lost
    report = account(3, [first, DriverRecords([_row(2)], _batches(2), resumed_at=1)])
    assert "steps neither committed nor reported failed: [1]" in report["problems"]


def test_samples_in_no_batch_and_no_report_are_lost_and_a_silent_step_is_named() -> None:
    partial = {0: sorted(expected_ids(0))[:3]}  # one sample of step 0 vanished
    report = account(2, [DriverRecords([_row(0, samples=3)], partial)])
    assert report["samples_lost"] == 4 + 1
    assert "steps neither committed nor reported failed: [1]" in report["problems"]
    # a step failed before it generated anything: its samples are reported by its failure
    nameless = {"step": 0, "failed": True, "error": "", "sample_ids": []}
    report = account(1, [DriverRecords([nameless])])
    assert report["samples_lost"] == 0
    assert report["problems"] == ["step 0 failed (driver 0) with no reason"]


def test_a_row_and_its_dump_that_disagree_and_an_uncommitted_dump_are_problems() -> None:
    report = account(1, [DriverRecords([_row(0, samples=3)], _batches(0, 1))])
    assert report["problems"] == [
        "step 0 (driver 0): its row says 3 samples, its batch holds 4",
        "batch 1 dumped by driver 0 but no row committed it",
    ]


def test_read_dumps_sorts_the_files_by_kind(tmp_path: Path) -> None:
    for name, ids in {
        "batch-0": ["b0-p0-s0"],
        "failed-1": ["b1-p0-s0"],
        "dropped-2": ["x"],
    }.items():
        (tmp_path / f"{name}.jsonl").write_text("".join(json.dumps({"id": i}) + "\n" for i in ids))
    assert read_dumps(tmp_path) == ({0: ["b0-p0-s0"]}, {1: ["b1-p0-s0"]}, {2: ["x"]})
    assert read_dumps(tmp_path / "none") == ({}, {}, {})


def test_a_group_regenerated_after_a_failed_generation_is_no_loss_but_only_as_counted() -> None:
    # step 0's group p1 failed on a dead engine: its prompt went out again as group p2
    ids = [*sorted(i for i in expected_ids(0) if "-p1-" not in i), "b0-p2-s0", "b0-p2-s1"]
    row = _row(0, retries={"generate": 1})
    report = account(1, [DriverRecords([row], {0: ids})])
    assert report["problems"] == [] and report["samples_lost"] == 0
    assert report["groups_regenerated"] == 1 and report["retries"] == {"generate": 1}
    # without the count in the row, the missing group is lost
    report = account(1, [DriverRecords([_row(0)], {0: ids})])
    assert report["samples_lost"] == 2 and report["groups_regenerated"] == 0
    # a sample missing from a group is never excused by a regeneration
    partial = [*(i for i in sorted(expected_ids(0)) if i != "b0-p1-s1"), "b0-p2-s0"]
    report = account(1, [DriverRecords([_row(0, retries={"generate": 1})], {0: partial})])
    assert report["samples_lost"] == 1 and report["groups_regenerated"] == 0

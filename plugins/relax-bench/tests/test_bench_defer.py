"""Smoke test of ``relax bench defer``: it runs end to end and reports the documented keys.

No speed is asserted here (timings on a shared test machine are noise); the benchmark itself
compares the overhead with the no-op floor measured in the same run.
"""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
from relax_bench import defer as bench

REQUIRED = {"overhead_ms", "noop_floor_ms", "batch_ms", "target_ms", "within_target"}


def test_quick_run_commits_full_batches_and_reports_overhead_against_the_floor() -> None:
    result = bench.run(quick=True)
    assert set(result) >= REQUIRED
    assert (result["roles"], result["groups"], result["samples_per_group"]) == (3, 64, 8)
    assert result["batch_ms"] >= result["noop_floor_ms"] > 0
    assert result["overhead_ms"] == pytest.approx(
        result["batch_ms"] - result["noop_floor_ms"], abs=0.002
    )
    assert "no-op floor" in bench.format_result(result)


def test_cli_prints_one_json_object_with_the_acceptance_keys() -> None:
    proc = subprocess.run(
        [sys.executable, "-m", "relax_core", "bench", "defer", "--json", "--quick"],
        capture_output=True,
        text=True,
        timeout=120,
        check=True,
    )
    assert set(json.loads(proc.stdout)) >= REQUIRED

"""Smoke test of ``relax bench client``: it runs end to end and reports the documented keys.

No speed is asserted here (timings on a shared test machine are noise); the benchmark itself
reports the ratios against its in-run baseline.
"""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
from relax_bench import client as bench

REQUIRED = {"resolver_per_s", "client_rps", "raw_rps", "client_vs_raw"}


def test_quick_run_reports_positive_rates_and_their_ratio() -> None:
    result = bench.run(quick=True)
    assert set(result) >= REQUIRED
    for key in REQUIRED | {"resolver_affinity_per_s"}:
        assert isinstance(result[key], float), key
        assert result[key] > 0, key
    assert result["replicas"] == 64
    assert result["concurrency"] == 64
    assert "InferenceClient" in bench.format_result(result)


def test_cli_prints_one_json_object_with_the_acceptance_keys() -> None:
    proc = subprocess.run(
        [sys.executable, "-m", "relax_core", "bench", "client", "--json", "--quick"],
        capture_output=True,
        text=True,
        timeout=120,
        check=True,
    )
    result = json.loads(proc.stdout)
    assert set(result) >= REQUIRED
    # One round in a quick run: the median of per-round ratios is that round's ratio.
    assert result["rounds"] == 1
    assert result["client_vs_raw"] == pytest.approx(
        result["client_rps"] / result["raw_rps"], abs=0.01
    )

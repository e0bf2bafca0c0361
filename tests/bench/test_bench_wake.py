"""``relax bench wake``'s pieces that need no served job (the whole benchmark serves a job for
a minute: it is run by ``nox -s bench`` and, on one H200, by ``tools/h200-serve.sh``; the
serving it measures is tested in ``tests/coordination/test_serve_defer.py``)."""

from __future__ import annotations

import subprocess
import sys

from relax_core.bench import wake as bench
from relax_core.jobs.wake import _quantiles


def test_stats_are_nearest_rank_percentiles_in_milliseconds() -> None:
    seconds = [i / 1000 for i in range(1, 101)]  # 1 … 100 ms
    assert bench._stats(seconds) == {"count": 100, "p50_ms": 50.0, "p99_ms": 99.0}
    assert bench._stats([0.2]) == {"count": 1, "p50_ms": 200.0, "p99_ms": 200.0}
    assert bench._stats([]) == {"count": 0}


def test_the_controllers_wake_waits_are_summarised_the_same_way() -> None:
    assert _quantiles([0.3, 0.1, 0.2]) == {"count": 3, "p50_s": 0.2, "p99_s": 0.3, "max_s": 0.3}
    assert _quantiles([]) == {"count": 0}


def test_the_mix_is_seeded_and_weighted_towards_rollout() -> None:
    import random

    rng = random.Random(0)
    plan = [rng.choices(bench.ROLES, bench.MIX_WEIGHTS)[0] for _ in range(240)]
    counts = {r: plan.count(r) for r in bench.ROLES}
    assert counts["rollout"] > counts["genrm"] and counts["rollout"] > counts["teacher"]
    assert min(counts.values()) > 30


def test_job_is_refused_for_a_benchmark_that_serves_none() -> None:
    proc = subprocess.run(
        [sys.executable, "-m", "relax_core", "bench", "placement", "--job", "x.toml"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert proc.returncode != 0
    assert "relax bench placement serves no job" in proc.stderr, proc.stderr

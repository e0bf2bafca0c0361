"""``relax bench wake``'s pieces that need no served job (the whole benchmark serves a job for
a minute: it is run by ``nox -s bench`` and, on one H200, by ``tools/h200-serve.sh``; the
serving it measures is tested in ``tests/coordination/test_serve_defer.py``)."""

from __future__ import annotations

import subprocess
import sys

from relax_bench import wake as bench


def test_stats_are_nearest_rank_percentiles_in_milliseconds() -> None:
    seconds = [i / 1000 for i in range(1, 101)]  # 1 … 100 ms
    assert bench._stats(seconds) == {"count": 100, "p50_ms": 50.0, "p99_ms": 99.0}
    assert bench._stats([0.2]) == {"count": 1, "p50_ms": 200.0, "p99_ms": 200.0}
    assert bench._stats([]) == {"count": 0}


def test_the_mix_sends_half_its_requests_to_the_primary_role_the_same_every_run() -> None:
    roles = ["a", "b", "c"]
    plan = bench.mix_plan(roles, "b", 240)
    assert plan == bench.mix_plan(roles, "b", 240)  # seeded: runs compare
    assert {r: plan.count(r) for r in roles} == {"a": 60, "b": 120, "c": 60}
    assert plan[:120] != ["b"] * 120 and plan != sorted(plan)  # interleaved, not in blocks


def test_gateways_are_read_off_the_status_table() -> None:
    served = bench._Served.__new__(bench._Served)
    served.lines = [
        "  genrm     gateway  http://127.0.0.1:4001/genrm/  (thread)",
        "  prm       gateway  http://127.0.0.1:4003/prm/  (thread)",
        "  rollout   gateway  http://127.0.0.1:4002/rollout/  (thread)",
        "residency: genrm: AWAKE (onload 0.03s)",
    ]
    assert served.gateways() == {
        "genrm": "http://127.0.0.1:4001/genrm",
        "prm": "http://127.0.0.1:4003/prm",
        "rollout": "http://127.0.0.1:4002/rollout",
    }


def test_job_is_refused_for_a_benchmark_that_serves_none() -> None:
    # --job is wake's own option (its add_arguments); another benchmark names what it refused.
    proc = subprocess.run(
        [sys.executable, "-m", "relax_core", "bench", "placement", "--job", "x.toml"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert proc.returncode != 0
    assert "relax bench placement takes no --job" in proc.stderr, proc.stderr

"""The driver's step metrics (``relax run --metrics-port``) move as steps commit, and the port
serves them with the phase histograms."""

from __future__ import annotations

import urllib.request

from prometheus_client import CollectorRegistry

from relax_core.coordination.timeline import Timeline
from relax_core.run.metrics import RunMetrics, serve_metrics
from relax_core.testing import free_port


def test_a_committed_step_moves_the_counters_and_gauges() -> None:
    registry = CollectorRegistry()
    metrics = RunMetrics.of(registry)
    assert RunMetrics.of(registry) is metrics
    metrics.committed({"step": 2, "samples": 16, "tokens": 200, "seconds": 1.5,
                       "reward_mean": 0.25, "weight_version": "2"})  # fmt: skip
    value = registry.get_sample_value
    assert value("relax_run_steps_committed_total") == 1
    assert value("relax_run_samples_committed_total") == 16
    assert value("relax_run_tokens_generated_total") == 200
    assert value("relax_run_step") == 2 and value("relax_run_reward_mean") == 0.25
    assert value("relax_run_weight_version_age_steps") == 0
    assert value("relax_run_step_seconds_count") == 1


def test_the_port_serves_the_phase_histograms_and_the_step_counters() -> None:
    Timeline().record(0, "generate", 0.2)  # into the process's registry, as the driver does
    port = free_port()
    server = serve_metrics(port)
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as answer:
            text = answer.read().decode()
    finally:
        server.shutdown()
        server.server_close()
    assert 'relax_deferred_phase_seconds_count{phase="generate"}' in text
    assert "relax_run_steps_committed_total" in text

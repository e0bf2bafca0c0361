"""``relax run --metrics-port``: the driver's Prometheus metrics (``docs/run.md`` lists them)."""

from __future__ import annotations

import math
import threading
from collections.abc import Mapping
from typing import Any

_BUCKETS = (0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 180, 600, 1800)
_LOCK = threading.Lock()
_SHARED: dict[int, RunMetrics] = {}


class RunMetrics:
    """The step metrics of one registry (one per registry: Prometheus refuses a name twice);
    :meth:`of` gives the process's."""

    def __init__(self, registry: Any) -> None:
        from prometheus_client import Counter, Gauge, Histogram

        def counter(name: str, text: str) -> Any:
            return Counter(name, text, registry=registry)

        def gauge(name: str, text: str) -> Any:
            return Gauge(name, text, registry=registry)

        self.steps = counter("relax_run_steps_committed", "Steps of relax run committed")
        self.failed = counter("relax_run_steps_failed", "Steps of relax run failed or interrupted")
        self.samples = counter("relax_run_samples_committed", "Samples committed to training")
        self.tokens = counter("relax_run_tokens_generated", "Response tokens committed")
        text = "Wall time of each committed step"
        self.seconds = Histogram(
            "relax_run_step_seconds", text, buckets=_BUCKETS, registry=registry
        )
        self.step = gauge("relax_run_step", "The last committed step")
        self.reward = gauge("relax_run_reward_mean", "Mean reward of the last committed step")
        self.staleness = gauge(
            "relax_run_weight_version_age_steps",
            "Steps between the last committed step and the weights its samples came from",
        )

    @classmethod
    def of(cls, registry: Any = None) -> RunMetrics:
        """The metrics in ``registry`` (default: the process's), made on first use."""
        from prometheus_client import REGISTRY

        registry = REGISTRY if registry is None else registry
        with _LOCK:
            found = _SHARED.get(id(registry))
            if found is None:
                found = _SHARED[id(registry)] = cls(registry)
            return found

    def committed(self, row: Mapping[str, Any]) -> None:
        """A committed step's JSON object."""
        self.steps.inc()
        self.samples.inc(row.get("samples") or 0)
        self.tokens.inc(row.get("tokens") or 0)
        self.seconds.observe(row.get("seconds") or 0.0)
        self.step.set(row["step"])
        reward = row.get("reward_mean")
        if isinstance(reward, float) and math.isfinite(reward):
            self.reward.set(reward)
        version = row.get("weight_version")
        if isinstance(version, str) and version.isdigit():
            self.staleness.set(max(0, int(row["step"]) - int(version)))
        elif version == "default" or version is None:
            self.staleness.set(row["step"])


def serve_metrics(port: int, host: str = "127.0.0.1") -> Any:
    """Serve the process's Prometheus registry on ``host:port`` from a daemon thread; the
    server (``shutdown()`` and ``server_close()`` stop it).

    :raises OSError: the port cannot be bound."""
    from prometheus_client import start_http_server

    RunMetrics.of()  # the step metrics are served from the start, at 0
    server, _thread = start_http_server(port, addr=host)
    return server

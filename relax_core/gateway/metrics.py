"""Prometheus metrics of one role gateway (``GET /metrics``), on a registry of its own so that
several gateways can live in one process; the metrics are listed in docs/gateway.md."""

from __future__ import annotations

import threading
from collections.abc import Iterator
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from relax_core._http.failures import FailureClass

#: Every value of the ``error`` label of ``relax_gateway_upstream_errors_total``.
UPSTREAM_ERROR_CLASSES = (
    "unreachable",
    "connect_timeout",
    "transport",
    "deadline",
    "status",
    "bad_json",
    "stream_aborted",
    "stream_stalled",
)

_BUCKETS: tuple[float, ...] = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5)
_BUCKETS += (1, 2.5, 5, 10, 30, 60, 300)


class GatewayMetrics:
    """Counters, histograms and gauges of one gateway. Cheap to update from the event loop."""

    def __init__(self, role: str) -> None:
        self.role = role
        self.registry = CollectorRegistry(auto_describe=True)
        self._requests = Counter(
            "relax_gateway_requests",
            "Requests answered by the role gateway, by route and HTTP status.",
            ("role", "route", "status"),
            registry=self.registry,
        )
        self._latency = Histogram(
            "relax_gateway_request_seconds",
            "Time from request to last response byte, by route.",
            ("role", "route"),
            buckets=_BUCKETS,
            registry=self.registry,
        )
        self._inflight = Gauge(
            "relax_gateway_inflight",
            "Requests the gateway is serving now.",
            ("role",),
            registry=self.registry,
        ).labels(role)
        self._upstream = Counter(
            "relax_gateway_upstream_errors",
            "Upstream failures seen by the gateway, by class.",
            ("role", "error"),
            registry=self.registry,
        )
        self._lock = threading.Lock()
        self._children: dict[tuple[str, int], tuple[Counter, Histogram]] = {}
        for error in UPSTREAM_ERROR_CLASSES:
            self._upstream.labels(role, error)

    def started(self) -> None:
        """A request began."""
        self._inflight.inc()

    def finished(self, route: str, status: int, seconds: float) -> None:
        """A request ended with ``status`` after ``seconds``."""
        self._inflight.dec()
        children = self._children.get((route, status))
        if children is None:
            with self._lock:
                children = self._children[(route, status)] = (
                    self._requests.labels(self.role, route, str(status)),
                    self._latency.labels(self.role, route),
                )
        children[0].inc()
        children[1].observe(seconds)

    def watch_client(self, client: Any) -> None:
        """Export ``client``'s failure counts by class and its circuit breakers (read when
        the metrics are rendered; the client counts them on its own loop)."""
        self.registry.register(_ClientCollector(self.role, client))

    def upstream_error(self, error: str) -> None:
        """Count one upstream failure of class ``error`` (one of :data:`UPSTREAM_ERROR_CLASSES`)."""
        if error not in UPSTREAM_ERROR_CLASSES:
            raise ValueError(
                f"unknown upstream error class {error!r}; known: {UPSTREAM_ERROR_CLASSES}"
            )
        self._upstream.labels(self.role, error).inc()

    def render(self) -> bytes:
        """The metrics in the Prometheus text exposition format."""
        return generate_latest(self.registry)


class _ClientCollector(Collector):
    """The data-path counters an :class:`~relax_core.client.client.InferenceClient` keeps."""

    def __init__(self, role: str, client: Any) -> None:
        self.role = role
        self.client = client

    def collect(self) -> Iterator[Metric]:
        failures = CounterMetricFamily(
            "relax_gateway_upstream_failures",
            "Failed upstream exchanges by failure class (connect: nothing sent; "
            "before_first_byte, mid_stream: sent, never replayed).",
            labels=("role", "class"),
        )
        counts = self.client.failure_counts
        for kind in FailureClass:
            failures.add_metric((self.role, kind.value), counts.get(kind, 0))
        yield failures
        breakers = self.client.breakers
        open_now = GaugeMetricFamily(
            "relax_gateway_breakers_open",
            "Replica heads whose circuit breaker is open now.",
            labels=("role",),
        )
        open_now.add_metric((self.role,), len(breakers.open_urls) if breakers else 0)
        yield open_now
        transitions = CounterMetricFamily(
            "relax_gateway_breaker_transitions",
            "Circuit breakers opened, and closed by a successful probe.",
            labels=("role", "to"),
        )
        transitions.add_metric((self.role, "open"), breakers.opened if breakers else 0)
        transitions.add_metric((self.role, "closed"), breakers.closed if breakers else 0)
        yield transitions

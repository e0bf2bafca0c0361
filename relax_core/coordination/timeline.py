"""The timeline of deferred batches: every phase's duration as the Prometheus histogram
:data:`PHASE_HISTOGRAM` (label ``phase``) and as one Chrome-trace JSON file per run (opens in
Perfetto), each phase one complete event on a lane with its batch id (``docs/coordination.md``)."""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

import attrs

#: The Prometheus histogram every phase duration is observed in.
PHASE_HISTOGRAM = "relax_deferred_phase_seconds"
_BUCKETS = (0.001, 0.005, 0.01, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 180, 600)
_HISTOGRAMS: dict[Any, Any] = {}  # registry -> its histogram
_HISTOGRAMS_LOCK = threading.Lock()


def _histogram(registry: Any) -> Any:
    """One histogram per registry (Prometheus refuses a metric name registered twice)."""
    from prometheus_client import REGISTRY, Histogram

    registry = REGISTRY if registry is None else registry
    with _HISTOGRAMS_LOCK:
        hist = _HISTOGRAMS.get(registry)
        if hist is None:
            hist = _HISTOGRAMS[registry] = Histogram(
                PHASE_HISTOGRAM,
                "Duration of each phase of a deferred batch (lease transitions, scoring stages, "
                "validation, write-back, sink write, commit)",
                ["phase"],
                buckets=_BUCKETS,
                registry=registry,
            )
        return hist


@attrs.frozen
class PhaseEvent:
    """A phase of batch ``step`` began or ended (``failed`` if it raised, ``interrupted`` if it
    was cancelled); an ended one has its trace lane and its wall-clock start."""

    step: int
    name: str
    ended: bool
    seconds: float = 0.0
    failed: bool = False
    interrupted: bool = False
    lane: str = "batch"
    started: float = 0.0

    @property
    def state(self) -> str:
        """``begin``, ``end``, ``failed`` or ``interrupted``."""
        if not self.ended:
            return "begin"
        return "interrupted" if self.interrupted else "failed" if self.failed else "end"


class Timeline:
    """Records phase durations of deferred batches.

    :param trace_path: where the run's Chrome-trace JSON goes (rewritten at each :meth:`flush`).
    :param registry: the Prometheus ``CollectorRegistry`` (default: the process's).
    :param on_event: told as each phase begins and ends (from the phase's thread; must not
        raise). Thread-safe."""

    def __init__(
        self,
        *,
        trace_path: str | None = None,
        registry: Any = None,
        run: str = "relax",
        on_event: Callable[[PhaseEvent], None] | None = None,
    ) -> None:
        self.trace_path = trace_path
        self._on_event = on_event
        self.run = run
        self._histogram = _histogram(registry)
        self._lock = threading.Lock()
        self._events: list[dict[str, Any]] = []
        self._lanes: dict[str, int] = {}
        self._phases: dict[int, dict[str, float]] = {}
        self._switches: dict[int, int] = {}
        self._metadata: dict[str, Any] = {}
        self._pid = os.getpid()

    @contextlib.contextmanager
    def phase(self, batch_id: int, name: str, *, lane: str = "batch") -> Iterator[None]:
        """Time the block as phase ``name`` of batch ``batch_id`` (recorded even if it raises:
        ``failed``, or ``interrupted`` when it was cancelled)."""
        if self._on_event is not None:
            self._on_event(PhaseEvent(batch_id, name, ended=False))
        start_wall = time.time_ns() // 1000
        start = time.perf_counter()
        outcome = "failed"
        try:
            yield
            outcome = "ok"
        except (asyncio.CancelledError, KeyboardInterrupt):
            outcome = "interrupted"
            raise
        finally:
            self.record(
                batch_id, name, time.perf_counter() - start, start_us=start_wall, lane=lane,
                failed=outcome == "failed", interrupted=outcome == "interrupted",
            )  # fmt: skip

    def record(
        self,
        batch_id: int,
        name: str,
        seconds: float,
        *,
        start_us: int | None = None,
        lane: str = "batch",
        failed: bool = False,
        interrupted: bool = False,
    ) -> None:
        """Record a phase measured elsewhere (``generate``, timed by the producer)."""
        if start_us is None:
            start_us = time.time_ns() // 1000 - int(seconds * 1e6)
        self._histogram.labels(phase=name).observe(seconds)
        with self._lock:
            tid = self._lanes.setdefault(lane, len(self._lanes) + 1)
            args: dict[str, Any] = {"batch": batch_id}
            args |= {k: True for k, v in (("failed", failed), ("interrupted", interrupted)) if v}
            self._events.append(
                {"name": name, "cat": "deferred", "ph": "X", "ts": start_us,
                 "dur": max(1, int(seconds * 1e6)), "pid": self._pid, "tid": tid, "args": args}
            )  # fmt: skip
            phases = self._phases.setdefault(batch_id, {})
            phases[name] = phases.get(name, 0.0) + seconds
            if lane == "leases" and name.endswith((".onload", ".offload")):
                self._switches[batch_id] = self._switches.get(batch_id, 0) + 1
        if self._on_event is not None:
            self._on_event(
                PhaseEvent(
                    batch_id, name, ended=True, seconds=seconds, failed=failed,
                    interrupted=interrupted, lane=lane, started=start_us / 1e6,
                )
            )  # fmt: skip

    def phases(self, batch_id: int) -> dict[str, float]:
        """Phase name -> seconds of batch ``batch_id`` (repeated phases add up)."""
        with self._lock:
            return dict(self._phases.get(batch_id, {}))

    def switches(self, batch_id: int) -> int:
        """How many onloads and offloads batch ``batch_id`` issued (on the ``leases`` lane)."""
        with self._lock:
            return self._switches.get(batch_id, 0)

    def counter(self, name: str, values: dict[str, float]) -> None:
        """Record counter values at this moment: a trace counter track ``name``, each key a
        series."""
        counts = {k: float(v) for k, v in values.items()}
        with self._lock:
            self._events.append(
                {"name": name, "cat": "counters", "ph": "C", "ts": time.time_ns() // 1000,
                 "pid": self._pid, "args": counts}
            )  # fmt: skip

    def describe(self, key: str, value: Any) -> None:
        """Keep ``value`` (JSON data) in the trace document under ``otherData[key]``."""
        with self._lock:
            self._metadata[key] = value

    def trace(self) -> dict[str, Any]:
        """The Chrome trace-event document of every recorded phase."""
        with self._lock:
            meta: list[dict[str, Any]] = [
                {"name": "process_name", "ph": "M", "pid": self._pid, "tid": 0,
                 "args": {"name": self.run}},
            ]  # fmt: skip
            meta += [
                {"name": "thread_name", "ph": "M", "pid": self._pid, "tid": tid,
                 "args": {"name": lane}}
                for lane, tid in self._lanes.items()
            ]  # fmt: skip
            doc: dict[str, Any] = {
                "traceEvents": meta + list(self._events),
                "displayTimeUnit": "ms",
            }
            if self._metadata:
                doc["otherData"] = dict(self._metadata)
            return doc

    def flush(self) -> str | None:
        """Write the trace to ``trace_path`` (atomically); return the path, or ``None``."""
        if self.trace_path is None:
            return None
        doc = self.trace()
        tmp = f"{self.trace_path}.tmp-{os.getpid()}"
        with open(tmp, "w") as f:
            json.dump(doc, f)
        os.replace(tmp, self.trace_path)
        return self.trace_path

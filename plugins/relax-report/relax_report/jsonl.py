"""The ``jsonl`` tracker: every call as one JSON object per line of ``RUN_DIR/run.jsonl``.

Each line has ``type`` (``config``, ``metrics``, ``span``, ``samples``, ``close``) and ``time``
(wall clock, seconds since the epoch), then the call's own data: ``config``; ``step`` and
``metrics``; the span's fields; ``step`` and ``samples``; the run's ``summary``. Every line is
flushed as it is written, so a run that dies leaves what it did. ``relax report`` reads it.
"""

from __future__ import annotations

import json
import math
import os
import time
from collections.abc import Mapping, Sequence
from typing import Any

from relax_core import PhaseSpan, TrackerContext

__all__ = ["FILE_NAME", "JsonlTracker"]

#: The file in the run's directory (the ``file`` option names another, relative to it).
FILE_NAME = "run.jsonl"


def _finite(value: Any) -> Any:
    """``value`` with every non-finite float as ``None`` (JSON has no NaN)."""
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, Mapping):
        return {str(k): _finite(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [_finite(v) for v in value]
    return value


class JsonlTracker:
    """Writes the run's calls to ``RUN_DIR/run.jsonl`` (see the module docstring)."""

    def __init__(self, context: TrackerContext) -> None:
        self.path = os.path.join(context.run_dir, str(context.options.get("file", FILE_NAME)))
        os.makedirs(os.path.dirname(self.path) or ".", exist_ok=True)
        self._file = open(self.path, "a")  # noqa: SIM115 - open until close()
        #: Write RUN_DIR/report.html when closed (the ``report`` option; ``relax run --report``).
        self.report = bool(context.options.get("report", False))

    def _line(self, kind: str, **data: Any) -> None:
        row = {"type": kind, "time": time.time(), **data}
        self._file.write(json.dumps(_finite(row), default=str) + "\n")
        self._file.flush()

    def log_config(self, config: Mapping[str, Any]) -> None:
        self._line("config", config=config)

    def log_metrics(self, step: int, metrics: Mapping[str, float]) -> None:
        self._line("metrics", step=step, metrics=metrics)

    def log_span(self, span: PhaseSpan) -> None:
        self._line("span", **span.row())

    def log_samples(self, step: int, samples: Sequence[Mapping[str, Any]]) -> None:
        self._line("samples", step=step, samples=list(samples))

    def close(self, summary: Mapping[str, Any] | None) -> None:
        if not self._file.closed:
            self._line("close", summary=summary)
            self._file.close()
            if self.report:
                # The page is drawn from the lines just written (relax run --report).
                from relax_report.report import write_report

                write_report(os.path.dirname(self.path))

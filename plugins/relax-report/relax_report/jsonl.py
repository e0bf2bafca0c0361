"""The ``jsonl`` tracker: every call as one JSON object per line of ``RUN_DIR/run.jsonl``.

Each line has ``type`` (``config``, ``metrics``, ``span``, ``samples``, ``close``) and ``time``
(wall clock, seconds since the epoch), then the call's own data: ``config``; ``step`` and
``metrics``; the span's fields; ``step`` and ``samples``; the run's ``summary``. Every line is
flushed as it is written, so a run that dies leaves what it did. ``relax report`` reads it.

A resumed run (``relax run --resume``) appends to the same file, as one run: the lines of the
steps from the resumed one on (what the killed run logged of steps it never checkpointed) and
an old ``close`` line are dropped first (the file rewritten in one rename), and the run's
``config`` line stays its only header: the resumed run writes a ``resume`` line instead
(``step``, ``run_id``). The first ``config`` line carries the run's ``run_id``.
"""

from __future__ import annotations

import json
import math
import os
import time
import uuid
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
        #: The run's id (kept in the checkpoints; a resumed run goes on with it).
        self.run_id = context.resume_id or uuid.uuid4().hex
        self.resume_step = context.resume_step
        if self.resume_step is not None:
            _drop_from(self.path, self.resume_step)
        self._file = open(self.path, "a")  # noqa: SIM115 - open until close()
        #: Write RUN_DIR/report.html when closed (the ``report`` option; ``relax run --report``).
        self.report = bool(context.options.get("report", False))

    def _line(self, kind: str, **data: Any) -> None:
        row = {"type": kind, "time": time.time(), **data}
        self._file.write(json.dumps(_finite(row), default=str) + "\n")
        self._file.flush()

    def log_config(self, config: Mapping[str, Any]) -> None:
        if self.resume_step is not None:
            self._line("resume", step=self.resume_step, run_id=self.run_id)
        else:
            self._line("config", config=config, run_id=self.run_id)

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


def _drop_from(path: str, step: int) -> None:
    """Rewrite ``path`` without its lines of ``step`` and later and its ``close`` lines."""
    if not os.path.exists(path):
        return
    kept = []
    with open(path) as f:
        for line in f:
            try:
                row = json.loads(line)
            except ValueError:
                continue  # a line a kill cut short
            if row.get("type") == "close":
                continue
            if isinstance(row.get("step"), int) and row["step"] >= step:
                continue
            kept.append(line if line.endswith("\n") else line + "\n")
    with open(f"{path}.tmp", "w") as f:
        f.writelines(kept)
    os.replace(f"{path}.tmp", path)

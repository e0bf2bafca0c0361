"""The ``tensorboard`` tracker: each committed step's metrics as TensorBoard scalars, the config
and the samples as text, in ``RUN_DIR/tensorboard`` (``tensorboard --logdir RUN_DIR``).

Written with :class:`~relax_report.tfevents.EventWriter` (no TensorFlow, torch or
protobuf). Phase spans are not kept one by one: each step's phase seconds are among its scalars
(``time/<phase>``), and ``relax report`` and the trace have every span.

A resumed run (``relax run --resume``) writes a new event file in the same folder, so
TensorBoard shows one run: it starts with a ``SessionLog.START`` at the resumed step, which
makes TensorBoard drop what the killed run logged at that step and later, and the config is
not written again.
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping, Sequence
from typing import Any

from relax_core import PhaseSpan, TrackerContext
from relax_report.tfevents import EventWriter

__all__ = ["TensorBoardTracker", "samples_markdown"]


def _cell(value: Any) -> str:
    if isinstance(value, float):
        return f"{value:.4g}"
    if isinstance(value, Mapping):
        return ", ".join(f"{k}: {_cell(v)}" for k, v in value.items())
    text = "" if value is None else str(value)
    return text.replace("|", "\\|").replace("\n", " ")


def samples_markdown(samples: Sequence[Mapping[str, Any]]) -> str:
    """Sample rows as a Markdown table (TensorBoard's text tab renders it)."""
    columns = ("id", "reward", "rewards", "teacher_kl", "prompt", "response")
    lines = ["| " + " | ".join(columns) + " |", "|" + "---|" * len(columns)]
    lines += ["| " + " | ".join(_cell(s.get(c)) for c in columns) + " |" for s in samples]
    return "\n".join(lines)


class TensorBoardTracker:
    """Writes scalars and text to ``RUN_DIR/tensorboard`` (see the module docstring); the
    ``dir`` option names another folder, relative to the run's directory."""

    def __init__(self, context: TrackerContext) -> None:
        folder = str(context.options.get("dir", "tensorboard"))
        #: The run's id: its folder, relative to the run's directory.
        self.run_id = folder
        self.resumed = context.resume_step is not None
        self.writer = EventWriter(os.path.join(context.run_dir, folder))
        if context.resume_step is not None:
            self.writer.restart(context.resume_step)

    def log_config(self, config: Mapping[str, Any]) -> None:
        if self.resumed:
            return  # the run's first event file has it
        text = json.dumps(config, indent=2, default=str)
        self.writer.text(0, "config", "\n".join("    " + line for line in text.splitlines()))

    def log_metrics(self, step: int, metrics: Mapping[str, float]) -> None:
        self.writer.scalars(step, metrics)

    def log_span(self, span: PhaseSpan) -> None:
        """Kept as the step's ``time/<phase>`` scalars instead (see the module docstring)."""

    def log_samples(self, step: int, samples: Sequence[Mapping[str, Any]]) -> None:
        self.writer.text(step, "samples", samples_markdown(samples))

    def close(self, summary: Mapping[str, Any] | None) -> None:
        self.writer.close()

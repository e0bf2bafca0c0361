"""Relax's run records and their report: the ``jsonl`` and ``tensorboard`` trackers and the
``relax report RUN_DIR`` command.

- :mod:`~relax_report.jsonl`: every tracker call as a JSON line of ``RUN_DIR/run.jsonl`` (its
  ``report`` option, which ``relax run --report`` sets, also writes the page when it closes);
- :mod:`~relax_report.tensorboard`: scalars per step and sample text in ``RUN_DIR/tensorboard``
  (:mod:`~relax_report.tfevents`: TensorBoard's event file without TensorFlow);
- :mod:`~relax_report.report`: the page (:mod:`~relax_report.data`, :mod:`~relax_report.page`,
  :mod:`~relax_report.svg`), and :mod:`~relax_report.command`, ``relax report``.
"""

from __future__ import annotations

from collections.abc import Callable

from relax_core import CommandSpec, TrackerSpec, hookimpl
from relax_report import command
from relax_report.jsonl import JsonlTracker
from relax_report.tensorboard import TensorBoardTracker

__all__ = ["JSONL", "REPORT", "TENSORBOARD", "relax_register_commands", "relax_register_trackers"]

JSONL = TrackerSpec(
    name="jsonl",
    open=JsonlTracker,
    options=("file", "report"),
    description="Every call as a JSON line of RUN_DIR/run.jsonl (what relax report reads).",
)
TENSORBOARD = TrackerSpec(
    name="tensorboard",
    open=TensorBoardTracker,
    options=("dir",),
    description="Scalars per step and sample text in RUN_DIR/tensorboard (no TensorFlow).",
)
REPORT = CommandSpec(
    name=command.NAME,
    help=command.HELP,
    add_arguments=command.add_arguments,
    run=command.run,
)


@hookimpl
def relax_register_trackers(register: Callable[[TrackerSpec], None]) -> None:
    """Register jsonl and tensorboard."""
    register(JSONL)
    register(TENSORBOARD)


@hookimpl
def relax_register_commands(register: Callable[[CommandSpec], None]) -> None:
    """Register ``relax report``."""
    register(REPORT)

"""The core's two trackers, registered by its own plugin (``relax_core.builtins``): ``jsonl``
and ``tensorboard``."""

from __future__ import annotations

from collections.abc import Callable

from relax_core.hookspecs import hookimpl
from relax_core.records import TrackerSpec
from relax_core.tracking.jsonl import JsonlTracker
from relax_core.tracking.tensorboard import TensorBoardTracker

__all__ = ["JSONL", "TENSORBOARD", "relax_register_trackers"]

JSONL = TrackerSpec(
    name="jsonl",
    open=JsonlTracker,
    options=("file",),
    description="Every call as a JSON line of RUN_DIR/run.jsonl (what relax report reads).",
)
TENSORBOARD = TrackerSpec(
    name="tensorboard",
    open=TensorBoardTracker,
    options=("dir",),
    description="Scalars per step and sample text in RUN_DIR/tensorboard (no TensorFlow).",
)


@hookimpl
def relax_register_trackers(register: Callable[[TrackerSpec], None]) -> None:
    """Register jsonl and tensorboard."""
    register(JSONL)
    register(TENSORBOARD)

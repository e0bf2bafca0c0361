"""Experiment trackers of ``relax run``: who hears what a run did.

- :mod:`~relax_core.tracking.tracker`: the :class:`Tracker` protocol, the
  :class:`TrackerContext` a tracker is opened with, the :class:`PhaseSpan` of a phase and the
  :class:`TrackerEntry` of ``[run] trackers``;
- :mod:`~relax_core.tracking.hub`: :class:`Trackers`, a run's open trackers fed from a thread
  of their own (a failing one reported once), and :func:`tracker_problems`;
- :mod:`~relax_core.tracking.metrics`: a step's metrics and the sample rows trackers hear.

The trackers themselves are plugins' (``jsonl`` and ``tensorboard``: the relax-report plugin).

See ``docs/run.md`` (trackers) and ``docs/plugins.md`` (writing one).
"""

from relax_core._exports import claim as _claim
from relax_core.tracking.hub import Trackers, tracker_problems
from relax_core.tracking.metrics import (
    ROLLOUT_METRICS,
    reward_by_key,
    rollout_metrics,
    sample_rows,
    step_metrics,
)
from relax_core.tracking.tracker import PhaseSpan, Tracker, TrackerContext, TrackerEntry

__all__ = [
    "ROLLOUT_METRICS",
    "PhaseSpan",
    "Tracker",
    "TrackerContext",
    "TrackerEntry",
    "Trackers",
    "reward_by_key",
    "rollout_metrics",
    "sample_rows",
    "step_metrics",
    "tracker_problems",
]

_claim(__name__, globals(), __all__)

"""Experiment trackers of ``relax run``: the protocol, a run's open trackers and what they
hear of a step; the trackers themselves are plugins' (``docs/plugins.md``)."""

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

"""What a tracker is: the :class:`Tracker` protocol ``relax run`` calls, the
:class:`TrackerContext` it is opened with, the :class:`PhaseSpan` of a phase it hears, and the
:class:`TrackerEntry` of ``[run] trackers`` that names it.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any, Protocol, runtime_checkable

import attrs

__all__ = ["PhaseSpan", "Tracker", "TrackerContext", "TrackerEntry"]


@attrs.frozen
class TrackerEntry:
    """One entry of ``[run] trackers``: the tracker's registered name, the entry's other keys
    (``options``, the tracker's own) and where the job file has it (``run.trackers[1]``)."""

    name: str
    options: Mapping[str, Any] = attrs.field(factory=dict)
    path: str = "run.trackers"


@attrs.frozen
class TrackerContext:
    """What a tracker is opened with (``TrackerSpec.open(context)``).

    ``run_dir``: the run's directory (it exists); a tracker keeps its files under it, in a
    folder named after itself by convention (``RUN_DIR/tensorboard``). ``job``: the job's name
    (``relax run --job``; a run's name in a tracker's UI). ``options``: the entry's own keys,
    as the job file gives them. ``name``: the tracker's registered name.

    ``resume_step``: set when ``relax run --resume`` continues a run: the first step the
    resumed run logs (what the tracker holds of that step and later ones is the killed run's,
    never committed as the resumed run commits it: drop or supersede it), and ``resume_id``
    the run id this tracker had (its ``run_id`` attribute, kept in the checkpoint; ``None``
    if it had none), so it appends to the same run instead of starting another. ``None``: a
    new run.
    """

    name: str
    run_dir: str
    job: str
    options: Mapping[str, Any] = attrs.field(factory=dict)
    resume_step: int | None = None
    resume_id: str | None = None


@attrs.frozen
class PhaseSpan:
    """One phase of a step as it ended: its name (``generate``, ``genrm``, ``genrm.onload`` …),
    the step, the trace lane it is on (``leases`` for a role's onload and offload, ``batch``
    for the rest), its start (wall clock, seconds since the epoch) and seconds; ``failed`` if
    it raised, ``interrupted`` if Ctrl-C cancelled it."""

    step: int
    name: str
    start: float
    seconds: float
    lane: str = "batch"
    failed: bool = False
    interrupted: bool = False

    def row(self) -> dict[str, Any]:
        """The span as a JSON object."""
        return attrs.asdict(self)


@runtime_checkable
class Tracker(Protocol):
    """An experiment tracker, as ``relax run`` calls it: from one thread of the driver (never
    two calls at once), in the order the run produced them, off the step loop (a slow tracker
    delays no step). A method that raises is reported once and the tracker is left out for
    the rest of the run (``strict_trackers``: the run ends instead); :meth:`close` is called
    once in every case that opened it, a failure and Ctrl-C included.

    A tracker may also have a ``run_id`` attribute (a string: the id of its run, a W&B run
    id, a file's): ``relax run`` keeps it in each checkpoint and gives it back as
    :attr:`TrackerContext.resume_id` when the run is resumed.
    """

    def log_config(self, config: Mapping[str, Any]) -> None:
        """The run's config, once, before anything else: JSON data (the job, its ``[run]``
        settings, its roles and models, the placement and residency plan)."""
        ...

    def log_metrics(self, step: int, metrics: Mapping[str, float]) -> None:
        """A committed step's metrics: flat names (``reward/mean``, ``teacher/kl``,
        ``time/genrm``; docs/run.md lists them) to finite numbers."""
        ...

    def log_span(self, span: PhaseSpan) -> None:
        """A phase of a step, as it ended (committed or not)."""
        ...

    def log_samples(self, step: int, samples: Sequence[Mapping[str, Any]]) -> None:
        """Some of a committed step's samples, to inspect (``[run] tracker_samples`` of them):
        ``id``, ``group_id``, ``prompt``, ``response``, ``label``, ``reward``, ``rewards`` (each
        adapter's, by key), ``teacher_kl`` (``None`` without teacher log-probs) and
        ``response_tokens``."""
        ...

    def close(self, summary: Mapping[str, Any] | None) -> None:
        """The run ended: its summary (``--json``'s last object; ``None`` when the steps never
        ran); flush and release everything."""
        ...

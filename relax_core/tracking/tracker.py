"""What a tracker is: the :class:`Tracker` protocol, the :class:`TrackerContext` it is opened
with, the :class:`PhaseSpan` it hears, and the :class:`TrackerEntry` of ``[run] trackers``."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any, Protocol, runtime_checkable

import attrs


@attrs.frozen
class TrackerEntry:
    """One entry of ``[run] trackers``: the tracker's registered name, the entry's other keys
    (``options``, the tracker's own) and where the job file has it (``run.trackers[1]``)."""

    name: str
    options: Mapping[str, Any] = attrs.field(factory=dict)
    path: str = "run.trackers"


@attrs.frozen
class TrackerContext:
    """What a tracker is opened with (``TrackerSpec.open(context)``): it keeps its files under
    ``run_dir/<name>``; ``options``: the entry's own keys. With ``relax run --resume``,
    ``resume_step`` is the first step the resumed run logs (what the tracker holds of it and
    later is the killed run's: drop or supersede it) and ``resume_id`` the tracker's ``run_id``
    from the checkpoint, to append to the same run (``None``: a new run)."""

    name: str
    run_dir: str
    job: str
    options: Mapping[str, Any] = attrs.field(factory=dict)
    resume_step: int | None = None
    resume_id: str | None = None


@attrs.frozen
class PhaseSpan:
    """One phase of a step as it ended: its name (``generate``, ``genrm.onload`` …), step, trace
    lane (``leases`` for onloads and offloads, else ``batch``), start (epoch seconds) and seconds;
    ``failed`` if it raised, ``interrupted`` if Ctrl-C cancelled it."""

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
    """An experiment tracker, as ``relax run`` calls it: from one driver thread, in order, off the
    step loop. A method that raises is reported once and the tracker dropped (``strict_trackers``:
    the run ends); :meth:`close` is called once whatever happens. An optional ``run_id`` attribute
    is kept in each checkpoint and given back as :attr:`TrackerContext.resume_id` on resume."""

    def log_config(self, config: Mapping[str, Any]) -> None:
        """The run's config, once, before anything else: JSON data (the job, its ``[run]``
        settings, its roles and models, the placement and residency plan)."""

    def log_metrics(self, step: int, metrics: Mapping[str, float]) -> None:
        """A committed step's metrics: flat names (``reward/mean``, ``teacher/kl``,
        ``time/genrm``; docs/run.md lists them) to finite numbers."""

    def log_span(self, span: PhaseSpan) -> None:
        """A phase of a step, as it ended (committed or not)."""

    def log_samples(self, step: int, samples: Sequence[Mapping[str, Any]]) -> None:
        """Some of a committed step's samples, to inspect (``[run] tracker_samples`` of them):
        ``id``, ``group_id``, ``prompt``, ``response``, ``label``, ``reward``, ``rewards`` (each
        adapter's, by key), ``teacher_kl`` (``None`` without teacher log-probs) and
        ``response_tokens``."""

    def close(self, summary: Mapping[str, Any] | None) -> None:
        """The run ended: its summary (``--json``'s last object; ``None`` when the steps never
        ran); flush and release everything."""

"""The trackers of one run, fed from a worker thread so a slow tracker never delays a step."""

from __future__ import annotations

import queue
import threading
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from relax_core.config import ConfigReader, hint
from relax_core.errors import ConfigProblem, TrackerError
from relax_core.plugins import PluginManager
from relax_core.tracking.tracker import PhaseSpan, Tracker, TrackerContext, TrackerEntry

#: Seconds :meth:`Trackers.close` waits for the trackers to take what is queued and close.
CLOSE_SECONDS = 120.0

_STOP = object()


def tracker_problems(entries: Sequence[TrackerEntry], pm: PluginManager) -> list[ConfigProblem]:
    """Every problem with ``entries`` before anything starts (unknown, twice, an unknown
    option)."""
    r = ConfigReader()
    known = pm.registered("trackers")
    seen: dict[str, str] = {}
    for entry in entries:
        if entry.name in seen:
            r.problem(
                entry.path,
                "duplicate",
                f"tracker {entry.name!r} is listed twice ({seen[entry.name]} and "
                f"{entry.path}); list it once",
            )
            continue
        seen[entry.name] = entry.path
        if entry.name not in known:
            r.problem(
                entry.path,
                "plugin",
                f"no tracker named {entry.name!r} is registered (registered: "
                f"{', '.join(sorted(known)) or 'none'}){hint(entry.name, known)} Install the "
                "plugin that provides it (relax plugins lists the trackers)",
            )
            continue
        allowed = known[entry.name].record.options
        if allowed is None:
            continue
        for key in entry.options:
            if key not in allowed:
                r.problem(
                    f"{entry.path}.{key}",
                    "unknown-key",
                    f"tracker {entry.name!r} has no option {key!r} (its options: "
                    f"{', '.join(allowed) or 'none'}){hint(key, allowed)}",
                )
    return r.problems


class Trackers:
    """The open trackers of a run; one that raises is reported once (``say``) and hears
    nothing more but ``close``; with ``strict`` the
    :class:`~relax_core.errors.TrackerError` is raised from the next call, ending the run."""

    def __init__(
        self,
        opened: Sequence[tuple[str, Tracker]],
        *,
        say: Callable[[str], None],
        strict: bool = False,
    ) -> None:
        self.say = say
        self.strict = strict
        self._live: list[tuple[str, Tracker]] = list(opened)
        self._all = list(opened)
        #: tracker name -> what failed (``log_metrics (step 2): RuntimeError: …``)
        self.failures: dict[str, str] = {}
        self._error: TrackerError | None = None
        self._raised = False
        self._queue: queue.SimpleQueue[Any] = queue.SimpleQueue()
        self._closed = False
        self._worker = threading.Thread(target=self._work, name="relax-trackers", daemon=True)
        if self._all:
            self._worker.start()

    @classmethod
    def open(
        cls,
        entries: Sequence[TrackerEntry],
        pm: PluginManager,
        *,
        run_dir: str,
        job: str,
        say: Callable[[str], None],
        strict: bool = False,
        resume_step: int | None = None,
        resume_ids: Mapping[str, str | None] | None = None,
    ) -> Trackers:
        """Open every tracker of ``entries`` in order; one whose ``open`` raises is reported
        and left out. ``resume_step`` / ``resume_ids`` (name -> run id): ``--resume``'s.

        :raises TrackerError: with ``strict``, the first that failed to open (the others closed)."""
        opened: list[tuple[str, Tracker]] = []
        failures: dict[str, str] = {}
        for entry in entries:
            spec = pm.tracker(entry.name)
            context = TrackerContext(
                entry.name,
                run_dir,
                job,
                dict(entry.options),
                resume_step=resume_step,
                resume_id=(resume_ids or {}).get(entry.name),
            )
            try:
                opened.append((entry.name, spec.open(context)))
            except Exception as exc:
                error = TrackerError(entry.name, "open", f"{type(exc).__name__}: {exc}")
                if strict:
                    for _, tracker in opened:
                        try:
                            tracker.close(None)
                        except Exception as closing:
                            error.add_note(f"closing another tracker failed too: {closing}")
                    raise error from exc
                failures[entry.name] = f"open: {type(exc).__name__}: {exc}"
                say(_report(error))
        trackers = cls(opened, say=say, strict=strict)
        trackers.failures.update(failures)
        return trackers

    @property
    def names(self) -> list[str]:
        """Every tracker that was opened, in order."""
        return [name for name, _ in self._all]

    def run_ids(self) -> dict[str, str | None]:
        """Each opened tracker's ``run_id`` attribute (``None`` without one): what a
        checkpoint keeps so a resumed run's trackers append to the same runs."""
        ids = {name: getattr(tracker, "run_id", None) for name, tracker in self._all}
        return {name: None if value is None else str(value) for name, value in ids.items()}

    # -- what the loop calls (each returns at once) --------------------------------------------

    def log_config(self, config: Mapping[str, Any]) -> None:
        """The run's config (once, first)."""
        self._put("log_config", None, config)

    def log_metrics(self, step: int, metrics: Mapping[str, float]) -> None:
        """A committed step's metrics."""
        self._put("log_metrics", step, step, dict(metrics))

    def log_span(self, span: PhaseSpan) -> None:
        """A phase that ended."""
        self._put("log_span", span.step, span)

    def log_samples(self, step: int, samples: Sequence[Mapping[str, Any]]) -> None:
        """A committed step's samples to inspect."""
        if samples:
            self._put("log_samples", step, step, list(samples))

    def close(self, summary: Mapping[str, Any] | None, *, timeout: float = CLOSE_SECONDS) -> None:
        """Hand every tracker what is queued, then close each (a failed one too, quietly);
        wait at most ``timeout`` seconds. Idempotent.

        :raises TrackerError: with ``strict``, a tracker failed (or did not close in time)."""
        if self._closed:
            return
        self._closed = True
        if self._all:
            self._queue.put(("close", None, (summary,)))
            self._queue.put(_STOP)
            self._worker.join(timeout)
            if self._worker.is_alive():
                late = f"the trackers did not close within {timeout:g}s"
                error = TrackerError(", ".join(self.names), "close", late)
                self.say(f"relax run: {error}; their last records may be missing")
                if self.strict and self._error is None:
                    self._error = error
        self.check()

    def check(self) -> None:
        """:raises TrackerError: with ``strict``, a tracker has failed (raised once: the run
        ends on it)."""
        if self.strict and self._error is not None and not self._raised:
            self._raised = True
            raise self._error

    # -- the worker ------------------------------------------------------------------------

    def _put(self, call: str, step: int | None, *args: Any) -> None:
        self.check()
        if self._live and not self._closed:
            self._queue.put((call, step, args))

    def _work(self) -> None:
        while True:
            item = self._queue.get()
            if item is _STOP:
                return
            call, step, args = item
            if call == "close":
                self._close_all(args[0])
                continue
            for name, tracker in list(self._live):
                try:
                    getattr(tracker, call)(*args)
                except Exception as exc:
                    where = call if step is None else f"{call} (step {step})"
                    self._fail(name, tracker, where, exc)

    def _fail(self, name: str, tracker: Tracker, where: str, exc: BaseException) -> None:
        self._live = [(n, t) for n, t in self._live if t is not tracker]
        text = f"{type(exc).__name__}: {exc}"
        self.failures[name] = f"{where}: {text}"
        error = TrackerError(name, where, text)
        if self._error is None:
            self._error = error
        self.say(_report(error, strict=self.strict))

    def _close_all(self, summary: Mapping[str, Any] | None) -> None:
        for name, tracker in self._all:
            live = any(t is tracker for _, t in self._live)
            try:
                tracker.close(summary)
            except Exception as exc:
                if live:
                    self._fail(name, tracker, "close", exc)


def _report(error: TrackerError, *, strict: bool = False) -> str:
    if strict:
        return f"relax run: {error}; strict_trackers: the run ends"
    return (
        f"relax run: {error}; the run goes on without it (reported once; strict_trackers = "
        "true ends the run instead)"
    )

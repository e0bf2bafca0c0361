"""What ``relax run`` prints: progress while a step runs, one line (or JSON object) per step.

:class:`PhaseTimeline` is the deferred batch's :class:`~relax_core.coordination.Timeline`
that also tells a listener when each phase begins and ends. :class:`Printer` turns those
events and the step results into output:

- **progress**: each phase as it ends (``  · step 1 genrm.onload 0.21s``), and while one runs
  on a terminal a status line rewritten in place;
- **one line per step**: reward mean ± std, parse failures, teacher KL (or the teacher's
  log-prob mean), tokens generated, the weight version its samples were generated with, and
  the step's phase times;
- with ``json``: one JSON object per committed step on stdout (progress goes to stderr), and
  a summary object at the end.
"""

from __future__ import annotations

import contextlib
import json
import sys
import time
from collections.abc import Callable, Iterator
from typing import Any, TextIO

import attrs

from relax_core.coordination.timeline import Timeline

__all__ = ["PhaseEvent", "PhaseTimeline", "Printer"]


@attrs.frozen
class PhaseEvent:
    """A phase of step ``step`` began (``seconds`` 0) or ended (``failed`` if it raised)."""

    step: int
    name: str
    ended: bool
    seconds: float = 0.0
    failed: bool = False


class PhaseTimeline(Timeline):
    """A :class:`~relax_core.coordination.Timeline` that calls ``on_event`` as each phase
    begins and ends (thread-safe as the timeline is; the callback must not raise)."""

    def __init__(self, on_event: Callable[[PhaseEvent], None], **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self._on_event = on_event

    @contextlib.contextmanager
    def phase(self, batch_id: int, name: str, *, lane: str = "batch") -> Iterator[None]:
        """See :meth:`Timeline.phase`; the listener hears the beginning too."""
        self._on_event(PhaseEvent(batch_id, name, ended=False))
        with super().phase(batch_id, name, lane=lane):
            yield

    def recorded(self, batch_id: int, name: str, seconds: float, *, failed: bool) -> None:
        """The listener hears the phase's end."""
        self._on_event(PhaseEvent(batch_id, name, ended=True, seconds=seconds, failed=failed))


def _fmt(value: Any, spec: str = ".3f") -> str:
    return "-" if value is None else format(value, spec)


class Printer:
    """Prints a run's progress and results (see the module docstring).

    :param out: where lines (or JSON objects) go; :param err: where progress goes with
        ``json``; :param tty: rewrite a status line in place (default: ``out`` is a terminal).
    """

    def __init__(
        self,
        *,
        json_lines: bool = False,
        out: TextIO | None = None,
        err: TextIO | None = None,
        tty: bool | None = None,
    ) -> None:
        self.json = json_lines
        self.out = out or sys.stdout
        self.progress_out = (err or sys.stderr) if json_lines else self.out
        self.tty = self.progress_out.isatty() if tty is None else tty
        self._status = ""
        self._began = time.monotonic()

    def say(self, text: str) -> None:
        """A line of progress (start-up, teardown, notes)."""
        self._clear()
        print(text, file=self.progress_out, flush=True)

    def _row(self, row: dict[str, Any]) -> bool:
        """Clear the status line; with ``--json``, print ``row`` as one object. Whether it did."""
        self._clear()
        if self.json:
            print(json.dumps(row), file=self.out, flush=True)
        return self.json

    def _clear(self) -> None:
        if self.tty and self._status:
            print("\r\033[K", end="", file=self.progress_out, flush=True)
            self._status = ""

    def status(self, text: str) -> None:
        """The transient status line (a terminal only)."""
        if self.tty:
            self._status = text
            print(f"\r\033[K{text}", end="", file=self.progress_out, flush=True)

    def event(self, e: PhaseEvent) -> None:
        """A phase began or ended."""
        if not e.ended:
            self.status(f"  step {e.step}  {e.name} …")
            return
        mark = " FAILED" if e.failed else ""
        self.say(f"  · step {e.step} {e.name} {e.seconds:.2f}s{mark}")

    def step(self, row: dict[str, Any]) -> None:
        """A committed step: one line, or one JSON object."""
        if self._row(row):
            return
        phases = row["phases"]
        switches = sum(v for k, v in phases.items() if k.endswith((".onload", ".offload")))
        shown = ", ".join(
            f"{k} {v:.2f}"
            for k, v in phases.items()
            if not k.endswith((".onload", ".offload", ".ack"))
        )
        teacher = ""
        if row.get("teacher_kl") is not None:
            teacher = f"  teacher KL {row['teacher_kl']:.3f}"
        failures = row.get("parse_failures")
        parse = "" if failures is None else f"  parse failures {failures}/{row['samples']}"
        print(
            f"step {row['step']}  {row['partition']}  {row['samples']} samples  reward "
            f"{row['reward_mean']:.3f} ± {row['reward_std']:.3f}{parse}{teacher}  tokens "
            f"{row['tokens']}  weights {row['weight_version']}"
            f"  {row['seconds']:.1f}s (switches {switches:.2f}, {shown})",
            file=self.out,
            flush=True,
        )

    def failed(self, row: dict[str, Any]) -> None:
        """The step that failed (and ended the run)."""
        self._row(row)
        print(
            f"relax run: step {row['step']} failed, nothing committed for it: {row['error']}",
            file=sys.stderr,
            flush=True,
        )

    def summary(self, row: dict[str, Any]) -> None:
        """The run's summary."""
        if self._row(row):
            return
        versions = " → ".join(str(v) for v in row["weight_versions"])
        print(
            f"relax run: {row['steps_committed']} of {row['steps']} steps committed in "
            f"{row['seconds']:.1f}s; rollout weights {versions}",
            file=self.out,
            flush=True,
        )
        measured = row.get("switching")
        if measured:
            self.say(
                f"  switching: {measured['switch_seconds']:.2f}s of "
                f"{measured['step_seconds']:.2f}s of steps "
                f"({100 * (measured['share_of_step'] or 0):.1f}%); every switch within "
                f"{measured['limit']}: {measured['all_within_limit']}; least memory freed by "
                f"an offload: {_fmt(measured['min_freed_fraction'], '.1%')}"
            )
            for s in measured["switches"]:
                self.say(
                    f"    step {s['step']} {s['role']}.{s['direction']}: {s['seconds'] * 1e3:.1f} "
                    f"ms for {s['weight_bytes'] / 1e6:.1f} MB (copy "
                    f"{_fmt(s['copy_seconds'] and s['copy_seconds'] * 1e3, '.1f')} ms, limit "
                    f"{_fmt(s['limit_seconds'] and s['limit_seconds'] * 1e3, '.1f')} ms"
                    + (
                        f"; engine {s['engine_seconds'] * 1e3:.1f} ms"
                        if s.get("engine_seconds") is not None
                        else ""
                    )
                    + (
                        f", worker {s['worker_seconds'] * 1e3:.1f} ms, manager "
                        f"{s['manager_seconds'] * 1e3:.1f} ms"
                        if s.get("worker_seconds") is not None
                        else ""
                    )
                    + ")"
                    + (
                        f", freed {_fmt(s.get('freed_fraction'), '.1%')}"
                        if s["direction"] == "offload"
                        else ""
                    )
                    + (
                        f" ({s['handed_over_bytes'] / 1e9:.1f} GB of it handed over)"
                        if s.get("handed_over_bytes")
                        else ""
                    )
                )

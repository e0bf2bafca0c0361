"""What ``relax run`` prints: progress (phases, a status line and bars on a terminal), one line
or JSON object per step, and the summary; with ``json`` progress goes to stderr (``docs/run.md``).
"""

from __future__ import annotations

import contextlib
import json
import sys
import threading
import time
from collections.abc import Iterator
from typing import Any, TextIO

import attrs

from relax_core.coordination.timeline import PhaseEvent

#: Phases shorter than this (seconds) print no progress line (``--json`` has every one).
PHASE_LINE_SECONDS = 0.05

_SWITCHES = (".onload", ".offload", ".ack")


def _fmt(value: Any, spec: str = ".3f") -> str:
    return "-" if value is None else format(value, spec)


def _ms(seconds: float | None) -> str:
    return _fmt(seconds and seconds * 1e3, ".1f")


def phase_times(phases: dict[str, float]) -> str:
    """A step's phase times for its line: the switches summed, the phases shorter than
    :data:`PHASE_LINE_SECONDS` counted."""
    switches = sum(v for k, v in phases.items() if k.endswith(_SWITCHES))
    others = {k: v for k, v in phases.items() if not k.endswith(_SWITCHES)}
    shown = [f"{k} {v:.2f}" for k, v in others.items() if v >= PHASE_LINE_SECONDS]
    short = len(others) - len(shown)
    if short:
        shown.append(f"+ {short} phase{'s' if short > 1 else ''} < {PHASE_LINE_SECONDS:g}s")
    return ", ".join([f"switches {switches:.2f}", *shown])


#: Cells of a progress bar, and how often (seconds) a bar's seconds are redrawn.
BAR_WIDTH = 24
BAR_REDRAW = 0.25


def _async_text(row: dict[str, Any]) -> str:
    """An async step's staleness, stale groups and idle ratios ("" in sync)."""
    a = row.get("async")
    if not a or (not a["max_staleness"] and not a["streamed_stages"]):
        return ""
    hist = " ".join(f"{k}:{v}" for k, v in a["staleness"].items())
    stale = a["stale"]
    idle = " ".join(f"{r} {v:.0%}" for r, v in a["idle"].items())
    return (
        f"  staleness {hist} (max {a['max_staleness']})  stale groups dropped "
        f"{stale['dropped_groups']}, regenerated {stale['regenerated_groups']}  partial "
        f"{a['partial_samples']} (span {a['max_version_span']})  idle {idle}"
    )


def _number(value: float) -> str:
    return str(int(value)) if float(value).is_integer() else f"{value:.3g}"


def _rollout_text(row: dict[str, Any]) -> tuple[str, str]:
    """The tokens' split when an environment wrote any, and the rollout's own numbers."""
    rollout = row.get("trajectories") or {}
    env = rollout.get("environment_tokens") or {}
    split = ""
    if env.get("total"):
        policy = (rollout.get("policy_tokens") or {}).get("total", 0)
        split = f" (policy {_number(policy)}, environment {_number(env['total'])})"
    shown = [
        f"{name} {_number(v['mean'])} (max {_number(v['max'])}, total {_number(v['total'])})"
        for name, v in rollout.items()
        if name not in ("policy_tokens", "environment_tokens")  # shown beside ``tokens``
    ]
    return split, ("  " + ", ".join(shown)) if shown else ""


@attrs.define(eq=False)
class Progress:
    """A long wait's progress, a bar on the status line (:meth:`Printer.waiting`);
    :meth:`update` is thread-safe and cheap."""

    printer: Printer
    label: str
    total: int | None
    unit: str
    done: int = attrs.field(init=False, default=0)
    began: float = attrs.field(init=False, factory=time.monotonic)

    def update(self, done: int, total: int | None = None) -> None:
        """``done`` of ``total`` (the total given before if ``None``); redrawn at once."""
        self.done = done
        if total is not None:
            self.total = total
        self.draw()

    def draw(self) -> None:
        """Redraw the status line (a terminal only)."""
        seconds = f"{time.monotonic() - self.began:.1f}s"
        if not self.total:
            self.printer.status(f"  {self.label} … {self.done} {self.unit}  {seconds}")
            return
        filled = min(BAR_WIDTH, BAR_WIDTH * self.done // self.total)
        bar = "#" * filled + "-" * (BAR_WIDTH - filled)
        self.printer.status(
            f"  {self.label} [{bar}] {self.done}/{self.total} {self.unit}  {seconds}"
        )


class Printer:
    """Prints a run's progress and results; ``tty``: rewrite a status line in place (default:
    whether it is a terminal); ``began``: the command's start (``time.monotonic()``)."""

    def __init__(
        self,
        *,
        json_lines: bool = False,
        out: TextIO | None = None,
        err: TextIO | None = None,
        tty: bool | None = None,
        began: float | None = None,
    ) -> None:
        self.json = json_lines
        self.out = out or sys.stdout
        self.err = err or sys.stderr
        self.progress_out = self.err if json_lines else self.out
        self.tty = self.progress_out.isatty() if tty is None else tty
        self.began = time.monotonic() if began is None else began
        self._explained_parse_failures = False
        self._status = ""
        self._lock = threading.RLock()

    def say(self, text: str) -> None:
        """A line of progress (start-up, teardown, notes); thread-safe."""
        with self._lock:
            self._clear()
            print(text, file=self.progress_out, flush=True)

    def _row(self, row: dict[str, Any]) -> bool:
        """Clear the status line; with ``--json``, print ``row`` as one object. Whether it did."""
        with self._lock:
            self._clear()
            if self.json:
                print(json.dumps(row), file=self.out, flush=True)
        return self.json

    def _clear(self) -> None:
        if self.tty and self._status:
            print("\r\033[K", end="", file=self.progress_out, flush=True)
            self._status = ""

    def status(self, text: str) -> None:
        """The transient status line (a terminal only); thread-safe."""
        if self.tty:
            with self._lock:
                self._status = text
                print(f"\r\033[K{text}", end="", file=self.progress_out, flush=True)

    @contextlib.contextmanager
    def waiting(
        self, label: str, *, total: int | None = None, unit: str = ""
    ) -> Iterator[Progress]:
        """A long wait: on a terminal a progress bar the block updates; elsewhere nothing."""
        progress = Progress(self, label, total, unit)
        if not self.tty:
            yield progress
            return
        stop = threading.Event()

        def tick() -> None:
            while not stop.wait(BAR_REDRAW):
                progress.draw()

        ticker = threading.Thread(target=tick, name="progress-bar", daemon=True)
        progress.draw()
        ticker.start()
        try:
            yield progress
        finally:
            stop.set()
            ticker.join(5)
            with self._lock:
                self._clear()

    def started(self, row: dict[str, Any]) -> None:
        """The steps begin: with ``--json`` the ``start`` event."""
        if self.json:
            self._row({"event": "start", **row})

    def event(self, e: PhaseEvent) -> None:
        """A phase began or ended."""
        if self.json:
            seconds = {"seconds": e.seconds} if e.ended else {}
            self._row(
                {"event": "phase", "step": e.step, "phase": e.name, "state": e.state, **seconds}
            )
        if not e.ended:
            self.status(f"  step {e.step}  {e.name} …")
            return
        if e.seconds < PHASE_LINE_SECONDS and e.state == "end":
            return  # counted in the step's line
        mark = {"end": "", "failed": " FAILED", "interrupted": " interrupted"}[e.state]
        self.say(f"  · step {e.step} {e.name} {e.seconds:.2f}s{mark}")

    def step(self, row: dict[str, Any]) -> None:
        """A committed step: one line, or one JSON object."""
        if self._row(row):
            return
        kl = row.get("teacher_kl")
        teacher = "" if kl is None else f"  teacher KL {kl:.3f}"
        failures = row.get("parse_failures")
        parse = "" if failures is None else f"  parse failures {failures}/{row['samples']}"
        if failures and failures == row["samples"] and not self._explained_parse_failures:
            self._explained_parse_failures = True
            parse += (
                " (no judge answer held a verdict, so each scored 0.0: an untrained judge, "
                "like the demo's tiny random one, never writes one)"
            )
        split, rollout = _rollout_text(row)
        print(
            f"step {row['step']}  {row['partition']}  {row['samples']} samples  reward "
            f"{row['reward_mean']:.3f} ± {row['reward_std']:.3f}{parse}{teacher}  tokens "
            f"{row['tokens']}{split}{rollout}  weights {row['weight_version']}{_async_text(row)}"
            f"  {row['seconds']:.1f}s ({phase_times(row['phases'])})",
            file=self.out,
            flush=True,
        )

    def evaluation(self, row: dict[str, Any]) -> None:
        """A background evaluation that ended: one line, or one JSON object."""
        if self._row(row):
            return
        counts = row["counts"]
        versions = row["weight_version"] or ", ".join(map(str, row["weight_versions"])) or "-"
        if row["status"] == "done":
            what = (
                f"reward {_fmt(counts.get('reward_mean'))} ± {_fmt(counts.get('reward_std'))} "
                f"over {int(counts.get('samples', 0))} samples"
            )
        else:
            what = f"{row['status']}: {row['error']}"
        print(
            f"eval {row['eval']} of step {row['step']}  weights {versions}  {what}  "
            f"{row['seconds']:.1f}s",
            file=self.out if row["status"] == "done" else self.err,
            flush=True,
        )

    def failed(self, row: dict[str, Any]) -> None:
        """A step that failed, was skipped or was interrupted."""
        self._row(row)
        if row.get("interrupted"):
            text = f"relax run: step {row['step']} {row['error']}; nothing committed for it"
        elif row.get("skipped"):
            text = (
                f"relax run: step {row['step']} skipped, nothing committed or trained for it: "
                f"{row['error']}; the run goes on (on_empty_batch = 'skip')"
            )
        else:
            text = f"relax run: step {row['step']} failed, nothing committed for it: {row['error']}"
            if row.get("went_on"):
                text += "; the run goes on (max_failed_steps)"
        print(text, file=self.err, flush=True)

    def summary(self, row: dict[str, Any]) -> None:
        """The run's summary; ``wall_seconds`` (since ``began``) is added to ``row``."""
        row["wall_seconds"] = time.monotonic() - self.began
        if self._row(row):
            return
        versions = " → ".join(str(v) for v in row["weight_versions"])
        stopped = ""
        if row.get("interrupted"):
            stopped = f", interrupted in step {row['interrupted_step']}"
        print(
            f"relax run: {row['steps_committed']} of {row['steps']} steps committed{stopped}; "
            f"{row['wall_seconds']:.1f}s in all (start-up {row['startup_seconds']:.1f}s, steps "
            f"{row['step_seconds']:.1f}s); rollout weights {versions}",
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
                inside = f"copy {_ms(s['copy_seconds'])} ms, limit {_ms(s['limit_seconds'])} ms"
                hops = s.get("hops") or {}
                if len(hops) > 1:  # each hop the switch reports, outermost first
                    inside += "; " + ", ".join(f"{k} {_ms(v)}" for k, v in hops.items())
                after = ""
                if s["direction"] == "offload":
                    after = f", freed {_fmt(s.get('freed_fraction'), '.1%')}"
                if s.get("handed_over_bytes"):
                    after += f" ({s['handed_over_bytes'] / 1e9:.1f} GB of it handed over)"
                self.say(
                    f"    step {s['step']} {s['role']}.{s['direction']}: {s['seconds'] * 1e3:.1f} "
                    f"ms for {s['weight_bytes'] / 1e6:.1f} MB ({inside}){after}"
                )

"""What ``relax run`` prints: a progress line only for the phases that took real time (or
failed, or were interrupted), every phase in ``--json``, a step's shorter phases counted in its
line, and a summary that gives the command's wall time with its start-up and its steps."""

from __future__ import annotations

import asyncio
import io
import json
import time
from typing import Any

import pytest

from relax_core.coordination import Timeline
from relax_core.run.progress import PHASE_LINE_SECONDS, PhaseEvent, Printer


def _printer(*, json_lines: bool = False, began: float | None = None) -> tuple[Printer, Any, Any]:
    out, err = io.StringIO(), io.StringIO()
    return Printer(json_lines=json_lines, out=out, err=err, tty=False, began=began), out, err


def _end(name: str, seconds: float, **kw: Any) -> PhaseEvent:
    return PhaseEvent(1, name, ended=True, seconds=seconds, **kw)


def test_only_phases_that_take_real_time_fail_or_are_interrupted_print_a_line() -> None:
    printer, out, _ = _printer()
    printer.event(PhaseEvent(1, "genrm", ended=False))
    for event in (
        _end("rollout.ack", 0.001),
        _end("validate", PHASE_LINE_SECONDS / 2),
        _end("genrm", 2.29),
        _end("commit", 0.0, failed=True),
        _end("teacher", 0.01, interrupted=True),
    ):
        printer.event(event)
    assert out.getvalue().splitlines() == [
        "  · step 1 genrm 2.29s",
        "  · step 1 commit 0.00s FAILED",
        "  · step 1 teacher 0.01s interrupted",
    ]


def test_json_has_every_phase_as_it_begins_and_ends_and_the_text_progress_goes_to_stderr() -> None:
    printer, out, err = _printer(json_lines=True)
    printer.started({"job": "j", "engine_pids": [11, 12], "router_pids": [13]})
    printer.event(PhaseEvent(1, "validate", ended=False))
    printer.event(_end("validate", 0.001))
    printer.event(_end("genrm", 0.3, interrupted=True))
    rows = [json.loads(line) for line in out.getvalue().splitlines()]
    assert rows == [
        {"event": "start", "job": "j", "engine_pids": [11, 12], "router_pids": [13]},
        {"event": "phase", "step": 1, "phase": "validate", "state": "begin"},
        {"event": "phase", "step": 1, "phase": "validate", "state": "end", "seconds": 0.001},
        {"event": "phase", "step": 1, "phase": "genrm", "state": "interrupted", "seconds": 0.3},
    ]
    assert err.getvalue() == "  · step 1 genrm 0.30s interrupted\n"


def test_a_step_line_sums_the_switches_names_the_long_phases_and_counts_the_short_ones() -> None:
    printer, out, _ = _printer()
    phases = {
        "generate": 0.21, "stage_copies": 0.0, "rollout.offload": 0.09, "rollout.ack": 0.0,
        "genrm.onload": 0.05, "genrm": 2.29, "genrm.offload": 0.03, "validate": 0.0,
        "write_back": 0.0, "sink_put": 0.08, "finalize": 0.0, "commit": 0.0, "train": 0.31,
    }  # fmt: skip
    printer.step(
        {
            "step": 0, "partition": "train_0", "samples": 16, "reward_mean": 0.031,
            "reward_std": 0.034, "parse_failures": 3, "teacher_kl": 0.576, "tokens": 250,
            "weight_version": "default", "seconds": 3.2, "phases": phases,
        }
    )  # fmt: skip
    assert out.getvalue() == (
        "step 0  train_0  16 samples  reward 0.031 ± 0.034  parse failures 3/16  teacher KL "
        "0.576  tokens 250  weights default  3.2s (switches 0.17, generate 0.21, genrm 2.29, "
        "sink_put 0.08, train 0.31, + 5 phases < 0.05s)\n"
    )


def test_a_multi_turn_step_line_splits_the_tokens_and_shows_what_the_rollout_reported() -> None:
    printer, out, _ = _printer()
    token_split = {
        "policy_tokens": {"mean": 75.0, "max": 80.0, "total": 300.0},
        "environment_tokens": {"mean": 53.0, "max": 60.0, "total": 212.0},
    }
    row = {
        "step": 0, "partition": "train_0", "samples": 4, "reward_mean": 0.0, "reward_std": 0.0,
        "parse_failures": None, "tokens": 512, "weight_version": "default", "seconds": 1.0,
        "phases": {"generate": 0.5},
        "rollout": {**token_split, "turns": {"mean": 2.25, "max": 3.0, "total": 9.0},
                    "environment_seconds": {"mean": 0.00123, "max": 0.002, "total": 0.00492}},
    }  # fmt: skip
    printer.step(row)
    # A single-turn step (no environment token) shows neither.
    single = {"policy_tokens": token_split["policy_tokens"],
              "environment_tokens": {"mean": 0.0, "max": 0.0, "total": 0.0}}  # fmt: skip
    printer.step({**row, "step": 1, "rollout": single})
    first, second = out.getvalue().splitlines()
    assert (
        "tokens 512 (policy 300, environment 212)  turns 2.25 (max 3, total 9), "
        "environment_seconds 0.00123 (max 0.002, total 0.00492)  weights default"
    ) in first
    assert "tokens 512  weights default" in second


def test_a_step_whose_every_judge_answer_failed_to_parse_says_why_once() -> None:
    printer, out, _ = _printer()
    row = {
        "step": 0, "partition": "train_0", "samples": 4, "reward_mean": 0.0, "reward_std": 0.0,
        "parse_failures": 4, "tokens": 40, "weight_version": "default", "seconds": 1.0,
        "phases": {"generate": 0.5},
    }  # fmt: skip
    printer.step(row)
    printer.step({**row, "step": 1, "partition": "train_1"})
    first, second = out.getvalue().splitlines()
    assert "parse failures 4/4 (no judge answer held a verdict, so each scored 0.0" in first
    assert "parse failures 4/4  tokens" in second  # said once, not on every step


def test_the_summary_gives_the_wall_time_from_the_command_s_start_with_start_up_and_steps() -> None:
    printer, out, _ = _printer(began=time.monotonic() - 117.0)
    row = {
        "steps": 3, "steps_committed": 3, "startup_seconds": 100.2, "step_seconds": 9.8,
        "weight_versions": ["default", "1", "2", "3"],
    }  # fmt: skip
    printer.summary(row)
    assert 117.0 <= row["wall_seconds"] < 127.0
    line = out.getvalue()
    assert line.startswith("relax run: 3 of 3 steps committed; 117.")
    assert line.endswith(
        "s in all (start-up 100.2s, steps 9.8s); rollout weights default → 1 → 2 → 3\n"
    )


def test_an_interrupted_run_says_so_in_its_summary_and_its_step_report() -> None:
    printer, out, err = _printer()
    printer.failed(
        {"step": 1, "failed": True, "interrupted": True, "error": "interrupted during genrm"}
    )
    printer.summary(
        {
            "steps": 3, "steps_committed": 1, "interrupted": True, "interrupted_step": 1,
            "startup_seconds": 40.0, "step_seconds": 3.0, "weight_versions": ["default", "1"],
        }
    )  # fmt: skip
    assert err.getvalue() == (
        "relax run: step 1 interrupted during genrm; nothing committed for it\n"
    )
    assert out.getvalue().startswith("relax run: 1 of 3 steps committed, interrupted in step 1; ")


def test_the_timeline_tells_its_listener_an_interrupted_phase_from_a_failed_one() -> None:
    events: list[PhaseEvent] = []
    timeline = Timeline(on_event=events.append)
    for error in (asyncio.CancelledError(), KeyboardInterrupt(), RuntimeError("boom")):
        with pytest.raises(type(error)), timeline.phase(0, "genrm"):
            raise error
    assert [e.state for e in events if e.ended] == ["interrupted", "interrupted", "failed"]


def test_a_long_wait_draws_a_progress_bar_on_a_terminal_only() -> None:
    out = io.StringIO()
    printer = Printer(out=out, err=out, tty=True)
    with printer.waiting("step 1 generate", total=16, unit="samples") as bar:
        bar.update(8)
    drawn = out.getvalue()
    assert "  step 1 generate [############------------] 8/16 samples  " in drawn
    assert drawn.endswith("\r\033[K")  # the line is cleared when the wait ends
    quiet = io.StringIO()
    printer = Printer(out=quiet, err=quiet, tty=False)
    with printer.waiting("starting engines", total=3, unit="models") as bar:
        bar.update(2)
    assert quiet.getvalue() == ""

"""A run's trackers: fed off the step loop in order, a failing one reported once and left out (or,
strict, ending the run), each closed with a deadline; ``[run] trackers`` checked before anything
starts; the metrics and sample rows a tracker hears."""

from __future__ import annotations

import threading
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import pytest

from relax_core import PhaseSpan, PluginManager, Sample, TrackerContext, TrackerSpec, loads_config
from relax_core.errors import ConfigValidationError, TrackerError
from relax_core.plugins import module_plugin
from relax_core.run.config import parse_run_config
from relax_core.tracking import (
    ROLLOUT_METRICS,
    TrackerEntry,
    Trackers,
    rollout_metrics,
    sample_rows,
    step_metrics,
    tracker_problems,
)


class Recording:
    """A tracker that keeps every call; ``fail`` names a call that raises."""

    def __init__(self, fail: str | None = None, *, block: threading.Event | None = None) -> None:
        self.calls: list[tuple[str, Any]] = []
        self.fail = fail
        self.block = block

    def _call(self, name: str, value: Any) -> None:
        self.calls.append((name, value))
        if name == self.fail:
            raise RuntimeError(f"{name} broke")

    def log_config(self, config: Mapping[str, Any]) -> None:
        self._call("log_config", dict(config))

    def log_metrics(self, step: int, metrics: Mapping[str, float]) -> None:
        self._call("log_metrics", step)

    def log_span(self, span: PhaseSpan) -> None:
        self._call("log_span", span.name)

    def log_samples(self, step: int, samples: Sequence[Mapping[str, Any]]) -> None:
        self._call("log_samples", step)

    def close(self, summary: Mapping[str, Any] | None) -> None:
        if self.block is not None:
            self.block.wait(30)
        self._call("close", summary)


def _feed(trackers: Trackers) -> None:
    trackers.log_config({"job": "j"})
    for step in range(3):
        trackers.log_span(PhaseSpan(step, "generate", 1.0, 0.5))
        trackers.log_metrics(step, {"reward/mean": 0.5})
        trackers.log_samples(step, [{"id": f"s{step}"}])


def test_every_tracker_hears_every_call_in_order_and_is_closed() -> None:
    a, b = Recording(), Recording()
    trackers = Trackers([("a", a), ("b", b)], say=pytest.fail)
    _feed(trackers)
    trackers.close({"steps_committed": 3})
    expected = [("log_config", {"job": "j"})]
    for step in range(3):
        expected += [("log_span", "generate"), ("log_metrics", step), ("log_samples", step)]
    expected.append(("close", {"steps_committed": 3}))
    assert a.calls == b.calls == expected


def test_a_tracker_that_raises_is_reported_once_and_the_others_go_on() -> None:
    said: list[str] = []
    broken, fine = Recording(fail="log_metrics"), Recording()
    trackers = Trackers([("broken", broken), ("fine", fine)], say=said.append)
    _feed(trackers)
    trackers.close(None)
    assert len(said) == 1, said
    assert said[0].startswith(
        "relax run: tracker 'broken' failed in log_metrics (step 0): RuntimeError: log_metrics "
        "broke; the run goes on without it"
    )
    # It heard nothing after its failure but its close; the other heard everything.
    assert [c for c, _ in broken.calls] == ["log_config", "log_span", "log_metrics", "close"]
    assert len(fine.calls) == 1 + 3 * 3 + 1
    assert trackers.failures == {"broken": "log_metrics (step 0): RuntimeError: log_metrics broke"}


def test_strict_trackers_end_the_run_with_the_trackers_error() -> None:
    said: list[str] = []
    trackers = Trackers([("broken", Recording(fail="log_config"))], say=said.append, strict=True)
    trackers.log_config({})
    with pytest.raises(TrackerError, match="tracker 'broken' failed in log_config") as caught:
        trackers.close(None)
    assert caught.value.tracker == "broken" and caught.value.call == "log_config"
    trackers.check()  # raised once: the run that ended on it is not told again
    assert said == ["relax run: tracker 'broken' failed in log_config: RuntimeError: log_config "
                    "broke; strict_trackers: the run ends"]  # fmt: skip


def test_close_gives_up_on_a_tracker_that_hangs_after_its_deadline() -> None:
    said: list[str] = []
    release = threading.Event()
    trackers = Trackers([("slow", Recording(block=release))], say=said.append)
    try:
        trackers.close(None, timeout=0.2)
    finally:
        release.set()
    assert said == [
        "relax run: tracker 'slow' failed in close: the trackers did not close within 0.2s; "
        "their last records may be missing"
    ]


def _plugins(**specs: TrackerSpec) -> PluginManager:
    def register(register: Any) -> None:
        for spec in specs.values():
            register(spec)

    plugin = module_plugin("test-trackers", relax_register_trackers=register)
    return PluginManager.create(entry_points=False, plugins=[("test-trackers", plugin)])


def test_a_tracker_that_fails_to_open_is_reported_and_left_out(tmp_path: Path) -> None:
    def refuse(context: TrackerContext) -> Any:
        raise OSError(f"cannot reach the server for {context.job}")

    pm = _plugins(
        refuse=TrackerSpec(name="refuse", open=refuse),
        rec=TrackerSpec(name="rec", open=lambda context: Recording()),
    )
    entries = [TrackerEntry("refuse"), TrackerEntry("rec")]
    said: list[str] = []
    trackers = Trackers.open(entries, pm, run_dir=str(tmp_path), job="j", say=said.append)
    assert trackers.names == ["rec"] and len(said) == 1
    assert "tracker 'refuse' failed in open: OSError: cannot reach the server for j" in said[0]
    trackers.close(None)
    with pytest.raises(TrackerError, match="failed in open"):
        Trackers.open(entries, pm, run_dir=str(tmp_path), job="j", say=said.append, strict=True)


def test_trackers_are_checked_before_anything_starts(plugin_manager: PluginManager) -> None:
    entries = [
        TrackerEntry("tensorbaord", path="run.trackers[0]"),
        TrackerEntry("jsonl", {"fiel": "x.jsonl"}, path="run.trackers[1]"),
        TrackerEntry("jsonl", path="--tracker[0]"),
    ]
    problems = [str(p) for p in tracker_problems(entries, plugin_manager)]
    assert problems[0].startswith("run.trackers[0]: [plugin] no tracker named 'tensorbaord'")
    assert "did you mean 'tensorboard'?" in problems[0]
    assert problems[1].startswith("run.trackers[1].fiel: [unknown-key] tracker 'jsonl' has no")
    assert "did you mean 'file'?" in problems[1]
    assert problems[2].startswith("--tracker[0]: [duplicate] tracker 'jsonl' is listed twice")


def test_the_run_table_names_trackers_by_name_or_as_a_table_with_options() -> None:
    base = '[roles.rollout.models.p]\nbackend = "hf"\nmodel_path = "/m"\n[run]\n'
    base += 'rewards = [{ adapter = "digits" }]\n'
    run = parse_run_config(
        loads_config(
            base + 'trackers = ["tensorboard", { tracker = "wandb", project = "rl" }]\n'
            "tracker_samples = 2\nstrict_trackers = true\n"
        )
    )
    assert run.trackers == (
        TrackerEntry("tensorboard", {}, "run.trackers[0]"),
        TrackerEntry("wandb", {"project": "rl"}, "run.trackers[1]"),
    )
    assert (run.tracker_samples, run.strict_trackers) == (2, True)
    with pytest.raises(ConfigValidationError) as caught:
        parse_run_config(loads_config(base + 'trackers = [3, { project = "rl" }]\n'))
    assert [p.path for p in caught.value.problems] == [
        "run.trackers[0]",
        "run.trackers[1].tracker",
    ]


def test_a_steps_metrics_are_flat_finite_numbers_from_its_json_line() -> None:
    row = {
        "step": 2, "samples": 16, "groups": 4, "tokens": 200, "reward_mean": 0.5,
        "reward_std": float("nan"), "reward_by_key": {"digits": 0.25}, "teacher_kl": None,
        "parse_failures": 3, "phases": {"genrm": 0.8, "genrm.onload": 0.1}, "seconds": 2.0,
        "train": {"loss": 0.1, "fields": ["reward"]}, "stages": {"genrm": {"digits.scored": 16}},
        "dropped": {"groups": 0, "samples": 0}, "switches": 6, "generated_groups": 0,
    }  # fmt: skip
    metrics = step_metrics(row)
    assert metrics["reward/mean"] == 0.5 and "reward/std" not in metrics
    assert metrics["reward/digits"] == 0.25 and "teacher/kl" not in metrics
    assert metrics["response_length/mean"] == 12.5 and metrics["time/step"] == 2.0
    assert metrics["time/genrm.onload"] == 0.1 and metrics["train/loss"] == 0.1
    assert metrics["stage/genrm/digits.scored"] == 16 and "train/fields" not in metrics


def test_the_rollout_object_splits_the_tokens_and_aggregates_what_the_rollout_reported() -> None:
    # Two trajectories: the environment's observation tokens (mask 0) and the policy's; the
    # numbers the rollout wrote per sample as mean, max and total; a non-number left out.
    samples = [
        Sample("a", "g", [1], [2, 3, 4, 5], loss_mask=[1, 0, 0, 1],
               metadata={ROLLOUT_METRICS: {"turns": 2, "tool_calls": 1, "note": "x"}}),
        Sample("b", "g", [1], [2, 3, 4, 5, 6, 7], loss_mask=[1, 1, 0, 1, 1, 1],
               metadata={ROLLOUT_METRICS: {"turns": 3, "tool_calls": 3}}),
        Sample("c", "h", [1], [2, 3]),  # single-turn: every token the policy's
    ]  # fmt: skip
    rollout = rollout_metrics(samples)
    assert rollout == {
        "policy_tokens": {"mean": 3.0, "max": 5.0, "total": 9.0},
        "environment_tokens": {"mean": 1.0, "max": 2.0, "total": 3.0},
        "turns": {"mean": 2.5, "max": 3.0, "total": 5.0},
        "tool_calls": {"mean": 2.0, "max": 3.0, "total": 4.0},
    }
    metrics = step_metrics({"rollout": rollout})
    assert metrics["rollout/turns/max"] == 3.0 and metrics["rollout/tool_calls/total"] == 4.0
    assert metrics["rollout/environment_tokens/total"] == 3.0


def test_sample_rows_show_several_groups_with_each_samples_kl_to_the_teacher() -> None:
    samples = [
        Sample(f"g{g}-s{i}", f"g{g}", [1], [2, 3], prompt=f"p{g}", response=f"r{i}",
               rollout_logprobs=[-1.0, -2.0],
               fields={"reward": 1.0, "rewards": {"digits": 1.0}, "teacher_logprobs": [-1.5, -2.5]})
        for g in range(3) for i in range(2)
    ]  # fmt: skip
    rows = sample_rows(samples, 4)
    assert [r["id"] for r in rows] == ["g0-s0", "g1-s0", "g2-s0", "g0-s1"]
    assert rows[0]["teacher_kl"] == pytest.approx(0.5)
    assert rows[0]["rewards"] == {"digits": 1.0} and rows[0]["response_tokens"] == 2
    assert sample_rows(samples, 0) == []

"""The wandb tracker, found through its installed entry point, writes an offline W&B run whose
transaction log holds every step's metrics, the config and the exit code."""

from __future__ import annotations

from pathlib import Path

from relax_core import PhaseSpan, PluginManager, TrackerContext
from tests.support.wandb_log import offline_run


def test_it_is_registered_through_its_entry_point(plugin_manager: PluginManager) -> None:
    found = plugin_manager.registered("trackers")["wandb"]
    assert found.distribution == "relax-wandb" and found.plugin == "wandb"


def test_an_offline_run_holds_what_the_tracker_heard(
    plugin_manager: PluginManager, tmp_path: Path
) -> None:
    spec = plugin_manager.tracker("wandb")
    context = TrackerContext("wandb", str(tmp_path), "job-1", {"mode": "offline", "project": "t"})
    tracker = spec.open(context)
    tracker.log_config({"job": "job-1", "run": {"steps": 2}})
    for step in range(2):
        tracker.log_span(PhaseSpan(step, "generate", 1.0 + step, 0.5))
        tracker.log_metrics(step, {"reward/mean": 0.5 + step, "time/genrm": 0.25})
        tracker.log_samples(step, [{"id": f"s{step}", "prompt": "p", "response": "r"}])
    tracker.close({"failed_step": None, "interrupted": False, "steps_committed": 2})
    run = offline_run(str(tmp_path / "wandb"))
    assert {s: h["reward/mean"] for s, h in run["history"].items() if "reward/mean" in h} == {
        0: 0.5,
        1: 1.5,
    }
    assert run["history"][1]["samples/_type"] == "table-file"
    assert run["config"]["run"] == {"steps": 2}
    assert run["run"].display_name == "job-1" and run["exit_code"] == 0

"""The mlflow tracker, found through its installed entry point, writes a run to a file store in
the run's directory that ``MlflowClient`` reads back: params, every step's metrics, samples and
spans as artifacts, the status."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from relax_core import PhaseSpan, PluginManager, TrackerContext


def test_it_is_registered_through_its_entry_point(plugin_manager: PluginManager) -> None:
    found = plugin_manager.registered("trackers")["mlflow"]
    assert found.distribution == "relax-mlflow" and found.plugin == "mlflow"


@pytest.mark.parametrize(
    ("summary", "status"),
    [
        ({"failed_step": None, "interrupted": False}, "FINISHED"),
        ({"failed_step": 1, "interrupted": True}, "KILLED"),
        (None, "FAILED"),
    ],
)
def test_a_file_store_run_holds_what_the_tracker_heard(
    plugin_manager: PluginManager,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    summary: dict[str, object] | None,
    status: str,
) -> None:
    from mlflow.tracking import MlflowClient

    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    monkeypatch.setenv("MLFLOW_ALLOW_FILE_STORE", "true")  # what the tracker sets for its store
    tracker = plugin_manager.tracker("mlflow").open(TrackerContext("mlflow", str(tmp_path), "j"))
    tracker.log_config({"job": "j", "run": {"steps": 2, "trackers": ["mlflow"]}})
    for step in range(2):
        tracker.log_span(PhaseSpan(step, "generate", 1.0 + step, 0.5))
        tracker.log_metrics(step, {"reward/mean": 0.5 + step, "time/genrm.onload": 0.25})
        tracker.log_samples(step, [{"id": f"s{step}"}])
    tracker.close(summary)
    client = MlflowClient(tracking_uri=(tmp_path / "mlruns").as_uri())
    experiment = client.get_experiment_by_name("relax")
    assert experiment is not None
    (run,) = client.search_runs([experiment.experiment_id])
    assert run.info.status == status and run.info.run_name == "j"
    assert run.data.params == {"job": "j", "run.steps": "2", "run.trackers": "['mlflow']"}
    history = client.get_metric_history(run.info.run_id, "reward/mean")
    assert sorted((m.step, m.value) for m in history) == [(0, 0.5), (1, 1.5)]
    artifacts = Path(client.download_artifacts(run.info.run_id, "", str(tmp_path / "out")))
    assert json.loads((artifacts / "samples" / "step-1.json").read_text()) == [{"id": "s1"}]
    assert [s["name"] for s in json.loads((artifacts / "spans.json").read_text())] == [
        "generate",
        "generate",
    ]

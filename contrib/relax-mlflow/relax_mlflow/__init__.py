"""An MLflow tracker for ``relax run``: ``[run] trackers = [{ tracker = "mlflow", experiment =
"rl" }]``.

Each run is one MLflow run (named after the job) in the experiment ``experiment`` (default
``relax``) of the tracking server or store ``tracking_uri`` (default: ``MLFLOW_TRACKING_URI``,
else a file store in the run's directory, ``RUN_DIR/mlruns``). It gets the config flattened
into parameters (``run.steps``, ``roles.genrm.judge.backend`` …; each value cut to MLflow's
limit) and whole as the artifact ``config.json``; each committed step's metrics at its step;
each step's samples as ``samples/step-N.json``; when the run ends, every phase span as
``spans.json`` and the run's status: ``FINISHED``, ``FAILED`` (a failed step, or no summary) or
``KILLED`` (Ctrl-C).

MLflow 3 keeps its file store in maintenance mode and refuses it unless
``MLFLOW_ALLOW_FILE_STORE`` is set; the tracker sets it (in the driver's process) only for a
file store, the default one included. Read a run back with ``mlflow.tracking.MlflowClient``
(``mlflow ui --backend-store-uri RUN_DIR/mlruns`` shows it).
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

from relax_core import PhaseSpan, TrackerContext, TrackerSpec, hookimpl

OPTIONS = ("tracking_uri", "experiment", "run_name")
#: MLflow's limit of a parameter's value (characters).
PARAM_CHARS = 6000
#: Metrics and parameters per ``log_batch`` call at most (MLflow's limits: 1000 and 100).
BATCH = 100


def flatten(value: Any, prefix: str = "") -> dict[str, str]:
    """``value`` (JSON data) as ``{dotted.key: text}``, lists kept whole as their text."""
    if isinstance(value, Mapping):
        out: dict[str, str] = {}
        for key, inner in value.items():
            out.update(flatten(inner, f"{prefix}{key}."))
        return out
    return {prefix[:-1]: str(value)[:PARAM_CHARS]} if prefix else {}


class MlflowTracker:
    """One MLflow run (see the module docstring); opened in the driver when the steps begin."""

    def __init__(self, context: TrackerContext) -> None:
        from mlflow.tracking import MlflowClient

        options = context.options
        uri = options.get("tracking_uri") or os.environ.get("MLFLOW_TRACKING_URI")
        if not uri:
            uri = Path(context.run_dir, "mlruns").resolve().as_uri()
        if str(uri).startswith("file:") or "://" not in str(uri):
            os.environ.setdefault("MLFLOW_ALLOW_FILE_STORE", "true")
        self.client = MlflowClient(tracking_uri=str(uri))
        name = str(options.get("experiment", "relax"))
        experiment = self.client.get_experiment_by_name(name)
        experiment_id = (
            experiment.experiment_id
            if experiment is not None
            else self.client.create_experiment(name)
        )
        run = self.client.create_run(
            experiment_id, run_name=str(options.get("run_name", context.job))
        )
        self.run_id = run.info.run_id
        self.spans: list[dict[str, Any]] = []

    def log_config(self, config: Mapping[str, Any]) -> None:
        from mlflow.entities import Param

        params = [Param(k[:250], v) for k, v in flatten(config).items()]
        for i in range(0, len(params), BATCH):
            self.client.log_batch(self.run_id, params=params[i : i + BATCH])
        self.client.log_dict(self.run_id, dict(config), "config.json")

    def log_metrics(self, step: int, metrics: Mapping[str, float]) -> None:
        from mlflow.entities import Metric

        now = int(time.time() * 1000)
        batch = [Metric(k, float(v), now, step) for k, v in metrics.items()]
        for i in range(0, len(batch), BATCH):
            self.client.log_batch(self.run_id, metrics=batch[i : i + BATCH])

    def log_span(self, span: PhaseSpan) -> None:
        self.spans.append(span.row())

    def log_samples(self, step: int, samples: Sequence[Mapping[str, Any]]) -> None:
        self.client.log_dict(self.run_id, list(samples), f"samples/step-{step}.json")

    def close(self, summary: Mapping[str, Any] | None) -> None:
        if self.spans:
            self.client.log_dict(self.run_id, self.spans, "spans.json")
        if summary is None or summary.get("failed_step") is not None:
            status = "KILLED" if summary is not None and summary.get("interrupted") else "FAILED"
        else:
            status = "KILLED" if summary.get("interrupted") else "FINISHED"
        self.client.set_terminated(self.run_id, status=status)


@hookimpl
def relax_register_trackers(register: Callable[[TrackerSpec], None]) -> None:
    register(
        TrackerSpec(
            name="mlflow",
            open=MlflowTracker,
            options=OPTIONS,
            description="MLflow: params, metrics per step, samples and spans as artifacts "
            "(default store: RUN_DIR/mlruns).",
        )
    )

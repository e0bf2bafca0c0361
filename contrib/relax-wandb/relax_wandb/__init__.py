"""A Weights & Biases tracker for ``relax run``: ``[run] trackers = [{ tracker = "wandb",
project = "rl" }]``.

Each run is one W&B run (named after the job), its files under ``RUN_DIR/wandb``: the config
as the run's config, each committed step's metrics at its step, the step's samples as a
``wandb.Table`` (``samples``), and, when the run ends, its phase spans as a table (``phases``)
and the summary's numbers in the run summary. ``mode = "offline"`` keeps everything on the
machine (``wandb sync RUN_DIR/wandb/offline-run-*`` uploads it later); without ``mode``, W&B's
own default (``WANDB_MODE``, else online) applies. W&B never captures the driver's console
(``console = "off"``): ``relax run --json`` keeps stdout for its JSON lines.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from relax_core import PhaseSpan, TrackerContext, TrackerSpec, hookimpl

OPTIONS = ("project", "entity", "mode", "name", "group", "tags")
SAMPLE_COLUMNS = ("id", "group_id", "reward", "teacher_kl", "response_tokens", "prompt", "response")
SPAN_COLUMNS = ("step", "name", "lane", "start", "seconds", "failed", "interrupted")


class WandbTracker:
    """One W&B run (see the module docstring); opened in the driver when the steps begin."""

    def __init__(self, context: TrackerContext) -> None:
        import wandb

        options = context.options
        directory = os.path.join(context.run_dir, "wandb")
        os.makedirs(directory, exist_ok=True)
        settings = wandb.Settings(silent=True, console="off", x_disable_stats=True)
        self.run = wandb.init(
            project=str(options.get("project", "relax")),
            entity=options.get("entity"),
            name=str(options.get("name", context.job)),
            group=options.get("group"),
            tags=list(options.get("tags", [])) or None,
            mode=options.get("mode"),
            dir=context.run_dir,
            settings=settings,
            reinit="create_new",
        )
        self.spans: list[list[Any]] = []

    def log_config(self, config: Mapping[str, Any]) -> None:
        self.run.config.update(dict(config), allow_val_change=True)

    def log_metrics(self, step: int, metrics: Mapping[str, float]) -> None:
        self.run.log(dict(metrics), step=step)

    def log_span(self, span: PhaseSpan) -> None:
        row = span.row()
        self.spans.append([row[c] for c in SPAN_COLUMNS])

    def log_samples(self, step: int, samples: Sequence[Mapping[str, Any]]) -> None:
        import wandb

        rows = [[s.get(c) for c in SAMPLE_COLUMNS] for s in samples]
        self.run.log({"samples": wandb.Table(columns=list(SAMPLE_COLUMNS), data=rows)}, step=step)

    def close(self, summary: Mapping[str, Any] | None) -> None:
        import wandb

        if self.spans:
            self.run.log({"phases": wandb.Table(columns=list(SPAN_COLUMNS), data=self.spans)})
        ok = summary is not None and summary.get("failed_step") is None
        if summary is not None:
            for key in ("steps_committed", "seconds", "startup_seconds", "step_seconds"):
                if isinstance(summary.get(key), int | float):
                    self.run.summary[key] = summary[key]
        self.run.finish(exit_code=0 if ok and not summary.get("interrupted") else 1)
        wandb.teardown()  # stop W&B's service process with the run


@hookimpl
def relax_register_trackers(register: Callable[[TrackerSpec], None]) -> None:
    register(
        TrackerSpec(
            name="wandb",
            open=WandbTracker,
            options=OPTIONS,
            description="Weights & Biases: metrics, config, sample tables (mode = 'offline' "
            "keeps them local).",
        )
    )

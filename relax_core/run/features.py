"""The engine features a run needs (its rollout shape's ``needs``), checked against its
generation engines' backends (``EngineBackend.missing``) before Ray or any engine starts: a
feature this install cannot provide is a problem at the key path that asks for it."""

from __future__ import annotations

from collections.abc import Sequence

from relax_core.config import ConfigReader, ModelConfig
from relax_core.errors import ConfigProblem, PluginError
from relax_core.plugins import PluginManager
from relax_core.records import EngineBackend, RolloutShapeSpec
from relax_core.run.config import GenerationTable, RunConfig
from relax_core.run.rollout import RolloutShapeConfig


def engine_feature_problems(
    table: GenerationTable, run: RunConfig, pm: PluginManager, models: Sequence[ModelConfig]
) -> list[ConfigProblem]:
    """Every feature the run's shape needs that an engine of ``models`` (the generation role's)
    cannot provide on this install. Call it once the table builds."""
    if not models:
        return []
    spec: RolloutShapeSpec = pm.rollout_shape(table.shape)
    if spec.needs is None:
        return []
    first = models[0]
    config = RolloutShapeConfig(
        dict(table.options), table.path, run, pm, first.name, first.model_path, first.path
    )
    try:
        needs = dict(spec.needs(config))
    except Exception as exc:  # a plugin's bug, reported where its table is
        return [
            ConfigProblem(
                f"{table.path}.shape",
                "engine-feature",
                f"rollout shape {table.shape!r} could not say which engine features it needs: "
                f"{type(exc).__name__}: {exc} (a plugin bug)",
            )
        ]
    r = ConfigReader()
    for feature, where in sorted(needs.items()):
        for m in models:
            try:
                backend: EngineBackend = pm.engine_backend(m.backend)
            except PluginError:
                continue  # the job's own check reports an unknown backend
            why = backend.missing(feature) if backend.missing is not None else None
            if why:
                r.problem(
                    where or table.path,
                    "engine-feature",
                    f"the job needs {feature.replace('_', ' ')} from the engines of "
                    f"{m.path} (backend {m.backend!r}), which this install cannot provide: "
                    f"{why}",
                )
    return r.problems

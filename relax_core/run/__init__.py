"""``relax run``: the inference side of RL steps closed into a loop with a trainer.

- :mod:`~relax_core.run.config`: the job file's ``[run]`` table (:class:`RunConfig`);
- :mod:`~relax_core.run.data`: prompt sources (registered; the core's: generated arithmetic,
  JSONL files) and how ``dataset`` finds one;
- :mod:`~relax_core.run.stages`: a step's stages built from its stage tables through the
  registered stage kinds, and the core's two, ``reward`` and ``eval``;
- :mod:`~relax_core.run.rollout`: rollout shapes (how a prompt becomes a group: one
  completion per sample, or a multi-turn trajectory), built from ``[run.generation]``;
- :mod:`~relax_core.run.generate`: the producer (groups of samples through the rollout route);
- :mod:`~relax_core.run.job`: what a run brings up on Ray (managers in actors, the trainer,
  the coordinator, the batch sink) and takes down;
- :mod:`~relax_core.run.driver`: THE step driver (sync is ``max_staleness = 0``);
- :mod:`~relax_core.run.loop`: what a run reports of the steps it drives;
- :mod:`~relax_core.run.trainer`: the trainer interface (:class:`Trainer`), how ``[run]
  trainer`` finds one (a registered name or a class path) and its Ray actor; no torch: the
  reference trainer is the ``relax-torch-trainer`` plugin;
- :mod:`~relax_core.run.measure`: ``--measure``, phase switches against a copy of their bytes;
- :mod:`~relax_core.run.progress`: what is printed.

See ``docs/run.md``.
"""

from relax_core._exports import claim as _claim
from relax_core.run.config import RunConfig, StageTable, parse_run_config
from relax_core.run.data import (
    ArithmeticSource,
    JsonlSource,
    Prompt,
    PromptSource,
    SourceRequest,
    find_source,
    open_source,
    source_problems,
)
from relax_core.run.job import RunJob, run_problems
from relax_core.run.loop import FailedStep, RunSummary, run_loop
from relax_core.run.measure import SwitchProbe, switch_report
from relax_core.run.progress import Printer
from relax_core.run.rollout import (
    GroupRequest,
    RolloutShape,
    RolloutShapeConfig,
    build_rollout_shape,
    rollout_problems,
)
from relax_core.run.stages import (
    EvalStage,
    RewardWeight,
    StageConfig,
    build_stages,
    read_rewards,
    stage_problems,
)
from relax_core.run.trainer import Trainer, TrainerContext, load_trainer_class, start_trainer

__all__ = [
    "ArithmeticSource",
    "EvalStage",
    "FailedStep",
    "GroupRequest",
    "JsonlSource",
    "Printer",
    "Prompt",
    "PromptSource",
    "RewardWeight",
    "RolloutShape",
    "RolloutShapeConfig",
    "RunConfig",
    "RunJob",
    "RunSummary",
    "SourceRequest",
    "StageConfig",
    "StageTable",
    "SwitchProbe",
    "Trainer",
    "TrainerContext",
    "build_rollout_shape",
    "build_stages",
    "find_source",
    "load_trainer_class",
    "open_source",
    "parse_run_config",
    "read_rewards",
    "rollout_problems",
    "run_loop",
    "run_problems",
    "source_problems",
    "stage_problems",
    "start_trainer",
    "switch_report",
]

_claim(__name__, globals(), __all__)

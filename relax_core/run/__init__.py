"""``relax run``: the inference side of RL steps closed into a loop with a trainer (its modules:
``docs/architecture.md``; its use: ``docs/run.md``)."""

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
from relax_core.run.progress import Printer
from relax_core.run.rollout import (
    GroupRequest,
    RolloutShape,
    RolloutShapeConfig,
    build_rollout_shape,
    rollout_problems,
)
from relax_core.run.stages import EvalStage, StageConfig, build_stages, read_rewards, stage_problems
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
    "RolloutShape",
    "RolloutShapeConfig",
    "RunConfig",
    "RunJob",
    "RunSummary",
    "SourceRequest",
    "StageConfig",
    "StageTable",
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
]

_claim(__name__, globals(), __all__)

"""``relax run``: the inference side of RL steps closed into a loop with a trainer.

- :mod:`~relax_core.run.config`: the job file's ``[run]`` table (:class:`RunConfig`);
- :mod:`~relax_core.run.data`: the prompt sources (generated arithmetic, JSONL files);
- :mod:`~relax_core.run.generate`: the producer (groups of samples through the rollout route);
- :mod:`~relax_core.run.job`: what a run brings up on Ray (managers in actors, the trainer,
  the coordinator, the batch sink) and takes down;
- :mod:`~relax_core.run.loop`: the step loop;
- :mod:`~relax_core.run.trainer`: the trainer interface (:class:`Trainer`), how ``[run]
  trainer`` finds one (a registered name or a class path) and its Ray actor; no torch: the
  reference trainer is the ``relax-torch-trainer`` plugin;
- :mod:`~relax_core.run.measure`: ``--measure``, phase switches against a copy of their bytes;
- :mod:`~relax_core.run.progress`: what is printed.

See ``docs/run.md``.
"""

from relax_core._exports import claim as _claim
from relax_core.run.config import RewardWeight, RunConfig, parse_run_config
from relax_core.run.data import ArithmeticSource, JsonlSource, Prompt, PromptSource, open_source
from relax_core.run.job import RunJob, run_problems
from relax_core.run.loop import FailedStep, RunSummary, run_loop
from relax_core.run.measure import SwitchProbe, switch_report
from relax_core.run.progress import Printer
from relax_core.run.trainer import Trainer, TrainerContext, load_trainer_class, start_trainer

__all__ = [
    "ArithmeticSource",
    "FailedStep",
    "JsonlSource",
    "Printer",
    "Prompt",
    "PromptSource",
    "RewardWeight",
    "RunConfig",
    "RunJob",
    "RunSummary",
    "SwitchProbe",
    "Trainer",
    "TrainerContext",
    "load_trainer_class",
    "open_source",
    "parse_run_config",
    "run_loop",
    "run_problems",
    "start_trainer",
    "switch_report",
]

_claim(__name__, globals(), __all__)

"""The reference trainer of ``relax run``: GRPO and on-policy distillation on a torch Llama.

Registers the trainer ``grpo`` (:class:`~relax_torch_trainer.trainer.PolicyTrainer`), the
default of ``[run] trainer``. Its model (:mod:`relax_torch_trainer.policy`) and loss
(:mod:`relax_torch_trainer.loss`) import torch; this module does not, so loading the plugin in
a ``relax`` command imports no torch (only the trainer's Ray actor does).
"""

from __future__ import annotations

from collections.abc import Callable

from relax_core import TrainerSpec, hookimpl
from relax_torch_trainer.trainer import PolicyTrainer

__all__ = ["GRPO_TRAINER", "PolicyTrainer"]

GRPO_TRAINER = TrainerSpec(
    name="grpo",
    trainer_class=PolicyTrainer,
    description="GRPO with rollout log-probs and on-policy distillation; a torch Llama, Adam.",
)


@hookimpl
def relax_register_trainers(register: Callable[[TrainerSpec], None]) -> None:
    """Register the reference trainer, ``grpo``."""
    register(GRPO_TRAINER)

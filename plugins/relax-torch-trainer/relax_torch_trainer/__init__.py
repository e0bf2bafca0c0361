"""The reference trainer of ``relax run``: GRPO and on-policy distillation on a torch Llama.

Registers the trainer ``grpo`` (:class:`~relax_torch_trainer.trainer.PolicyTrainer`), the
default of ``[run] trainer`` (its record says ``default=True``), with its ``[run]`` keys
(:class:`~relax_torch_trainer.options.GRPOOptions`: ``learning_rate``, ``clip``,
``distill_coef``, ``importance_cap``). Its model (:mod:`relax_torch_trainer.policy`) and loss
(:mod:`relax_torch_trainer.loss`) import torch; this module does not, so loading the plugin in
a ``relax`` command imports no torch (only the trainer's Ray actor does).
"""

from __future__ import annotations

from collections.abc import Callable

from relax_core import TrainerSpec, hookimpl
from relax_torch_trainer.options import GRPOOptions, check_run
from relax_torch_trainer.trainer import PolicyTrainer

__all__ = ["GRPO_TRAINER", "GRPOOptions", "PolicyTrainer"]

GRPO_TRAINER = TrainerSpec(
    name="grpo",
    trainer_class=PolicyTrainer,
    description="GRPO with rollout log-probs and on-policy distillation; a torch Llama, Adam.",
    options=GRPOOptions,
    check=check_run,
    default=True,
)


@hookimpl
def relax_register_trainers(register: Callable[[TrainerSpec], None]) -> None:
    """Register the reference trainer, ``grpo``."""
    register(GRPO_TRAINER)

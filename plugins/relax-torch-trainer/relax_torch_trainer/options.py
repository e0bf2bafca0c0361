"""The reference trainer's keys of the ``[run]`` table: its learning settings and loss weights.

``GRPOOptions`` is the ``grpo`` trainer's options record (:attr:`relax_core.TrainerSpec.options`):
the core reads these keys of ``[run]`` through it before anything starts, reporting a bad one at
its key path (``run.learning_rate``), and the trainer gets the instance as ``context.options``.
:func:`check_run` adds the one rule across the table: a distillation weight needs a teacher.
"""

from __future__ import annotations

from typing import Any

import attrs

from relax_core import ConfigProblem, ConfigReader, RunConfig

__all__ = ["GRPOOptions", "check_run"]


def _cap(v: Any) -> str | None:
    if v == 0 or v >= 1:
        return None
    return f"must be 0 (off) or a cap >= 1 on the importance weight, got {v!r}"


@attrs.frozen
class GRPOOptions:
    """The ``grpo`` trainer's ``[run]`` keys.

    ``learning_rate``: Adam's learning rate. ``clip``: PPO's clip range of the policy ratio.
    ``distill_coef``: the weight of the distillation term (``None``: 1.0), used when the step's
    stages write the teacher's fields. ``importance_cap``: the off-policy correction's cap on
    ``π_trainer / π_rollout`` of each token, decoupled from PPO's clip (0: off; ``None``: 2 in
    async mode, else 0).
    """

    learning_rate: float = attrs.field(default=1e-5, metadata={"check": ConfigReader.positive})
    clip: float = attrs.field(default=0.2, metadata={"check": ConfigReader.positive})
    distill_coef: float | None = attrs.field(
        default=None, metadata={"check": ConfigReader.at_least(0)}
    )
    importance_cap: float | None = attrs.field(default=None, metadata={"check": _cap})

    def distill_weight(self) -> float:
        """The distillation term's weight (``distill_coef``, 1.0 when not given)."""
        return 1.0 if self.distill_coef is None else self.distill_coef

    def cap(self, mode: str) -> float:
        """The importance weight's cap in a run of ``mode`` (0: no correction)."""
        if self.importance_cap is not None:
            return self.importance_cap
        return 2.0 if mode == "async" else 0.0


def check_run(run: RunConfig) -> list[ConfigProblem]:
    """``distill_coef`` given in ``[run]``'s shorthand with no teacher stage is a problem (with
    ``[[run.stages]]`` the stages say what writes the teacher's fields)."""
    options = run.trainer_options
    if not isinstance(options, GRPOOptions) or options.distill_coef is None:
        return []
    shorthand = all(stage.path == "run" for stage in run.stages)
    if shorthand and not any(stage.kind == "distill" for stage in run.stages):
        return [
            ConfigProblem(
                "run.distill_coef",
                "teacher-role",
                "there is no teacher stage without teacher_role; name the role to distill from",
            )
        ]
    return []

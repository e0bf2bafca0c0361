"""Trainers without torch for the core's trainer tests: what ``relax run`` needs of one and
nothing more (a class built from a ``TrainerContext`` with ``train`` and ``push``)."""

from __future__ import annotations

from typing import Any

from relax_core import TrainerContext


class EchoTrainer:
    """Trains on nothing: ``train`` and ``push`` say what they were asked, with the job."""

    def __init__(self, context: TrainerContext) -> None:
        self.context = context
        self.version: str | None = None

    def train(self, batch_id: int) -> dict[str, Any]:
        return {"batch_id": batch_id, "job": self.context.job}

    def push(self, weight_version: str) -> dict[str, Any]:
        self.version = weight_version
        return {"weight_version": weight_version}


class BrokenTrainer(EchoTrainer):
    """Cannot load its model: its constructor raises, as a missing checkpoint would."""

    def __init__(self, context: TrainerContext) -> None:
        raise FileNotFoundError(f"no checkpoint at {context.model_path}")


class NoPush:
    """Not a trainer: it has no ``push``."""

    def __init__(self, context: TrainerContext) -> None:
        self.context = context

    def train(self, batch_id: int) -> dict[str, Any]:
        return {}

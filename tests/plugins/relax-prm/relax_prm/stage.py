"""The ``prm`` stage: the process reward model scores each step of every response.

A response's steps are its non-empty lines (the whole response when it has none, at most
``max_steps``). For step ``i`` the stage prefills the PRM's own prompt of the question and the
first ``i + 1`` steps (:func:`~relax_prm.adapter.render_steps`, each step followed by the step
tag) on the role's engines and takes the probability the model gives the last token, the step
tag closing step ``i``: that is the step's score, in (0, 1]. It writes ``prm_scores``, one per
step, validated by the batch before anything is written back. All of a group's requests go to
one replica (its id is the affinity key).
"""

from __future__ import annotations

import asyncio
import math
from collections.abc import Callable, Sequence
from typing import Any

from relax_core import (
    ConfigReader,
    RelaxError,
    Sample,
    SampleField,
    ScoringError,
    StageConfig,
    StageContext,
    StageReport,
    StageSpec,
    hookimpl,
)
from relax_prm.adapter import render_steps

__all__ = ["PRM", "PRM_SCORES", "PRMStage", "steps_of"]


def steps_of(response: str, max_steps: int) -> list[str]:
    """The steps of a response: its non-empty lines, at most ``max_steps`` (the last takes
    the rest); the whole response when it has no non-empty line."""
    lines = [line.strip() for line in response.splitlines() if line.strip()]
    if not lines:
        return [response.strip() or response or " "]
    if len(lines) > max_steps:
        lines = [*lines[: max_steps - 1], " ".join(lines[max_steps - 1 :])]
    return lines


def _check(value: Any, sample: Sample) -> str | None:
    if not isinstance(value, tuple) or not value:
        return f"prm_scores = {value!r} is not a non-empty tuple of step scores"
    for i, v in enumerate(value):
        if not isinstance(v, float) or not 0.0 < v <= 1.0:
            return f"prm_scores[{i}] = {v!r} is not a probability in (0, 1]"
    return None


#: What the stage writes: one score per step of the response.
PRM_SCORES = SampleField(
    "prm_scores", _check, "the process reward model's score of each step of the response"
)


class PRMStage:
    """Scores every step of every staged sample on ``role``'s engines (see the module)."""

    fields = (PRM_SCORES,)

    def __init__(
        self,
        name: str,
        role: str,
        *,
        models: Sequence[str] = (),
        max_steps: int = 8,
        concurrency: int = 16,
        timeout: float | None = None,
    ) -> None:
        self.name = name
        self.role = role
        self.models = tuple(models)
        self.max_steps = max_steps
        self.concurrency = concurrency
        self.timeout = timeout

    async def run(self, samples: Sequence[Sample], ctx: StageContext) -> StageReport:
        """Score every step of ``samples`` (concurrently); raise on the first failure."""
        client = ctx.clients.client(self.role)
        model = self.models[0] if len(self.models) == 1 else None
        gate = asyncio.Semaphore(self.concurrency)

        async def score(sample: Sample, steps: list[str]) -> float:
            body = {
                "text": render_steps(steps, sample.prompt),
                "sampling_params": {"max_new_tokens": 0, "temperature": 0.0},
                "return_logprob": True,
                "logprob_start_len": 0,
            }
            async with gate:
                try:
                    answer = await client.post(
                        "/generate", body, model=model, affinity_key=sample.group_id,
                        timeout=self.timeout,
                    )  # fmt: skip
                    last = answer["meta_info"]["input_token_logprobs"][-1][0]
                except (RelaxError, KeyError, IndexError, TypeError) as exc:
                    raise ScoringError(
                        self.name,
                        f"step {len(steps)} of sample {sample.id} (group {sample.group_id}) on "
                        f"role {self.role!r}: {type(exc).__name__}: {exc}",
                    ) from exc
            return math.exp(float(last))

        async def one(sample: Sample) -> int:
            steps = steps_of(sample.response, self.max_steps)
            scores = await asyncio.gather(
                *(score(sample, steps[: i + 1]) for i in range(len(steps)))
            )
            sample.fields["prm_scores"] = tuple(scores)
            return len(steps)

        counts = await asyncio.gather(*(one(s) for s in samples))
        return StageReport(self.name, {"samples": len(samples), "steps": sum(counts)})


def build(config: StageConfig) -> PRMStage:
    """The stage from its table: ``max_steps`` (8), ``concurrency`` (16).

    :raises ConfigValidationError: a key out of range, at its key path.
    """
    r = ConfigReader()
    o, p = config.options, config.path
    max_steps = r.value(o, p, "max_steps", int, 8, check=ConfigReader.at_least(1))
    concurrency = r.value(o, p, "concurrency", int, 16, check=ConfigReader.at_least(1))
    r.raise_problems()
    assert config.role is not None
    return PRMStage(
        config.name,
        config.role,
        models=config.models,
        max_steps=max_steps,
        concurrency=concurrency,
        timeout=config.run.request_timeout,
    )


#: The stage kind: ``[[run.stages]] stage = "prm"``, ``role = "prm"``.
PRM = StageSpec(
    name="prm",
    build=build,
    options=("max_steps", "concurrency"),
    needs_role=True,
    description="Process reward model (test plugin): a score per step of each response.",
)


@hookimpl
def relax_register_stages(register: Callable[[StageSpec], None]) -> None:
    """Register the ``prm`` stage kind."""
    register(PRM)

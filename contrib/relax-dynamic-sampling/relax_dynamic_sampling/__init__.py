"""DAPO-style dynamic sampling as a step stage: drop the groups whose rewards all (nearly) equal,
which carry no policy-gradient signal under group-normalised advantages, and have the step
generate more groups until the batch is full again.

Registers the stage kind ``dynamic-sampling`` (:data:`DYNAMIC_SAMPLING`) through the core's
public API only. Listed after the stages that write the reward::

    [[run.stages]]
    stage = "reward"
    rewards = [{ adapter = "exact-match" }]

    [[run.stages]]
    stage = "dynamic-sampling"
    max_rounds = 4          # over-sampling rounds at most; then the step fails, saying why
    oversample = 1.5        # each round generates 1.5 x the groups still missing
    min_std = 0.0           # a group is kept when its rewards' std is above this

Each round takes the rollout lease back (the batch's ``generate``), generates the missing
groups times ``oversample`` from the step's prompt source, adds them to the batch, has the
stages before it that write fields score them (each with its own lease), and filters them the
same way. Groups beyond the batch size are dropped last ("beyond the batch size"). Its report
— in the step's JSON line under ``stages`` — counts ``dropped_groups`` (no reward variance),
``trimmed_groups``, ``generated_groups``, ``rounds`` and ``kept_groups``.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Callable, Sequence

from relax_core import (
    ConfigReader,
    Sample,
    SampleField,
    ScoringError,
    StageConfig,
    StageContext,
    StageReport,
    StageSpec,
    hookimpl,
)

__all__ = ["DYNAMIC_SAMPLING", "DynamicSampling"]

#: Why a group with rewards that do not vary is dropped (the step's ``dropped.reasons``).
NO_VARIANCE = "its rewards do not vary"
#: Why a group past the batch size is dropped.
BEYOND = "beyond the batch size"


class DynamicSampling:
    """The ``dynamic-sampling`` stage (see the module docstring).

    :param name: its name in the step.
    :param max_rounds: over-sampling rounds at most (0: filter only, never generate).
    :param oversample: each round generates ``ceil(missing x oversample)`` groups.
    :param min_std: a group is kept when the population std of its rewards is above it.
    :param field: the sample field whose spread decides (``reward``).
    """

    role: str | None = None
    models: tuple[str, ...] = ()
    fields: tuple[SampleField, ...] = ()

    def __init__(
        self,
        name: str,
        *,
        max_rounds: int = 3,
        oversample: float = 1.0,
        min_std: float = 0.0,
        field: str = "reward",
    ) -> None:
        self.name = name
        self.max_rounds = max_rounds
        self.oversample = oversample
        self.min_std = min_std
        self.field = field

    def _flat(self, samples: Sequence[Sample]) -> dict[str, bool]:
        """Group id -> whether its rewards do not vary, in the order of ``samples``."""
        values: dict[str, list[float]] = {}
        for s in samples:
            value = s.fields.get(self.field)
            if not isinstance(value, int | float):
                raise ScoringError(
                    self.name,
                    f"sample {s.id} has no {self.field!r} to filter on; list this stage after "
                    "the stage that writes it",
                )
            values.setdefault(s.group_id, []).append(float(value))
        return {g: statistics.pstdev(v) <= self.min_std for g, v in values.items()}

    async def run(self, samples: Sequence[Sample], ctx: StageContext) -> StageReport:
        """Filter the batch, over-sample until it is full, trim it to the batch size.

        :raises ScoringError: still short of groups after ``max_rounds`` rounds (with none
            kept it returns instead: the batch is empty, and ``[run] on_empty_batch`` skips
            or fails the step; an empty batch is never committed).
        """
        target = ctx.target_groups
        scorers = [s for s in ctx.upstream if s.fields]
        flat = self._flat(samples)
        dropped = [g for g, is_flat in flat.items() if is_flat]
        kept = [g for g, is_flat in flat.items() if not is_flat]
        ctx.drop(dropped, NO_VARIANCE)
        rounds = generated = 0
        while len(kept) < target:
            if rounds == self.max_rounds and not kept:
                break  # every group dropped: the step's on_empty_batch decides (skip or fail)
            if rounds == self.max_rounds:
                raise ScoringError(
                    self.name,
                    f"{len(kept)} of {target} groups have rewards that vary after {rounds} "
                    f"over-sampling round(s) ({generated} groups generated, {len(dropped)} "
                    "dropped); raise max_rounds or oversample, lower min_std, or check that the "
                    "prompts are neither all solved nor all failed",
                )
            rounds += 1
            want = math.ceil((target - len(kept)) * self.oversample)
            added = ctx.add(await ctx.generate(groups=want))
            generated += want
            for stage in scorers:
                await ctx.run_stage(stage, added)
            flat = self._flat(added)
            new_flat = [g for g, is_flat in flat.items() if is_flat]
            ctx.drop(new_flat, NO_VARIANCE)
            dropped += new_flat
            kept += [g for g, is_flat in flat.items() if not is_flat]
        extra = kept[target:]
        if extra:
            ctx.drop(extra, BEYOND)
        return StageReport(
            self.name,
            {
                "kept_groups": len(kept) - len(extra),
                "dropped_groups": len(dropped),
                "trimmed_groups": len(extra),
                "generated_groups": generated,
                "rounds": rounds,
            },
        )


def build(config: StageConfig) -> DynamicSampling:
    """The stage from its ``[[run.stages]]`` table (``max_rounds``, ``oversample``,
    ``min_std``, ``field``).

    :raises ConfigValidationError: a key out of range, at its key path.
    """
    r = ConfigReader()
    o, p = config.options, config.path
    stage = DynamicSampling(
        config.name,
        max_rounds=r.value(o, p, "max_rounds", int, 3, check=ConfigReader.at_least(0)),
        oversample=r.value(o, p, "oversample", float, 1.0, check=ConfigReader.at_least(1)),
        min_std=r.value(o, p, "min_std", float, 0.0, check=ConfigReader.at_least(0)),
        field=r.value(o, p, "field", str, "reward", check=ConfigReader.non_empty),
    )
    if config.role is not None:
        r.problem(config.key("role"), "role", "dynamic sampling calls no engine: drop role")
    r.raise_problems()
    return stage


#: The stage kind this plugin registers.
DYNAMIC_SAMPLING = StageSpec(
    name="dynamic-sampling",
    build=build,
    options=("max_rounds", "oversample", "min_std", "field"),
    description="DAPO dynamic sampling: drop groups whose rewards do not vary, refill the batch.",
)


@hookimpl
def relax_register_stages(register: Callable[[StageSpec], None]) -> None:
    """Register the ``dynamic-sampling`` stage kind."""
    register(DYNAMIC_SAMPLING)

"""The core's registrations of rollout shapes, environments and the environment's reward
adapter (re-exported by :mod:`relax_core.builtins`)."""

from __future__ import annotations

from collections.abc import Callable

from relax_core.agent.calculator import CALCULATOR
from relax_core.agent.multiturn import MULTI_TURN_OPTIONS, build_multi_turn
from relax_core.coordination.rewards import RewardContext
from relax_core.hookspecs import hookimpl
from relax_core.records import EnvironmentSpec, RewardSpec, RolloutShapeSpec
from relax_core.run.generate import build_single_turn

__all__ = [
    "environment_reward",
    "relax_register_environments",
    "relax_register_reward_adapters",
    "relax_register_rollout_shapes",
]


async def environment_reward(response: str, label: str | None, *, context: RewardContext) -> float:
    """The ``environment`` adapter: the sum of a trajectory's per-turn rewards (the ones its
    environment gave; ``metadata["trajectory"]["turn_rewards"]``, ``None`` entries skipped),
    0.0 for a sample that is no trajectory."""
    trajectory = context.sample.metadata.get("trajectory")
    rewards = trajectory.get("turn_rewards", []) if isinstance(trajectory, dict) else []
    return float(sum(r for r in rewards if r is not None))


@hookimpl
def relax_register_rollout_shapes(register: Callable[[RolloutShapeSpec], None]) -> None:
    """Register ``single-turn`` (the default) and ``multi-turn``."""
    register(
        RolloutShapeSpec(
            name="single-turn",
            build=build_single_turn,
            options=(),
            description="one completion per sample (samples_per_prompt per /generate request)",
        )
    )
    register(
        RolloutShapeSpec(
            name="multi-turn",
            build=build_multi_turn,
            options=MULTI_TURN_OPTIONS,
            description="a trajectory per sample: policy turns and an environment's "
            "observations, token-exact, loss-masked",
        )
    )


@hookimpl
def relax_register_environments(register: Callable[[EnvironmentSpec], None]) -> None:
    """Register ``calculator``."""
    register(CALCULATOR)


@hookimpl
def relax_register_reward_adapters(register: Callable[[RewardSpec], None]) -> None:
    """Register ``environment``: a trajectory's per-turn rewards, summed."""
    register(
        RewardSpec(
            name="environment",
            fn=environment_reward,
            mode="async",
            supports_deferred=True,
            description="the sum of a trajectory's per-turn environment rewards",
        )
    )

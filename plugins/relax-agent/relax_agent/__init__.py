"""Relax's agentic rollouts: the ``multi-turn`` rollout shape, the built-in ``calculator``
environment and the ``environment`` reward adapter.

- :mod:`~relax_agent.multiturn`: the ``multi-turn`` shape (:class:`MultiTurn`): each sample a
  trajectory of policy turns and an environment's observations, token-exact, loss-masked;
- :mod:`~relax_agent.template`: the chat template applied once per turn boundary,
  prefix-stable and checked (:class:`ChatTurns`);
- :mod:`~relax_agent.calculator`: the ``calculator`` environment (safe arithmetic, no eval);
- :mod:`~relax_agent.environment` and :mod:`~relax_agent.tools`: the contracts an environment
  builds on (``Environment``, ``Reset``, ``Turn``, ``Observation``, ``EnvironmentConfig``;
  ``Tool``, ``ToolBox``, ``parse_tool_calls``, …), exported here for environment plugins.

The core holds the registration (``relax_register_environments`` and ``EnvironmentSpec``). See
``docs/run.md`` (agentic rollouts) and ``docs/plugins.md`` (an environment plugin).
"""

from __future__ import annotations

from collections.abc import Callable

from relax_agent.calculator import CALCULATOR, CalculatorEnvironment, evaluate
from relax_agent.environment import (
    Environment,
    EnvironmentConfig,
    EnvironmentStepError,
    Observation,
    Reset,
    Turn,
)
from relax_agent.multiturn import (
    MULTI_TURN_OPTIONS,
    MultiTurn,
    build_multi_turn,
    multi_turn_needs,
)
from relax_agent.template import ChatTurns, NotPrefixStable
from relax_agent.tools import (
    Tool,
    ToolBox,
    ToolCall,
    ToolResult,
    format_tool_call,
    parse_tool_calls,
    tool_message,
)
from relax_core import (
    EnvironmentSpec,
    RewardContext,
    RewardSpec,
    RolloutShapeSpec,
    hookimpl,
)

__all__ = [
    "CALCULATOR",
    "ENVIRONMENT_REWARD",
    "MULTI_TURN",
    "CalculatorEnvironment",
    "ChatTurns",
    "Environment",
    "EnvironmentConfig",
    "EnvironmentStepError",
    "MultiTurn",
    "NotPrefixStable",
    "Observation",
    "Reset",
    "Tool",
    "ToolBox",
    "ToolCall",
    "ToolResult",
    "Turn",
    "environment_reward",
    "evaluate",
    "format_tool_call",
    "parse_tool_calls",
    "relax_register_environments",
    "relax_register_reward_adapters",
    "relax_register_rollout_shapes",
    "tool_message",
]


async def environment_reward(response: str, label: str | None, *, context: RewardContext) -> float:
    """The ``environment`` adapter: the sum of a trajectory's per-turn rewards (the ones its
    environment gave; ``metadata["trajectory"]["turn_rewards"]``, ``None`` entries skipped),
    0.0 for a sample that is no trajectory."""
    trajectory = context.sample.metadata.get("trajectory")
    rewards = trajectory.get("turn_rewards", []) if isinstance(trajectory, dict) else []
    return float(sum(r for r in rewards if r is not None))


MULTI_TURN = RolloutShapeSpec(
    name="multi-turn",
    build=build_multi_turn,
    options=MULTI_TURN_OPTIONS,
    needs=multi_turn_needs,
    description="a trajectory per sample: policy turns and an environment's "
    "observations, token-exact, loss-masked",
)
ENVIRONMENT_REWARD = RewardSpec(
    name="environment",
    fn=environment_reward,
    mode="async",
    supports_deferred=True,
    description="the sum of a trajectory's per-turn environment rewards",
)


@hookimpl
def relax_register_rollout_shapes(register: Callable[[RolloutShapeSpec], None]) -> None:
    """Register ``multi-turn``."""
    register(MULTI_TURN)


@hookimpl
def relax_register_environments(register: Callable[[EnvironmentSpec], None]) -> None:
    """Register ``calculator``."""
    register(CALCULATOR)


@hookimpl
def relax_register_reward_adapters(register: Callable[[RewardSpec], None]) -> None:
    """Register ``environment``: a trajectory's per-turn rewards, summed."""
    register(ENVIRONMENT_REWARD)

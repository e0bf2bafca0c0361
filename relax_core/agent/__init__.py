"""Multi-turn agentic rollouts: environments and tools as plugins, token-exact trajectories.

- :mod:`~relax_core.agent.environment`: what an environment takes and gives (:class:`Reset`,
  :class:`Turn`, :class:`Observation`, :class:`EnvironmentConfig`) and its Protocol;
- :mod:`~relax_core.agent.tools`: the tool-call format (Hermes/Qwen ``<tool_call>``), the
  tool registry with a timeout per call (:class:`ToolBox`);
- :mod:`~relax_core.agent.template`: the chat template applied once per turn boundary,
  prefix-stable and checked (:class:`ChatTurns`);
- :mod:`~relax_core.agent.multiturn`: the ``multi-turn`` rollout shape (:class:`MultiTurn`);
- :mod:`~relax_core.agent.calculator`: the built-in ``calculator`` environment.

See ``docs/run.md`` (agentic rollouts) and ``docs/plugins.md`` (an environment plugin).
"""

from relax_core._exports import claim as _claim
from relax_core.agent.calculator import CalculatorEnvironment, evaluate
from relax_core.agent.environment import Environment, EnvironmentConfig, Observation, Reset, Turn
from relax_core.agent.multiturn import MultiTurn
from relax_core.agent.template import ChatTurns
from relax_core.agent.tools import (
    Tool,
    ToolBox,
    ToolCall,
    ToolResult,
    format_tool_call,
    parse_tool_calls,
    tool_message,
)

__all__ = [
    "CalculatorEnvironment",
    "ChatTurns",
    "Environment",
    "EnvironmentConfig",
    "MultiTurn",
    "Observation",
    "Reset",
    "Tool",
    "ToolBox",
    "ToolCall",
    "ToolResult",
    "Turn",
    "evaluate",
    "format_tool_call",
    "parse_tool_calls",
    "tool_message",
]

_claim(__name__, globals(), __all__)

"""The contracts of multi-turn agentic rollouts: what an environment plugin builds on.

- :mod:`~relax_core.agent.environment`: what an environment takes and gives (:class:`Reset`,
  :class:`Turn`, :class:`Observation`, :class:`EnvironmentConfig`) and its Protocol;
- :mod:`~relax_core.agent.tools`: the tool-call format (Hermes/Qwen ``<tool_call>``), the
  tool registry with a timeout per call (:class:`ToolBox`).

The ``multi-turn`` rollout shape that drives environments (the chat template per turn
boundary, token-exact trajectories), the built-in ``calculator`` environment and the
``environment`` reward adapter are the ``relax-agent`` plugin's. See ``docs/run.md`` (agentic
rollouts) and ``docs/plugins.md`` (an environment plugin).
"""

from relax_core._exports import claim as _claim
from relax_core.agent.environment import Environment, EnvironmentConfig, Observation, Reset, Turn
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
    "Environment",
    "EnvironmentConfig",
    "Observation",
    "Reset",
    "Tool",
    "ToolBox",
    "ToolCall",
    "ToolResult",
    "Turn",
    "format_tool_call",
    "parse_tool_calls",
    "tool_message",
]

_claim(__name__, globals(), __all__)

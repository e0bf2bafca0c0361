"""The contracts of multi-turn agentic rollouts: environments and tool calls (the
``multi-turn`` shape is the ``relax-agent`` plugin's; ``docs/plugins.md``).
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

"""The rollout role: generates samples from the policy being trained.

Registers the ``rollout`` :class:`~relax_core.RoleSpec` (ACTOR or DCS weights, routed through
sglang-router by default) and its gateway adapter: raw ``/generate`` and chat completions,
streamed or not, forwarded unchanged apart from the gateway's model/route-key handling.
"""

from __future__ import annotations

from collections.abc import Callable

from relax_core import RoleSpec, hookimpl
from relax_rollout.adapter import RolloutAdapter

__all__ = ["ROLLOUT_ROLE", "RolloutAdapter"]

ROLLOUT_ROLE = RoleSpec(
    name="rollout",
    allowed_weight_sources={"ACTOR", "DCS"},
    default_route_mode="SGLANG_ROUTER",
    default_weight_source="ACTOR",
    deferrable=False,
    gateway_adapter=RolloutAdapter,
    description="Policy generation: raw /generate and chat, streamed or not; ACTOR weights.",
)


@hookimpl
def relax_register_roles(register: Callable[[RoleSpec], None]) -> None:
    """Register the rollout role."""
    register(ROLLOUT_ROLE)

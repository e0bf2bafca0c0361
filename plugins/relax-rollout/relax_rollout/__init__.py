"""The rollout role: generates samples from the policy being trained.

Registers the ``rollout`` :class:`~relax_core.RoleSpec` (ACTOR or DCS weights, routed through
sglang-router by default, the generation phase under ``defer``) and its gateway adapter: raw
``/generate`` (single or batched) and chat completions, streamed or not, forwarded unchanged
apart from the gateway's model/route-key handling.
"""

from __future__ import annotations

from collections.abc import Callable

from relax_core import OpenAPINotes, RoleSpec, hookimpl
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
    # It generates the batch the deferred roles score: under mode = "defer" it runs in the
    # generation phase and hands its bundles to them afterwards.
    generation_phase=True,
    health_schema=2,
    openapi=OpenAPINotes(batched_generate=True),  # RolloutAdapter accepts a list of prompts
)


@hookimpl
def relax_register_roles(register: Callable[[RoleSpec], None]) -> None:
    """Register the rollout role."""
    register(ROLLOUT_ROLE)

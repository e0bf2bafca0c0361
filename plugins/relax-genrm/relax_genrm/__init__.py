"""The genrm role: a generative reward model that judges responses, text in, text out.

Registers the ``genrm`` :class:`~relax_core.RoleSpec` (STATIC weights, DIRECT routing,
deferrable), its gateway adapter (the messages protocol) and the ``genrm-judge`` reward adapter
(supports deferred scoring).
"""

from __future__ import annotations

from collections.abc import Callable

from relax_core import RewardSpec, RoleSpec, hookimpl
from relax_genrm.adapter import GenRMAdapter, TokenizerCache
from relax_genrm.judge import JudgeClient, judge_reward, parse_verdict, render_judge_messages

__all__ = [
    "GENRM_ROLE",
    "JUDGE_REWARD",
    "GenRMAdapter",
    "JudgeClient",
    "TokenizerCache",
    "judge_reward",
    "parse_verdict",
    "render_judge_messages",
]

GENRM_ROLE = RoleSpec(
    name="genrm",
    allowed_weight_sources={"STATIC"},
    default_route_mode="DIRECT",
    default_weight_source="STATIC",
    deferrable=True,
    gateway_adapter=GenRMAdapter,
    description="Generative reward model: messages in, {'response': text} out; STATIC weights.",
    # A verdict must not depend on what else was in the batch.
    deterministic_inference=True,
)

JUDGE_REWARD = RewardSpec(
    name="genrm-judge",
    fn=judge_reward,
    mode="async",
    supports_deferred=True,
    description="Asks the genrm gateway to judge a response and parses its verdict into a reward.",
)


@hookimpl
def relax_register_roles(register: Callable[[RoleSpec], None]) -> None:
    """Register the genrm role."""
    register(GENRM_ROLE)


@hookimpl
def relax_register_reward_adapters(register: Callable[[RewardSpec], None]) -> None:
    """Register the genrm judge reward adapter."""
    register(JUDGE_REWARD)

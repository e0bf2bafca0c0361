"""The genrm role: a generative reward model that judges responses, text in, text out.

Registers the ``genrm`` :class:`~relax_core.RoleSpec` (STATIC weights, DIRECT routing,
deferrable, ``/genrm/health`` in the legacy schema 1 by default), its gateway adapter (the
messages protocol, described in the role's OpenAPI document) and the ``genrm-judge`` reward adapter
(async, supports deferred scoring: a judge's text becomes a reward, with a parse-failure count).
"""

from __future__ import annotations

from collections.abc import Callable

from relax_core import OpenAPINotes, RewardSpec, RoleSpec, hookimpl
from relax_genrm.adapter import MESSAGES_INPUT, GenRMAdapter, TokenizerCache
from relax_genrm.judge import (
    JUDGE_ROLE,
    JudgeClient,
    judge_reward,
    judge_sample,
    parse_verdict,
    read_verdict,
    render_judge_messages,
)

__all__ = [
    "GENRM_ROLE",
    "JUDGE_REWARD",
    "JUDGE_ROLE",
    "GenRMAdapter",
    "JudgeClient",
    "TokenizerCache",
    "judge_reward",
    "judge_sample",
    "parse_verdict",
    "read_verdict",
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
    # Its old consumers read the legacy {status, healthy_engines, total_engines} body.
    health_schema=1,
    title="GenRM",
    openapi=OpenAPINotes(
        generate_summary=" (or the messages judge protocol)",
        generate_inputs=(MESSAGES_INPUT,),
        generate_answer={
            "description": "{response: text} for messages; the engine's answer for raw input.",
            "type": "object",
        },
    ),
    # A verdict must not depend on what else was in the batch.
    deterministic_inference=True,
)

JUDGE_REWARD = RewardSpec(
    name="genrm-judge",
    fn=judge_reward,
    mode="async",
    supports_deferred=True,
    # one judge request, idempotent: one that failed for a transport reason or a 5xx is sent
    # again (the reward stage's mechanism), the role's dead replicas rebuilt first
    retries=2,
    description=(
        "Asks the genrm model to judge a response and turns its verdict into a reward (0.0 and "
        "a parse failure when the answer holds none)."
    ),
)


@hookimpl
def relax_register_roles(register: Callable[[RoleSpec], None]) -> None:
    """Register the genrm role."""
    register(GENRM_ROLE)


@hookimpl
def relax_register_reward_adapters(register: Callable[[RewardSpec], None]) -> None:
    """Register the genrm judge reward adapter."""
    register(JUDGE_REWARD)

"""The teacher role: on-policy-distillation teacher, prefill with log-probs and top-k.

Registers the ``teacher`` :class:`~relax_core.RoleSpec` (STATIC weights, DIRECT routing with
group affinity, deferrable) and its gateway adapter, which checks a prefill request before any
GPU sees it, and the step's distillation stages: ``distill`` (the teacher's prefill, its
log-probs or top-k) and ``student`` (the policy's own), :mod:`relax_teacher.distill`.
:func:`prefill_payload` and :func:`parse_prefill` build and check the canonical OPD prefill
request and answer.
"""

from __future__ import annotations

from collections.abc import Callable

from relax_core import OpenAPINotes, RoleSpec, hookimpl
from relax_teacher.adapter import TeacherAdapter
from relax_teacher.distill import (
    DISTILL,
    STUDENT,
    DistillationStage,
    PrefillResult,
    parse_prefill,
    prefill_payload,
    relax_register_stages,  # noqa: F401  (the plugin's hook)
)

__all__ = [
    "DISTILL",
    "STUDENT",
    "TEACHER_ROLE",
    "DistillationStage",
    "PrefillResult",
    "TeacherAdapter",
    "parse_prefill",
    "prefill_payload",
]

TEACHER_ROLE = RoleSpec(
    name="teacher",
    allowed_weight_sources={"STATIC"},
    default_route_mode="DIRECT",
    default_weight_source="STATIC",
    deferrable=True,
    gateway_adapter=TeacherAdapter,
    description="Distillation teacher: raw prefill with input log-probs and top-k; STATIC weights.",
    health_schema=2,
    openapi=OpenAPINotes(
        # The OPD prefill asks for the log-probs of these token ids at every position.
        generate_fields={
            "token_ids_logprob": {
                "type": "array",
                "items": {"type": "integer", "minimum": 0, "maximum": 2**31 - 1},
            }
        }
    ),
)


@hookimpl
def relax_register_roles(register: Callable[[RoleSpec], None]) -> None:
    """Register the teacher role."""
    register(TEACHER_ROLE)

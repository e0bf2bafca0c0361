"""The teacher role: on-policy-distillation teacher, prefill with log-probs and top-k.

Registers the ``teacher`` :class:`~relax_core.RoleSpec` (STATIC weights, DIRECT routing with
group affinity, deferrable) and its gateway adapter, which checks a prefill request before any
GPU sees it. :func:`prefill_payload` and :func:`parse_prefill` build and check the canonical OPD
prefill request and answer.
"""

from __future__ import annotations

from collections.abc import Callable

from relax_core import RoleSpec, hookimpl
from relax_teacher.adapter import TeacherAdapter
from relax_teacher.prefill import PrefillResult, parse_prefill, prefill_payload

__all__ = ["TEACHER_ROLE", "PrefillResult", "TeacherAdapter", "parse_prefill", "prefill_payload"]

TEACHER_ROLE = RoleSpec(
    name="teacher",
    allowed_weight_sources={"STATIC"},
    default_route_mode="DIRECT",
    default_weight_source="STATIC",
    deferrable=True,
    gateway_adapter=TeacherAdapter,
    description="Distillation teacher: raw prefill with input log-probs and top-k; STATIC weights.",
)


@hookimpl
def relax_register_roles(register: Callable[[RoleSpec], None]) -> None:
    """Register the teacher role."""
    register(TEACHER_ROLE)

"""The ``prm`` role: a process reward model that scores each step of a solution.

A test plugin: a third party's role, registered through the ``relax`` entry point with nothing
but the core's public records. STATIC weights, DIRECT routing, deferrable (it scores staged
batches in a deferred phase like any reward model), its own gateway adapter and the OpenAPI
note describing the adapter's ``steps`` input; and its step stage, ``prm``
(:mod:`relax_prm.stage`), which scores each step of every response of a batch.
"""

from __future__ import annotations

from collections.abc import Callable

from relax_core import OpenAPINotes, RoleSpec, hookimpl
from relax_prm.adapter import STEP_TAG, STEPS_INPUT, PRMAdapter, render_steps
from relax_prm.stage import (
    PRM,
    PRM_SCORES,
    PRMStage,
    relax_register_stages,  # noqa: F401  (the plugin's hook)
)

__all__ = [
    "PRM",
    "PRM_ROLE",
    "PRM_SCORES",
    "STEPS_INPUT",
    "STEP_TAG",
    "PRMAdapter",
    "PRMStage",
    "render_steps",
]

PRM_ROLE = RoleSpec(
    name="prm",
    allowed_weight_sources={"STATIC"},
    default_route_mode="DIRECT",
    default_weight_source="STATIC",
    deferrable=True,
    gateway_adapter=PRMAdapter,
    description="Process reward model (test plugin): a solution's steps in, scored; STATIC.",
    title="PRM",
    openapi=OpenAPINotes(
        generate_summary=" (or a solution's steps)", generate_inputs=(STEPS_INPUT,)
    ),
)


@hookimpl
def relax_register_roles(register: Callable[[RoleSpec], None]) -> None:
    """Register the prm role."""
    register(PRM_ROLE)

"""The core's own plugin (``relax-core``, registered by ``PluginManager.create``): built-in weight
sources, routing policies, placement modes, prompt sources, the ``single-turn`` shape and the
``reward`` and ``eval`` stages, each hook implemented beside the code it registers."""

from __future__ import annotations

from collections.abc import Callable

from relax_core.discovery.policies import relax_register_routing_policies  # noqa: F401
from relax_core.hookspecs import hookimpl
from relax_core.placement.modes import relax_register_placement_modes  # noqa: F401
from relax_core.records import RolloutShapeSpec, WeightSource
from relax_core.run.data import relax_register_data_sources  # noqa: F401
from relax_core.run.generate import build_single_turn
from relax_core.run.stages import relax_register_stages  # noqa: F401

STATIC = WeightSource(
    name="STATIC",
    update_paths=frozenset(),
    publishes_version=False,
    description="Fixed checkpoint: every update path, LoRA and seed sync are refused.",
)
ACTOR = WeightSource(
    name="ACTOR",
    update_paths={"tensor", "distributed", "disk", "lora", "seed_sync"},
    publishes_version=True,
    description="Weights pushed by the trainer every step; weight_version is published.",
)
DCS = WeightSource(
    name="DCS",
    update_paths={"disk"},
    publishes_version=True,
    description="Versioned checkpoints pulled from a checkpoint directory (version-N/).",
)


@hookimpl
def relax_register_weight_sources(register: Callable[[WeightSource], None]) -> None:
    """Register STATIC, ACTOR and DCS."""
    for source in (STATIC, ACTOR, DCS):
        register(source)


@hookimpl
def relax_register_rollout_shapes(register: Callable[[RolloutShapeSpec], None]) -> None:
    """Register ``single-turn`` (the default)."""
    register(
        RolloutShapeSpec(
            name="single-turn",
            build=build_single_turn,
            options=(),
            description="one completion per sample (samples_per_prompt per /generate request)",
        )
    )

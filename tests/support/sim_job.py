"""The simulated job the driver's tests run: :class:`~relax_core.run.loop.StepPorts` over the
simulated engines of :mod:`relax_bench._steps_sim` (a real coordinator, an in-process sink),
in a split layout or a defer layout where the judge takes turns with the policy."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from relax_bench._steps_sim import SimRollout, SimTrainer, Times, coordinator, handle

from relax_core.coordination import MemoryBatchSink, Stage
from relax_core.coordination.stages import RoleClients
from relax_core.run.config import RunConfig
from relax_core.run.loop import StepPorts


def sim_run(times: Times, mode: str = "sync", **options: Any) -> RunConfig:
    """The ``[run]`` settings of a simulated job of ``times``' groups and samples (30 s
    operation deadline); by default the first failed step ends the run
    (``max_failed_steps = 0``); ``options``: more settings."""
    return RunConfig(  # type: ignore[misc]
        mode=mode,
        prompts_per_step=times.groups,
        samples_per_prompt=times.samples_per_group,
        operation_timeout=30.0,
        **{"max_failed_steps": 0, **options},
    )


def sim_ports(
    name: str,
    run: Any,
    *,
    times: Times,
    rollout: SimRollout,
    stages: Sequence[Stage],
    defer: bool = False,
    trainer: type[SimTrainer] = SimTrainer,
    discards: bool | None = None,
    **trainer_options: Any,
) -> StepPorts:
    """The ports of ``run`` (a ``RunConfig``) on ``rollout`` with ``stages``; its trainer is a
    ``trainer(times, coordinator, sink, rollout, **trainer_options)``. ``defer``: the judge
    takes turns with the policy on one GPU (every switch issued), else a split layout.
    ``discards``: what the driver is told of rollout's offloads (default: what they do)."""
    deferred = ("judge",) if defer else ()
    coord = coordinator(deferred=deferred)
    sink = MemoryBatchSink()
    return StepPorts(
        name=name,
        run=run,
        coordinator=coord,
        rollout=handle(rollout=rollout),
        stages=stages,
        sink=sink,
        clients=RoleClients({}),
        producer=rollout.producer,
        trainer=trainer(times, coord, sink, rollout, **trainer_options),
        generation_role="policy",
        deferred_roles=deferred,
        switching=defer,
        discards=rollout.discards if discards is None else discards,
        free=not defer,
    )

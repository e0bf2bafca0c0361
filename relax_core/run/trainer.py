"""The trainer of ``relax run``: the interface a trainer plugin implements, how one is found
by name, and the Ray actor it runs in (``docs/run.md`` says how to write one)."""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any, Protocol, cast, runtime_checkable

import attrs

from relax_core._proxy import actor_error_line
from relax_core.errors import ConfigError, LifecycleError
from relax_core.records import NAME_PATTERN, TRAINER_METHODS
from relax_core.run.config import PUSH_BUCKET_BYTES, PUSH_FORMATS

if TYPE_CHECKING:
    from relax_core.plugins import PluginManager

#: The methods a trainer has when it can be checkpointed and resumed (see :class:`Trainer`).
CHECKPOINT_METHODS = ("save", "load")


@attrs.frozen
class TrainerContext:
    """Everything a trainer is built from (picklable); each field in ``docs/run.md`` ("The
    trainer"). ``push_pause`` ``None``: the fence."""

    job: str
    model_path: str
    coordinator: Any
    sink: Any
    rollout: Any
    device: str = "cpu"
    options: Any = None
    mode: str = "sync"
    fields: tuple[str, ...] = ()
    seed: int = 0
    push_format: str = "safetensors"
    micro_batch: int = 64
    commit_timeout: float = 3600.0
    push_pause: str | None = None
    push_bucket_bytes: int = PUSH_BUCKET_BYTES


@runtime_checkable
class Trainer(Protocol):
    """What ``relax run`` calls on a trainer, in its Ray actor; built ``cls(context)`` from a
    :class:`TrainerContext`. Both methods block, and the actor runs two calls at once (a
    ``train`` waiting for its commit while a ``push`` runs), so a trainer guards its model.

    Optional: ``measure_copy(sizes)`` (``--measure``: ``{bytes: {"h2d": s, "d2h": s}}``), and
    ``save(directory)`` / ``load(directory)`` for checkpoints (:func:`trainer_checkpoints`;
    ``save`` is called between steps, into an empty ``directory``, and returns a few JSON
    numbers; ``load`` once before a resumed run's first step)."""

    def train(self, batch_id: int) -> dict[str, Any]:
        """Wait for batch ``batch_id``'s commit, train on it, delete its partition; return
        what was measured. :raises BatchFailedError: the batch failed (train on nothing)."""
        ...

    def push(self, weight_version: str) -> dict[str, Any]:
        """Send the weights to the rollout engines as ``weight_version``; return at least
        ``{"weight_version": the version the manager published}``."""
        ...


def trainer_checkpoints(cls: type[Any]) -> bool:
    """Whether the trainer class ``cls`` has ``save`` and ``load`` (checkpoints)."""
    return all(callable(getattr(cls, m, None)) for m in CHECKPOINT_METHODS)


def load_trainer_class(name: str, pm: PluginManager | None = None) -> type[Trainer]:
    """The trainer class ``name`` says: a registered trainer's name (in ``pm``, default: the
    process-wide plugin manager) or ``package.module:Class``. Imports the class's module.

    :raises ConfigError: (``run.trainer``) no such trainer or class, or one without ``train``
        / ``push``."""
    if ":" not in name:
        return _registered(name, pm)
    module_name, _, attr = name.partition(":")
    try:
        module = importlib.import_module(module_name)
    except ImportError as exc:
        raise ConfigError("run.trainer", f"cannot import {module_name!r}: {exc}") from None
    cls = getattr(module, attr, None)
    if not isinstance(cls, type):
        raise ConfigError("run.trainer", f"{module_name!r} has no class {attr!r}")
    if missing := [m for m in TRAINER_METHODS if not callable(getattr(cls, m, None))]:
        raise ConfigError(
            "run.trainer",
            f"{name} has no {' and no '.join(missing)} method; a trainer implements "
            "train(batch_id) and push(weight_version) (docs/run.md#the-trainer)",
        )
    return cast("type[Trainer]", cls)


def _registered(name: str, pm: PluginManager | None) -> type[Trainer]:
    if pm is None:
        from relax_core.plugins import get_plugin_manager

        pm = get_plugin_manager()
    registered = pm.registered("trainers")
    if name in registered:
        return cast("type[Trainer]", registered[name].record.trainer_class)
    if not NAME_PATTERN.match(name):
        raise ConfigError(
            "run.trainer", f"{name!r} is neither a trainer's name nor 'package.module:ClassName'"
        )
    raise ConfigError(
        "run.trainer",
        f"no trainer named {name!r} is registered (registered: "
        f"{', '.join(sorted(registered)) or 'none'}); install the plugin that provides it, or "
        "give a class as 'package.module:ClassName'",
    )


def start_trainer(
    context: TrainerContext,
    *,
    trainer: str,
    pm: PluginManager | None = None,
    placement_group: Any = None,
    bundle_index: int = 0,
    num_gpus: float = 0.0,
    timeout: float = 300.0,
) -> Any:
    """Start the trainer ``trainer`` names in a Ray actor built from ``context`` (on
    ``placement_group``: ``num_gpus`` of bundle ``bundle_index``); its handle once it is
    constructed. Blocks.

    :raises ConfigError: as :func:`load_trainer_class`; a bad ``push_format`` or bucket size.
    :raises LifecycleError: the actor failed to construct (its error quoted)."""
    import ray
    from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

    cls = load_trainer_class(trainer, pm)
    if context.push_format not in PUSH_FORMATS:
        raise ConfigError("run.push_format", f"must be one of {PUSH_FORMATS}")
    bucket = context.push_bucket_bytes
    if isinstance(bucket, bool) or not isinstance(bucket, int) or bucket < 1:
        raise ConfigError("run.push_bucket_bytes", f"must be an integer >= 1, got {bucket!r}")
    # Two calls at once: train(N) waits for batch N's commit while push() of N - 1 runs.
    options: dict[str, Any] = {"num_cpus": 0, "num_gpus": num_gpus, "max_restarts": 0}
    options["max_concurrency"] = 2
    if placement_group is not None:
        options["scheduling_strategy"] = PlacementGroupSchedulingStrategy(
            placement_group=placement_group, placement_group_bundle_index=bundle_index
        )
    actor: Any = ray.remote(cls).options(**options).remote(context)
    try:
        ray.get(actor.__ray_ready__.remote(), timeout=timeout)
    except ray.exceptions.RayActorError as exc:
        raise LifecycleError(
            f"the trainer {trainer} did not start: {actor_error_line(exc)}"
        ) from None
    except ray.exceptions.GetTimeoutError:
        ray.kill(actor, no_restart=True)
        raise LifecycleError(
            f"the trainer {trainer} was not constructed within {timeout:g}s (loading its model)"
        ) from None
    return actor

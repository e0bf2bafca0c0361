"""The training consumer of ``relax run``: the interface a trainer implements, how one is
found by name, and the Ray actor it runs in. No torch: trainers are plugins.

A trainer is a class built from one :class:`TrainerContext` that implements :class:`Trainer`,
run in its own Ray actor (:func:`start_trainer`):

- ``train(batch_id) -> dict``: wait until batch ``batch_id`` is committed
  (``context.coordinator.wait_committed``; a failed batch raises
  :class:`~relax_core.errors.BatchFailedError`), read its partition from the batch sink
  (``context.sink.get(receipt.partition)``) with every scored field, take an optimizer step,
  delete the partition, and return what it measured (the numbers ``relax run`` prints);
- ``push(weight_version) -> dict``: send the current weights to the rollout engines through
  the generation model's manager (``context.rollout``, a manager actor:
  ``update_weights_from_tensor`` or ``update_weights_from_distributed`` on the ACTOR path,
  behind the manager's fence, in buckets of ``push_bucket_bytes`` carried by one manager
  call), so the published weight version becomes ``weight_version``.

The step driver asks for ``train(N)`` once batch ``N`` committed (it still waits for the
commit: the gate), then ``push`` of the weights trained on it, before the step that needs them
is generated; the actor runs two calls at once (``--measure``'s copies, a push beside a
``train``), so a trainer guards its model accordingly.

``[run] trainer`` names the class (:func:`load_trainer_class`): the name of a trainer a plugin
registers through ``relax_register_trainers`` (a :class:`~relax_core.records.TrainerSpec`;
without ``trainer``, the one trainer installed), or ``package.module:Class`` for a class
nobody registered. ``docs/run.md`` says how to write one.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any, Protocol, cast, runtime_checkable

import attrs

from relax_core.errors import ConfigError, LifecycleError
from relax_core.records import NAME_PATTERN, TRAINER_METHODS
from relax_core.run.config import PUSH_BUCKET_BYTES, PUSH_FORMATS

if TYPE_CHECKING:
    from relax_core.plugins import PluginManager

__all__ = [
    "CHECKPOINT_METHODS",
    "Trainer",
    "TrainerContext",
    "load_trainer_class",
    "start_trainer",
    "trainer_checkpoints",
]

#: The methods a trainer has when it can be checkpointed and resumed (see :class:`Trainer`).
CHECKPOINT_METHODS = ("save", "load")


@attrs.frozen
class TrainerContext:
    """Everything a trainer is built from (picklable: it travels to the trainer's actor).

    ``coordinator`` is the job's :class:`~relax_core.coordination.RemoteCoordinator`,
    ``sink`` its :class:`~relax_core.coordination.RayBatchSink`, ``rollout`` the manager actor
    of the generation model (weights are pushed through it). ``fields`` names every sample
    field the step's stages write (``reward``, ``rewards``, ``teacher_logprobs``, a plugin's
    own…): each committed sample carries them in ``sample.fields``; a trainer picks its terms
    from them (the reference trainer distils on the teacher's top-k when
    ``teacher_topk_logprobs`` is there). ``commit_timeout`` bounds one ``wait_committed``.
    ``options``: the trainer's options (an instance of its
    :attr:`~relax_core.records.TrainerSpec.options` record, read from ``[run]``; ``None``
    without one). ``mode``: the run's mode (``sync`` or ``async``).
    ``push_pause``: the pause mode a push passes to the manager's update
    (``update_weights_from_tensor(..., pause=...)``; ``None``: the fence).
    ``push_bucket_bytes``: the size of one bucket of a push (``[run] push_bucket_bytes``;
    :func:`~relax_core.engine.buckets.plan_weight_buckets`).
    """

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
    """What ``relax run`` calls on a trainer, in the trainer's Ray actor (see the module
    docstring). The class is built ``cls(context)`` from a :class:`TrainerContext`; both
    methods block, and the actor runs two calls at once (a ``train`` waiting for its commit
    while a ``push`` runs), so a trainer guards its model between them.

    ``relax run --measure`` also calls ``measure_copy(sizes)`` (the seconds of one host→device
    and device→host copy of each byte count on the trainer's device: ``{bytes: {"h2d": s,
    "d2h": s}}``); only a trainer that has it can run with ``--measure``.

    Checkpoints (``[run] checkpoint_every``, ``relax run --resume``) call two more, which a
    trainer that can be resumed has (:func:`trainer_checkpoints`): ``save(directory) ->
    dict``, called between steps (no ``train`` or ``push`` in flight), writes everything the
    trainer needs to go on (weights, optimizer state, its step count, its RNG) under
    ``directory`` (it exists and is empty) and returns a few JSON numbers to keep beside it;
    ``load(directory) -> dict``, called once before the first step of a resumed run, reads
    it back. A trainer without them runs without checkpoints.
    """

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
    """The trainer class ``name`` says: a registered trainer's name (``grpo``), looked up in
    ``pm`` (default: the process-wide plugin manager), or ``package.module:Class``.

    Pure apart from importing the class's module (never torch: a registered trainer's module
    is the plugin's, already imported; a dotted path's module is the caller's choice).

    :raises ConfigError: (``run.trainer``) no trainer of that name is registered (the message
        lists those that are), the module cannot be imported or has no such class, or the
        class lacks ``train`` / ``push``.
    """
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
    missing = [m for m in TRAINER_METHODS if not callable(getattr(cls, m, None))]
    if missing:
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
            "run.trainer",
            f"{name!r} is neither a trainer's name nor 'package.module:ClassName'",
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
    """Start the trainer ``trainer`` names (a registered trainer in ``pm``, default the
    process-wide plugin manager, or ``package.module:Class``) in a Ray actor built from
    ``context``; return its handle once it is constructed (its model loaded). Blocks.

    On a placement group the actor takes ``num_gpus`` of bundle ``bundle_index`` (the training
    share of a pool shared with inference), so it sees that bundle's GPU.

    :raises ConfigError: see :func:`load_trainer_class`; a bad ``push_format`` or
        ``push_bucket_bytes``.
    :raises LifecycleError: the actor failed to construct (its error quoted).
    """
    import ray
    from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

    cls = load_trainer_class(trainer, pm)
    if context.push_format not in PUSH_FORMATS:
        raise ConfigError("run.push_format", f"must be one of {PUSH_FORMATS}")
    bucket = context.push_bucket_bytes
    if isinstance(bucket, bool) or not isinstance(bucket, int) or bucket < 1:
        raise ConfigError("run.push_bucket_bytes", f"must be an integer >= 1, got {bucket!r}")
    # Two calls at once: train(N) waits for batch N's commit while push() of the weights of
    # N - 1 runs (the run pushes before it generates batch N).
    options: dict[str, Any] = {
        "num_cpus": 0,
        "num_gpus": num_gpus,
        "max_restarts": 0,
        "max_concurrency": 2,
    }
    if placement_group is not None:
        options["scheduling_strategy"] = PlacementGroupSchedulingStrategy(
            placement_group=placement_group, placement_group_bundle_index=bundle_index
        )
    actor: Any = ray.remote(cls).options(**options).remote(context)
    try:
        ray.get(actor.__ray_ready__.remote(), timeout=timeout)
    except ray.exceptions.RayActorError as exc:
        # The creation task's own error is the text's last line.
        lines = [line.strip() for line in str(exc).splitlines() if line.strip()]
        raise LifecycleError(
            f"the trainer {trainer} did not start: {lines[-1] if lines else exc}"
        ) from None
    except ray.exceptions.GetTimeoutError:
        ray.kill(actor, no_restart=True)
        raise LifecycleError(
            f"the trainer {trainer} was not constructed within {timeout:g}s (loading its model)"
        ) from None
    return actor

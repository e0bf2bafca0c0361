"""The manager's inputs (launch settings, placement, timeouts) and its engine slots.

An *engine slot* is one worker of one logical replica: a Ray actor on one placement-group
bundle, or nothing once its shutdown is confirmed. A replica has as many slots as it spans
nodes — scale-out creates all of them, and cleanup tracks each one, so a partially cleaned
replica keeps exactly the slots that still hold something.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import attrs

from relax_core.manager.state import Replica

__all__ = ["ManagerTimeouts", "ModelLaunch", "ReplicaPlacement", "ReplicaSlot", "WorkerSlot"]


def _positive(instance: object, attribute: attrs.Attribute[Any], value: float) -> None:
    if not value > 0:
        raise ValueError(f"{type(instance).__name__}.{attribute.name}={value!r}: must be > 0")


@attrs.frozen
class ModelLaunch:
    """How to launch one model's engines (the backend turns it into an ``EngineLaunchSpec``).

    :param model_path: the checkpoint directory (for DCS: ignored when a checkpoint version
        exists; the newest ``version-N/`` is loaded).
    :param nodes_per_replica: workers per logical replica (head + followers).
    :param served_model_name: the name the engine answers with (default: ``model_path``).
    :param options: the model's settings only some backends read, passed on as
        ``EngineLaunchSpec.options``.
    """

    model_path: str
    served_model_name: str | None = None
    nodes_per_replica: int = attrs.field(default=1, validator=_positive)
    tp: int = attrs.field(default=1, validator=_positive)
    pp: int = attrs.field(default=1, validator=_positive)
    device: str = "cpu"
    dtype: str = "auto"
    seed: int | None = None
    engine_host: str = "127.0.0.1"
    public_host: str | None = None
    log_dir: str | None = None
    extra_args: tuple[str, ...] = attrs.field(default=(), converter=tuple)
    env: Mapping[str, str] = attrs.field(factory=dict)
    options: Mapping[str, Any] = attrs.field(factory=dict)


@attrs.frozen
class ManagerTimeouts:
    """Deadlines (seconds) of each lifecycle step; ``rpc_margin`` is added on the manager side."""

    start: float = attrs.field(default=180.0, validator=_positive)
    offload: float = attrs.field(default=60.0, validator=_positive)
    onload: float = attrs.field(default=60.0, validator=_positive)
    drain: float = attrs.field(default=30.0, validator=_positive)
    update: float = attrs.field(default=300.0, validator=_positive)
    health: float = attrs.field(default=15.0, validator=_positive)
    shutdown: float = attrs.field(default=30.0, validator=_positive)
    rpc_margin: float = attrs.field(default=5.0, validator=_positive)


def _workers(value: Sequence[Sequence[Sequence[int]]]) -> tuple[tuple[tuple[int, ...], ...], ...]:
    return tuple(tuple(tuple(int(b) for b in node) for node in replica) for replica in value)


@attrs.frozen
class ReplicaPlacement:
    """Where a model's workers go: ``workers[replica][node]`` are the bundle indices of one
    worker (it is scheduled on the first one), as in the placement plan's ``ModelPlacement``.

    ``owned``: the manager created the placement group and removes it at shutdown; a
    borrowed one (owned by a controller or another service) is never removed.
    ``placement_group`` may be ``None`` for CPU models (workers then use no bundle).
    """

    placement_group: Any
    workers: tuple[tuple[tuple[int, ...], ...], ...] = attrs.field(converter=_workers)
    ray_gpu_fraction: float = 0.0
    owned: bool = False

    def __attrs_post_init__(self) -> None:
        if not self.workers:
            raise ValueError("ReplicaPlacement.workers: give at least one replica")
        nodes = {len(r) for r in self.workers}
        if len(nodes) != 1 or 0 in nodes:
            raise ValueError(
                f"ReplicaPlacement.workers: every replica needs the same, non-zero number of "
                f"nodes; got {[len(r) for r in self.workers]}"
            )
        if self.placement_group is None and any(b for r in self.workers for b in r):
            raise ValueError(
                "ReplicaPlacement.workers name bundles but placement_group is None; pass the "
                "placement group the bundles belong to"
            )

    @property
    def nodes_per_replica(self) -> int:
        """Workers per logical replica."""
        return len(self.workers[0])

    @classmethod
    def from_plan(cls, model: Any, placement_group: Any, *, owned: bool) -> ReplicaPlacement:
        """From the placement plan's ``ModelPlacement`` (its ``workers`` and GPU fraction)."""
        return cls(
            placement_group=placement_group if model.pool is not None else None,
            workers=model.workers,
            ray_gpu_fraction=float(model.ray_gpu_fraction),
            owned=owned,
        )

    @classmethod
    def from_bound(
        cls, pool: Any, role: str, model: str, *, ray_gpu_fraction: float = 1.0
    ) -> ReplicaPlacement:
        """From a validated ``BoundPool`` (``bind_placement_group``): each worker on its
        physical bundles. The pool's group is *borrowed*: the pool's owner releases it
        (``release_bound_pool``), never a manager.
        """
        bound = pool.model(role, model)
        return cls(
            placement_group=pool.placement_group,
            workers=tuple(tuple(w.bundles for w in replica) for replica in bound.replicas),
            ray_gpu_fraction=ray_gpu_fraction,
            owned=False,
        )

    @classmethod
    def unplaced(cls, replicas: int, nodes_per_replica: int = 1) -> ReplicaPlacement:
        """CPU workers outside any placement group (``replicas`` times ``nodes_per_replica``)."""
        return cls(None, tuple(((),) * nodes_per_replica for _ in range(replicas)))


@attrs.define
class WorkerSlot:
    """One worker of a replica. ``actor`` is ``None`` once its cleanup is confirmed.

    ``fenced``: the actor died without confirmed cleanup of its engine process; the slot, its
    pending record and the placement group stay until an operator confirms the node is clean.
    ``pending``: why the last cleanup step is not confirmed (retry it).
    """

    node_rank: int
    bundles: tuple[int, ...]
    actor: Any = None
    engine_pid: int | None = None
    node_ip: str | None = None
    node_id: str | None = None
    fenced: bool = False
    pending: str | None = None

    @property
    def bundle(self) -> int | None:
        """The bundle the worker's actor is scheduled on (``None`` outside a placement group)."""
        return self.bundles[0] if self.bundles else None

    @property
    def holds_resources(self) -> bool:
        """Whether anything may still run for this slot."""
        return self.actor is not None or self.fenced


@attrs.define
class ReplicaSlot:
    """A logical replica and its worker slots (head first)."""

    replica: Replica
    workers: list[WorkerSlot]
    placement_group: Any = None
    #: chosen by scale-in: cleaned up and removed, never rebuilt
    retiring: bool = False

    @property
    def head(self) -> WorkerSlot:
        """Node rank 0."""
        return self.workers[0]

    @property
    def engine_id(self) -> str:
        """The replica's engine id."""
        return self.replica.engine_id

    @property
    def fenced(self) -> bool:
        """Any worker fenced."""
        return any(w.fenced for w in self.workers)

    @property
    def cleaned(self) -> bool:
        """Every worker's cleanup confirmed (nothing of the replica runs any more)."""
        return not any(w.holds_resources for w in self.workers)

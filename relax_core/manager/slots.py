"""The manager's inputs (launch settings, placement, timeouts) and its engine slots: one
:class:`WorkerSlot` per node of a replica, held by the model's :class:`SlotTable`, which knows
the *fenced* workers (their actor died without confirmed cleanup)."""

from __future__ import annotations

import time
from collections.abc import Iterable, Mapping, Sequence
from typing import TYPE_CHECKING, Any

import attrs

from relax_core.errors import InferenceRecoveryRequired
from relax_core.manager.results import LifecycleResult, Outcome, ReplicaResult, UnconfirmedWorker
from relax_core.manager.state import Replica, ReplicaState
from relax_core.records import EngineOptions

if TYPE_CHECKING:
    from relax_core.manager.channel import ControlAddress
    from relax_core.manager.fanout import CallOutcome


def _positive(instance: object, attribute: attrs.Attribute[Any], value: float) -> None:
    if not value > 0:
        raise ValueError(f"{type(instance).__name__}.{attribute.name}={value!r}: must be > 0")


@attrs.frozen
class ModelLaunch:
    """How to launch one model's engines (the backend turns it into an ``EngineLaunchSpec``).

    :param model_path: the checkpoint directory (DCS: the newest ``version-N/`` instead).
    :param nodes_per_replica: workers per logical replica (head + followers).
    :param served_model_name: the name the engine answers with (default: ``model_path``).
    :param options: the model's engine options (``weights_cpu_backup`` as the spec decides).
    :param backend_options: an instance of the backend's own options record, or ``None``."""

    model_path: str
    served_model_name: str | None = None
    nodes_per_replica: int = attrs.field(default=1, validator=_positive)
    tp: int = attrs.field(default=1, validator=_positive)
    pp: int = attrs.field(default=1, validator=_positive)
    device: str = "cpu"
    seed: int | None = None
    engine_host: str = "127.0.0.1"
    public_host: str | None = None
    log_dir: str | None = None
    options: EngineOptions = attrs.field(
        factory=EngineOptions, validator=attrs.validators.instance_of(EngineOptions)
    )
    backend_options: object | None = None


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
    worker (scheduled on the first). ``owned``: the manager removes the group at shutdown.
    ``placement_group`` may be ``None`` for CPU models."""

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
    def from_bound(
        cls, pool: Any, role: str, model: str, *, ray_gpu_fraction: float = 1.0
    ) -> ReplicaPlacement:
        """From a validated ``BoundPool``: each worker on its physical bundles; the group is
        borrowed (its owner releases it)."""
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
    """One worker of a replica. ``actor`` is ``None`` once its cleanup is confirmed;
    ``fenced``: it died without that; ``pending``: why the last cleanup step is not confirmed;
    ``control``: a started head's private control endpoint (forgotten with ``actor``)."""

    node_rank: int
    bundles: tuple[int, ...]
    actor: Any = None
    engine_pid: int | None = None
    node_ip: str | None = None
    node_id: str | None = None
    fenced: bool = False
    pending: str | None = None
    control: ControlAddress | None = None

    @property
    def bundle(self) -> int | None:
        """The bundle the worker's actor is scheduled on (``None`` outside a placement group)."""
        return self.bundles[0] if self.bundles else None

    def attach(self, actor: Any) -> None:
        """A new worker actor takes the slot; nothing of the previous one is kept."""
        self.actor = actor
        self.engine_pid = None
        self.pending = None
        self.control = None

    def detach(self) -> None:
        """The actor is gone and its engine process confirmed gone: the slot is empty again."""
        self.attach(None)
        self.fenced = False

    def fence(self) -> None:
        """The actor died without confirmed cleanup of its engine process: keep everything."""
        self.fenced = True
        self.pending = "actor died without confirmed cleanup of its engine process"


@attrs.define
class ReplicaSlot:
    """A logical replica and its worker slots (head first)."""

    replica: Replica
    workers: list[WorkerSlot]
    placement_group: Any = None
    #: chosen by scale-in: cleaned up and removed, never rebuilt
    retiring: bool = False
    #: consecutive failed health probes of a live replica (reset by a healthy one, a rebuild)
    failed_probes: int = 0

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
        return not any(w.actor is not None or w.fenced for w in self.workers)

    @property
    def pending(self) -> list[str]:
        """Why each worker's last cleanup step is not confirmed (head first)."""
        return [w.pending for w in self.workers if w.pending]

    @property
    def live_head(self) -> Any:
        """The head's actor when one runs and is not fenced, else ``None``."""
        head = self.head
        return head.actor if head.actor is not None and not head.fenced else None

    def result(
        self,
        outcome: Outcome,
        *,
        tags: tuple[str, ...] = (),
        error: str | None = None,
        seconds: float = 0.0,
        timings: Mapping[str, float] | None = None,
    ) -> ReplicaResult:
        """This replica's result of a call, with the state it is in now."""
        state = str(self.replica.state)
        return ReplicaResult(self.engine_id, outcome, state, tags, error, seconds, timings or {})

    def worker_name(self, worker: WorkerSlot) -> str:
        """``model/replica-i`` for the head, ``model/replica-i/node-r`` for a follower."""
        if worker.node_rank == 0:
            return self.engine_id
        return f"{self.engine_id}/node-{worker.node_rank}"

    def fail(self, worker: WorkerSlot, outcome: CallOutcome, during: str) -> str:
        """Record a step of ``worker`` that was not confirmed (a dead actor fenced, the
        replica FAILED); return the message."""
        message = f"{during} of {self.worker_name(worker)}: {outcome.describe()}"
        if outcome.actor_died:
            worker.fence()
            message += " (actor died; engine process not confirmed gone: fenced)"
        self.mark_failed(message)
        return message

    def mark_failed(self, message: str) -> None:
        """FAILED (unless already FAILED or STOPPING); the head is told to close admission
        (best effort, not waited for)."""
        rep = self.replica
        if rep.state is not ReplicaState.FAILED and rep.state is not ReplicaState.STOPPING:
            rep.advance(ReplicaState.FAILED, error=message)
        rep.weights_valid = rep.weights_valid and rep.state is not ReplicaState.FAILED
        if self.live_head is not None:
            self.live_head.close_admission.remote("FAILED")


@attrs.define
class SlotTable:
    """The replica slots of one model, by index, and the fences among them. Not thread-safe
    (the manager's lock is held)."""

    model_id: str
    _slots: dict[int, ReplicaSlot] = attrs.field(factory=dict, init=False)
    _next_index: int = attrs.field(default=0, init=False)

    def __len__(self) -> int:
        return len(self._slots)

    def ordered(self) -> list[ReplicaSlot]:
        """Every slot, by replica index."""
        return [self._slots[i] for i in sorted(self._slots)]

    def at(self, index: int) -> ReplicaSlot:
        """The slot of replica ``index``."""
        return self._slots[index]

    def get(self, engine_id: str) -> ReplicaSlot:
        """The slot of ``engine_id``. :raises KeyError: no such replica."""
        for slot in self._slots.values():
            if slot.engine_id == engine_id:
                return slot
        raise KeyError(
            f"model {self.model_id!r} has no replica {engine_id!r}; it has "
            f"{[s.engine_id for s in self.ordered()]}"
        )

    def select(self, engine_ids: Iterable[str] | None) -> list[ReplicaSlot]:
        """The slots of ``engine_ids`` (each once, in order; ``None``: every slot).
        :raises KeyError: an unknown engine id."""
        if engine_ids is None:
            return self.ordered()
        if isinstance(engine_ids, str):
            engine_ids = (engine_ids,)
        return [self.get(e) for e in dict.fromkeys(engine_ids)]

    def add(self, workers: Sequence[Sequence[Sequence[int]]], group: Any) -> list[ReplicaSlot]:
        """New replicas, one slot per node: ``workers[replica][node]`` are bundle indices."""
        added = []
        for nodes in workers:
            index = self._next_index
            self._next_index += 1
            replica = Replica(index=index, engine_id=f"{self.model_id}/replica-{index}")
            slot = ReplicaSlot(
                replica=replica,
                workers=[WorkerSlot(node_rank=r, bundles=tuple(b)) for r, b in enumerate(nodes)],
                placement_group=group,
            )
            self._slots[index] = slot
            added.append(slot)
        return added

    def remove(self, slot: ReplicaSlot) -> None:
        """Forget a replica whose cleanup is confirmed (scale-in)."""
        del self._slots[slot.replica.index]

    def bundle_users(self) -> dict[tuple[str | None, int], str]:
        """``(placement group id, bundle)`` -> the engine id of the replica using it."""
        return {
            (_group_id(s.placement_group), b): s.engine_id
            for s in self._slots.values()
            for w in s.workers
            for b in w.bundles
        }

    def fenced_workers(self) -> list[str]:
        """The names of every fenced worker (see :class:`WorkerSlot`)."""
        return [s.worker_name(w) for s in self.ordered() for w in s.workers if w.fenced]

    def unconfirmed(self) -> list[UnconfirmedWorker]:
        """Every worker that may still hold something: fenced, or its shutdown pending."""
        return [
            UnconfirmedWorker(
                model_id=self.model_id,
                worker=s.worker_name(w),
                fenced=w.fenced,
                reason=w.pending or "cleanup not confirmed",
                placement_group_id=_group_id(s.placement_group),
                bundles=w.bundles,
                node_ip=w.node_ip,
                node_id=w.node_id,
                engine_pid=w.engine_pid,
            )
            for s in self.ordered()
            for w in s.workers
            if w.fenced or (w.actor is not None and w.pending)
        ]

    def fence_message(self, what: str) -> str:
        """What an :class:`InferenceRecoveryRequired` says: every fenced worker, what to do."""
        return (
            f"model {self.model_id!r}: {what}: engine worker actor(s) {self.fenced_workers()} "
            "died without confirmed cleanup of their engine processes; their slots, pending "
            "records and placement group are kept and nothing is rebuilt. Confirm on the node "
            "(or container) that the engine processes are gone, then call "
            "confirm_external_cleanup(), or start a new job"
        )

    def settle(self, what: str, result: LifecycleResult) -> LifecycleResult:
        """``result``. :raises InferenceRecoveryRequired: the call left a worker fenced."""
        if self.fenced_workers():
            raise InferenceRecoveryRequired(self.fence_message(what), result=result)
        return result

    def result(
        self, operation: str, results: Mapping[str, ReplicaResult], begin: float
    ) -> LifecycleResult:
        """The call's :class:`LifecycleResult`: replicas by index, then any no longer here."""
        order = [s.engine_id for s in self.ordered()]
        ordered_results = [results[e] for e in order if e in results]
        ordered_results += [r for e, r in results.items() if e not in order]
        return LifecycleResult(
            operation, self.model_id, tuple(ordered_results), time.monotonic() - begin
        )


def _group_id(group: Any) -> str | None:
    return group.id.hex() if group is not None else None

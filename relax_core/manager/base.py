"""The core of InferenceManager: state, slots, publishing, fences and start.

One manager per model. It owns the model's engine slots (one Ray actor per node of each
logical replica, on the placement plan's bundles), starts and initialises them in parallel,
tracks each replica's state and resident tags, onloads and offloads them with per-replica
results, applies weight updates behind a fence, checks health, cleans up and rebuilds failed
replicas, scales out and in, publishes the model's schema-2 view (heads only), and shuts
everything down in order (workers, then actors, then owned placement groups).

Threading: every public method is blocking and takes the manager's lock, so lifecycle calls
never interleave. Each step fans out to all replicas at once (:func:`~.fanout.gather`), so N
replicas take as long as the slowest one.

Fail-stop: a worker actor that died without confirmed cleanup of its engine process is
*fenced*: its slot, pending record and placement group are kept, nothing is rebuilt, and every
lifecycle call raises :class:`~relax_core.errors.InferenceRecoveryRequired` until an operator
confirms the node is clean (:meth:`InferenceManager.confirm_external_cleanup`).
"""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Iterable, Sequence
from typing import Any

import attrs

from relax_core.engine.spec import InferenceEngineSpec
from relax_core.errors import InferenceRecoveryRequired, LifecycleError
from relax_core.manager.channel import ChannelError, ControlAddress, call_many
from relax_core.manager.fanout import CallOutcome, gather
from relax_core.manager.results import (
    LifecycleResult,
    Outcome,
    ReplicaResult,
)
from relax_core.manager.slots import (
    ManagerTimeouts,
    ModelLaunch,
    ReplicaPlacement,
    ReplicaSlot,
    WorkerSlot,
)
from relax_core.manager.state import (
    ALL_TAGS,
    Replica,
    ReplicaState,
)
from relax_core.manager.weights import CheckpointDirectory
from relax_core.manager.worker import EngineWorker
from relax_core.records import EngineBackend, EngineLaunchSpec, RouterMembership

__all__ = ["ManagerBase", "with_result"]

_S = ReplicaState
# Model state from replica states: the first state in this order that any replica is in.
_MODEL_STATE_ORDER = (_S.READY, _S.ONLOADING, _S.DRAINING, _S.STARTING, _S.SLEEPING, _S.STOPPING)
# Replica states whose head stays registered with the model's router (admission answers 503
# while it is not READY); STARTING, STOPPING and FAILED heads are never routed to.
_ROUTED = frozenset({_S.READY, _S.DRAINING, _S.SLEEPING, _S.ONLOADING})
_REMOTE_WORKER: Any = None


def _remote_worker() -> Any:
    global _REMOTE_WORKER
    if _REMOTE_WORKER is None:
        import ray

        _REMOTE_WORKER = ray.remote(EngineWorker)
    return _REMOTE_WORKER


class ManagerBase:
    """State, slots, publishing and start of :class:`~relax_core.manager.InferenceManager`.

    :param model_id: the model's id in its role (``math``, ``judge``); engine ids are
        ``{model_id}/replica-{i}``.
    :param spec: what the engines may do (role, weight source, operations, strict drain).
    :param backend: the engine backend record (``plugin_manager.engine_backend("hf")``).
    :param launch: how to launch the engines.
    :param placement: the placement group and bundles of every replica's workers.
    :param publisher: where the model's schema-2 view goes (a
        :class:`~relax_core.discovery.publisher.RegistryPublisher`); ``None`` publishes nothing.
    :param route_mode: ``DIRECT`` or ``SGLANG_ROUTER`` (then give ``router_url``).
    :param router: the router in front of the heads (``SGLANG_ROUTER``): every publish tells it
        the heads to route to (:class:`~relax_core.records.RouterMembership`), so a head is
        registered once READY and removed before its engine stops or its replica is FAILED.
        A router process is not serialisable: a manager with one lives where the router runs.
    :param control_channel: send onload/offload to each head's private control endpoint over
        HTTP (default; a few ms per operation); ``False`` sends them as Ray actor calls (for
        networks where the manager cannot reach the worker nodes' ports).
    :raises ValueError: the inputs disagree (nodes per replica, device, multi-node support).
    """

    def __init__(
        self,
        model_id: str,
        *,
        spec: InferenceEngineSpec,
        backend: EngineBackend,
        launch: ModelLaunch,
        placement: ReplicaPlacement,
        publisher: Any = None,
        route_mode: str = "DIRECT",
        router_url: str | None = None,
        router: RouterMembership | None = None,
        timeouts: ManagerTimeouts | None = None,
        retry_after: float = 1.0,
        control_channel: bool = True,
    ) -> None:
        if launch.nodes_per_replica != placement.nodes_per_replica:
            raise ValueError(
                f"model {model_id!r}: launch.nodes_per_replica={launch.nodes_per_replica} but the "
                f"placement gives each replica {placement.nodes_per_replica} worker group(s); "
                "they must agree"
            )
        if launch.nodes_per_replica > 1 and not backend.multi_node:
            raise ValueError(
                f"model {model_id!r}: engine backend {backend.name!r} does not support multi-node "
                f"replicas (nodes_per_replica={launch.nodes_per_replica})"
            )
        if launch.device not in backend.devices:
            raise ValueError(
                f"model {model_id!r}: launch.device={launch.device!r}; engine backend "
                f"{backend.name!r} runs on {sorted(backend.devices)}"
            )
        self.model_id = model_id
        self.spec = spec
        self.backend = backend
        self.launch = launch
        self.placement = placement
        self.publisher = publisher
        self.route_mode = route_mode
        self.router_url = router_url
        self.router = router
        self.timeouts = timeouts or ManagerTimeouts()
        self.retry_after = retry_after
        self.control_channel = control_channel
        self._lock = threading.RLock()
        self._slots: dict[int, ReplicaSlot] = {}
        self._next_index = 0
        self._weight_version: str | None = None
        # Placement groups this manager uses: id -> (group, owned).
        self._groups: dict[str, tuple[Any, bool]] = {}
        self._pending_groups: dict[str, str] = {}
        self._closed = False
        # Engine id -> the generation last published for it.
        self._published: dict[str, int] = {}
        # Replica index -> (head actor, its private control endpoint); used only while that
        # actor is still the replica's head.
        self._control: dict[int, tuple[Any, ControlAddress]] = {}
        self._add_slots(placement.workers, placement.placement_group, owned=placement.owned)

    # -- queries -------------------------------------------------------------------------

    @property
    def weight_version(self) -> str | None:
        """The published weight version (``None`` for sources that publish none)."""
        return self._weight_version if self.spec.publishes_version else None

    def replicas(self) -> list[Replica]:
        """The replica records, by index (copies; mutate nothing)."""
        with self._lock:
            return [
                attrs.evolve(s.replica, history=list(s.replica.history)) for s in self._ordered()
            ]

    def states(self) -> dict[str, str]:
        """Engine id -> replica state."""
        with self._lock:
            return {s.engine_id: str(s.replica.state) for s in self._ordered()}

    def workers(self, engine_id: str) -> list[WorkerSlot]:
        """The worker slots of one replica (head first)."""
        with self._lock:
            return list(self._slot(engine_id).workers)

    def engine_pids(self) -> dict[str, list[int | None]]:
        """Engine id -> the engine process id of each worker (head first)."""
        with self._lock:
            return {s.engine_id: [w.engine_pid for w in s.workers] for s in self._ordered()}

    def launch_specs(self, *, dist_init_addr: str = "192.0.2.1:29500") -> dict[str, list[Any]]:
        """Engine id -> the ``EngineLaunchSpec`` of each of its workers (head first), as
        :meth:`start` would give them now; starts nothing (for dry runs and checks).

        A multi-node replica's workers join ``dist_init_addr``: at start it is the head
        worker's own address, known only then.
        """
        dist = dist_init_addr if self.launch.nodes_per_replica > 1 else None
        with self._lock:
            return {
                s.engine_id: [self._launch_spec(s, w, dist) for w in s.workers]
                for s in self._ordered()
            }

    def admission_states(self) -> dict[str, dict[str, Any]]:
        """Engine id -> ``{"open": bool, "inflight": int}`` of each started replica's head.

        Asked of every head at once, over the same transport as onload/offload; a head that
        did not answer maps to ``{"error": "..."}``.
        """
        with self._lock:
            heads: dict[int, dict[str, Any]] = {
                s.replica.index: {}
                for s in self._ordered()
                if s.head.actor is not None and not s.head.fenced
            }
            outs = self._call_heads("admission_state", heads, self.timeouts.health)
            return {
                self._slots[i].engine_id: dict(out.value) if out.ok else {"error": out.describe()}
                for i, out in outs.items()
            }

    def model_view(self) -> Any:
        """The model's schema-2 :class:`~relax_core.discovery.schema.ModelView` (heads only)."""
        from relax_core.discovery.schema import EngineView, ModelState, ModelView

        with self._lock:
            engines = []
            states = set()
            for slot in self._ordered():
                rep = slot.replica
                states.add(rep.state)
                if rep.base_url is None:
                    continue
                engines.append(
                    EngineView(
                        engine_id=rep.engine_id,
                        # A FAILED head never publishes its URL.
                        base_url=None if rep.state is _S.FAILED else rep.base_url,
                        state=str(rep.state),
                        direct_eligible=rep.direct_eligible,
                        generation=rep.generation,
                    )
                )
            state = next((str(s) for s in _MODEL_STATE_ORDER if s in states), None)
            if state is None:
                state = str(ModelState.FAILED if states else ModelState.STOPPING)
            return ModelView(
                state=state,
                route_mode=self.route_mode,
                router_url=self.router_url,
                weight_source=self.spec.weight_source.name,
                weight_version=self.weight_version,
                served_model_name=self.launch.served_model_name or self.launch.model_path,
                engines=tuple(engines),
            )

    # -- slots -----------------------------------------------------------------------------

    def _ordered(self) -> list[ReplicaSlot]:
        return [self._slots[i] for i in sorted(self._slots)]

    def _select(self, engine_ids: Iterable[str] | None) -> list[ReplicaSlot]:
        if engine_ids is None:
            return self._ordered()
        if isinstance(engine_ids, str):
            engine_ids = (engine_ids,)
        return [self._slot(e) for e in dict.fromkeys(engine_ids)]

    def _slot(self, engine_id: str) -> ReplicaSlot:
        for slot in self._slots.values():
            if slot.engine_id == engine_id:
                return slot
        raise KeyError(
            f"model {self.model_id!r} has no replica {engine_id!r}; it has "
            f"{[s.engine_id for s in self._ordered()]}"
        )

    def _add_slots(
        self, workers: Sequence[Sequence[Sequence[int]]], group: Any, *, owned: bool
    ) -> list[ReplicaSlot]:
        if group is not None:
            self._groups.setdefault(group.id.hex(), (group, owned))
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

    def _worker_name(self, slot: ReplicaSlot, worker: WorkerSlot) -> str:
        return (
            slot.engine_id if worker.node_rank == 0 else f"{slot.engine_id}/node-{worker.node_rank}"
        )

    def _create_actor(self, slot: ReplicaSlot, worker: WorkerSlot) -> None:
        options: dict[str, Any] = {"num_cpus": 0, "max_restarts": 0}
        if slot.placement_group is not None and worker.bundle is not None:
            from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

            options["num_gpus"] = self.placement.ray_gpu_fraction
            options["scheduling_strategy"] = PlacementGroupSchedulingStrategy(
                placement_group=slot.placement_group,
                placement_group_bundle_index=worker.bundle,
                placement_group_capture_child_tasks=False,
            )
        worker.actor = (
            _remote_worker()
            .options(**options)
            .remote(
                engine_id=slot.engine_id,
                node_rank=worker.node_rank,
                backend=self.backend,
                spec=self.spec,
                public_host=self.launch.public_host,
                retry_after=self.retry_after,
            )
        )
        worker.engine_pid = None
        worker.pending = None

    def _launch_spec(
        self, slot: ReplicaSlot, worker: WorkerSlot, dist: str | None
    ) -> EngineLaunchSpec:
        launch = self.launch
        model_path, version = launch.model_path, self._weight_version
        if self.spec.needs_checkpoint_dir:
            ckpt = CheckpointDirectory(self.spec.checkpoint_dir or "")
            latest = ckpt.latest()
            if latest is not None:
                model_path, version = ckpt.path(latest), str(latest)
        log_path = None
        if launch.log_dir:
            safe = self._worker_name(slot, worker).replace("/", "_")
            log_path = os.path.join(launch.log_dir, f"{safe}-gen{slot.replica.generation + 1}.log")
        return EngineLaunchSpec(
            engine_id=self._worker_name(slot, worker),
            model_path=model_path,
            host=launch.engine_host,
            device=launch.device,
            dtype=launch.dtype,
            seed=launch.seed,
            tp=launch.tp,
            pp=launch.pp,
            nnodes=launch.nodes_per_replica,
            node_rank=worker.node_rank,
            dist_init_addr=dist,
            weights_cpu_backup=self.spec.weights_cpu_backup,
            served_model_name=launch.served_model_name,
            weight_version=version if self.spec.publishes_version else None,
            log_path=log_path,
            extra_args=launch.extra_args,
            env=dict(launch.env),
            role=self.spec.role,
            static=self.spec.is_static,
            replica_index=slot.replica.index,
            options=dict(launch.options),
        )

    # -- publishing and fences -------------------------------------------------------------

    def _publish(self) -> None:
        """Publish the model and its replica heads to the registry publisher (if any).

        A head is published once it has had a URL; its generation moves in the registry when
        its URL changes or its workers were replaced; removed replicas are unpublished.
        Control endpoints of heads that were removed or replaced are forgotten here too.
        """
        stale = [
            i
            for i, (actor, _) in self._control.items()
            if i not in self._slots or self._slots[i].head.actor is not actor
        ]
        for i in stale:
            del self._control[i]
        if self.router is not None:
            # Before the publisher: a head is routable through the router before it is
            # published READY, and out of it before anything stops it.
            self.router.sync(
                {
                    s.engine_id: s.replica.base_url
                    for s in self._ordered()
                    if s.replica.base_url is not None
                    and s.replica.state in _ROUTED
                    and not s.retiring
                }
            )
        if self.publisher is None:
            return
        view = self.model_view()
        publisher = self.publisher
        publisher.set_model(
            self.model_id,
            state=view.state,
            route_mode=view.route_mode,
            weight_source=view.weight_source,
            served_model_name=view.served_model_name,
            router_url=view.router_url,
            weight_version=view.weight_version,
        )
        current = set()
        for slot in self._ordered():
            rep = slot.replica
            if rep.base_url is None:
                continue
            current.add(rep.engine_id)
            last = self._published.get(rep.engine_id)
            publisher.set_engine(
                self.model_id,
                rep.engine_id,
                base_url=rep.base_url,
                state=str(rep.state),
                direct_eligible=rep.direct_eligible,
                replaced=last is not None and last != rep.generation,
            )
            self._published[rep.engine_id] = rep.generation
        for gone in set(self._published) - current:
            publisher.remove_engine(self.model_id, gone)
            del self._published[gone]

    def _fenced_workers(self) -> list[str]:
        return [self._worker_name(s, w) for s in self._ordered() for w in s.workers if w.fenced]

    def _recovery_error(self, what: str) -> InferenceRecoveryRequired:
        names = self._fenced_workers()
        return InferenceRecoveryRequired(
            f"model {self.model_id!r}: {what}: engine worker actor(s) {names} died without "
            "confirmed cleanup of their engine processes; their slots, pending records and "
            "placement group are kept and nothing is rebuilt. Confirm on the node (or "
            "container) that the engine processes are gone, then call "
            "confirm_external_cleanup(), or start a new job"
        )

    def _refuse_if_fenced(self, what: str) -> None:
        if self._fenced_workers():
            raise self._recovery_error(f"{what} refused")

    def _refuse_if_closed(self, what: str) -> None:
        if self._closed:
            raise LifecycleError(f"model {self.model_id!r}: {what} after shutdown()")

    def _fail(
        self, slot: ReplicaSlot, worker: WorkerSlot, outcome: CallOutcome, during: str
    ) -> str:
        """Record an unconfirmed step: fence a dead actor, mark the replica FAILED."""
        message = f"{during} of {self._worker_name(slot, worker)}: {outcome.describe()}"
        if outcome.actor_died:
            worker.fenced = True
            worker.pending = "actor died without confirmed cleanup of its engine process"
            message += " (actor died; engine process not confirmed gone: fenced)"
        self._mark_failed(slot, message)
        return message

    def _mark_failed(self, slot: ReplicaSlot, message: str) -> None:
        rep = slot.replica
        if rep.state is not _S.FAILED and rep.state is not _S.STOPPING:
            rep.advance(_S.FAILED, error=message)
        rep.weights_valid = rep.weights_valid and rep.state is not _S.FAILED
        head = slot.head
        if head.actor is not None and not head.fenced:
            # Best effort: stop admitting at the door too (route eligibility is already gone).
            head.actor.close_admission.remote("FAILED")

    # -- start and rebuild -----------------------------------------------------------------

    def start(self) -> LifecycleResult:
        """Create every worker actor, launch every engine and open admission — all in parallel.

        A replica whose workers all start and whose head generates one token becomes READY;
        any other is FAILED (call :meth:`recover` or :meth:`shutdown`). Idempotent: replicas
        already started are reported NOOP.
        """
        with self._lock:
            self._refuse_if_closed("start()")
            self._refuse_if_fenced("start()")
            todo = [s for s in self._ordered() if s.replica.state is _S.STARTING]
            begin = time.monotonic()
            results = self._start_slots(todo)
            for slot in self._ordered():
                if slot.engine_id not in results:
                    results[slot.engine_id] = ReplicaResult(
                        slot.engine_id, Outcome.NOOP, str(slot.replica.state)
                    )
            return self._result("start", results, begin)

    def _start_slots(self, slots: list[ReplicaSlot]) -> dict[str, ReplicaResult]:
        if not slots:
            return {}
        t = self.timeouts
        begin = time.monotonic()
        for slot in slots:
            for worker in slot.workers:
                if worker.actor is None:
                    self._create_actor(slot, worker)
        self._publish()
        dist: dict[int, str] = {}
        failed: dict[int, str] = {}
        if self.launch.nodes_per_replica > 1:
            outs = gather(
                {s.replica.index: s.head.actor.rendezvous_address.remote() for s in slots},
                t.start + t.rpc_margin,
            )
            for slot in slots:
                out = outs[slot.replica.index]
                if out.ok:
                    dist[slot.replica.index] = str(out.value)
                else:
                    failed[slot.replica.index] = self._fail(slot, slot.head, out, "rendezvous")
        refs = {
            (s.replica.index, w.node_rank): w.actor.start.remote(
                self._launch_spec(s, w, dist.get(s.replica.index)), t.start
            )
            for s in slots
            if s.replica.index not in failed
            for w in s.workers
        }
        remaining = t.start + t.rpc_margin - (time.monotonic() - begin)
        starts = gather(refs, max(remaining, t.rpc_margin))
        started: list[ReplicaSlot] = []
        for slot in slots:
            index = slot.replica.index
            if index in failed:
                continue
            for worker in slot.workers:
                out = starts[(index, worker.node_rank)]
                if out.ok:
                    worker.engine_pid = out.value.pid
                    worker.node_ip = out.value.node_ip
                    worker.node_id = out.value.node_id
                elif index not in failed:
                    failed[index] = self._fail(slot, worker, out, "start")
                elif out.actor_died:
                    self._fail(slot, worker, out, "start")
            if index not in failed:
                started.append(slot)
        opens = gather(
            {
                s.replica.index: s.head.actor.open_admission.remote(check=True, timeout=t.health)
                for s in started
            },
            t.health + t.rpc_margin,
        )
        results: dict[str, ReplicaResult] = {}
        for slot in started:
            index, rep = slot.replica.index, slot.replica
            out = opens[index]
            if not out.ok:
                failed[index] = self._fail(slot, slot.head, out, "first generation")
                continue
            head = starts[(index, 0)].value
            control = getattr(head, "control", None)
            if control is not None:
                self._control[index] = (slot.head.actor, control)
            else:
                self._control.pop(index, None)
            rep.base_url = head.public_url
            rep.generation += 1
            rep.resident = ALL_TAGS
            rep.weights_valid = True
            rep.weight_version = head.weight_version
            rep.error = None
            rep.became_ready()
            if self._weight_version is None and head.weight_version is not None:
                self._weight_version = head.weight_version
        for slot in slots:
            rep = slot.replica
            outcome = Outcome.FAILED if rep.state is _S.FAILED else Outcome.DONE
            results[slot.engine_id] = ReplicaResult(
                slot.engine_id,
                outcome,
                str(rep.state),
                error=failed.get(rep.index),
                seconds=time.monotonic() - begin,
            )
        self._publish()
        return results

    # -- calls to replica heads ---------------------------------------------------------------

    def _call_heads(
        self, method: str, calls: dict[int, dict[str, Any]], timeout: float
    ) -> dict[int, CallOutcome]:
        """Call ``method(**kwargs)`` on the head worker of every replica in ``calls`` at once.

        Over each head's private control endpoint (one HTTP request each, sent together from
        one event loop) when it has one, else as a Ray actor call; one deadline for all. An
        HTTP exchange that failed or got no answer is no proof of anything: Ray is asked
        whether the actor died (then the outcome is Ray's ``RayActorError`` and the caller
        fences the worker); otherwise the channel's outcome stands (a failure, never a success).
        """
        over_http: dict[int, tuple[ControlAddress, str, dict[str, Any]]] = {}
        over_ray: dict[int, Any] = {}
        for i, kwargs in calls.items():
            head = self._slots[i].head
            known = self._control.get(i)
            if self.control_channel and known is not None and known[0] is head.actor:
                over_http[i] = (known[1], method, kwargs)
            else:
                over_ray[i] = getattr(head.actor, method).remote(**kwargs)
        outs = call_many(over_http, timeout)
        if over_ray:
            outs.update(gather(over_ray, timeout))
        unsure = [
            i for i in over_http if outs[i].timed_out or isinstance(outs[i].error, ChannelError)
        ]
        if unsure:
            probes = gather(
                {i: self._slots[i].head.actor.actor_pid.remote() for i in unsure},
                self.timeouts.rpc_margin,
            )
            for i in unsure:
                if probes[i].actor_died:
                    outs[i] = probes[i]
        return {i: outs[i] for i in calls}

    def _result(
        self, operation: str, results: dict[str, ReplicaResult], begin: float
    ) -> LifecycleResult:
        order = [s.engine_id for s in self._ordered()]
        ordered_results = [results[e] for e in order if e in results]
        ordered_results += [r for e, r in results.items() if e not in order]
        return LifecycleResult(
            operation, self.model_id, tuple(ordered_results), time.monotonic() - begin
        )


def with_result(error: InferenceRecoveryRequired, result: Any) -> InferenceRecoveryRequired:
    error.result = result  # type: ignore[attr-defined]
    return error

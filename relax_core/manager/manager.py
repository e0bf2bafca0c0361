"""InferenceManager: one lifecycle core for every role's engines.

One manager per model. It owns the model's engine slots (one Ray actor per node of each
logical replica, on the placement plan's bundles), starts and initialises them in parallel,
tracks each replica's state and resident tags, onloads and offloads them with per-replica
results, applies weight updates behind a fence, checks health, cleans up and rebuilds failed
replicas, scales out and in, publishes the model's schema-2 view (heads only), and shuts
everything down in order (workers, then actors, then owned placement groups).

Read it top-down: each public method of :class:`InferenceManager` takes the lock, refuses what
must be refused, and hands the work to one named part, each of which talks to the others only
through their public methods:

- :class:`~.slots.SlotTable`: the replica slots, the fences among them, per-call results;
- :class:`~.publication.Publication`: the model's schema-2 view, its weight version, publishing;
- :class:`~.launcher.Launcher`: worker actors created, engines launched, admission opened;
- :class:`~.heads.HeadCalls`: one method on many replica heads (control channel or Ray);
- :class:`~.memory.Memory`: offload and onload;
- :class:`~.updates.WeightUpdates`: weight updates behind the fence, DCS checkpoints;
- :class:`~.recovery.Recovery`: health checks, cleanup and rebuild, stopping every worker;
- :class:`~.scaling.Scaling`: scale-out and scale-in;
- :class:`~.groups.PlacementGroups`: the placement groups used, removing the owned ones.

Threading: every public method is blocking and takes the manager's lock, so lifecycle calls
never interleave (the parts are not thread-safe on their own); a health check's probes run
outside it (only planning and judging a round take it). Each step fans out to all
replicas at once (:func:`~.fanout.gather`), so N replicas take as long as the slowest one.

Fail-stop: a worker actor that died without confirmed cleanup of its engine process is
*fenced*: its slot, pending record and placement group are kept, nothing is rebuilt, and every
lifecycle call raises :class:`~relax_core.errors.InferenceRecoveryRequired` until an operator
confirms the node is clean (:meth:`InferenceManager.confirm_external_cleanup`).
"""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Callable, Iterable, Iterator, Sequence
from typing import Any

import attrs

from relax_core.discovery.schema import ModelView
from relax_core.engine.buckets import WeightBucket
from relax_core.engine.spec import InferenceEngineSpec
from relax_core.engine.tags import normalize_tags
from relax_core.errors import InferenceRecoveryRequired, LifecycleError
from relax_core.manager.groups import PlacementGroups
from relax_core.manager.heads import HeadCalls
from relax_core.manager.launcher import Launcher
from relax_core.manager.memory import Memory
from relax_core.manager.publication import Publication
from relax_core.manager.recovery import Recovery
from relax_core.manager.results import (
    HealthReport,
    LifecycleResult,
    Outcome,
    ReplicaResult,
    UnconfirmedWorker,
)
from relax_core.manager.scaling import Scaling
from relax_core.manager.slots import (
    ManagerTimeouts,
    ModelLaunch,
    ReplicaPlacement,
    SlotTable,
    WorkerSlot,
)
from relax_core.manager.state import Replica, ReplicaState
from relax_core.manager.updates import WeightUpdates
from relax_core.records import EngineBackend, RouterMembership

__all__ = ["InferenceManager"]


class InferenceManager:
    """The lifecycle core of one model's engines.

    Build it with the model's :class:`~relax_core.engine.spec.InferenceEngineSpec`, its engine
    backend record, a :class:`~relax_core.manager.ModelLaunch` and a
    :class:`~relax_core.manager.ReplicaPlacement`; then :meth:`start`. Every method blocks and
    takes the manager's lock; every lifecycle call fans out to all replicas in parallel and
    returns a :class:`~relax_core.manager.LifecycleResult` with one result per replica.

    States: a replica is READY only with weights, KV cache and CUDA graph resident, valid
    weights and open admission; STARTING, DRAINING, SLEEPING, ONLOADING, FAILED and STOPPING
    otherwise. FAILED never means the memory is free.

    Fail-stop: when a worker actor dies without confirmed cleanup of its engine process, its
    slot, pending record and placement group are kept, nothing is rebuilt, and lifecycle calls
    raise :class:`~relax_core.errors.InferenceRecoveryRequired` until an operator confirms the
    node is clean (:meth:`confirm_external_cleanup`).

    A manager can itself run as a Ray actor (``ray.remote(InferenceManager)``): every
    constructor argument is serialisable, and so is every result.

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
    :param unhealthy_after: consecutive failed health probes of a live replica before it is
        FAILED (default 3); a dead engine process or worker actor fails it at once.
    :raises ValueError: the inputs disagree (nodes per replica, device, multi-node support),
        or ``unhealthy_after`` is not a positive integer.
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
        unhealthy_after: int = 3,
    ) -> None:
        _check_inputs(model_id, backend, launch, placement)
        if isinstance(unhealthy_after, bool) or not (
            isinstance(unhealthy_after, int) and unhealthy_after >= 1
        ):
            raise ValueError(
                f"model {model_id!r}: unhealthy_after={unhealthy_after!r}; give the number of "
                "consecutive failed health probes (>= 1) before a replica is FAILED"
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
        self.timeouts = t = timeouts or ManagerTimeouts()
        self.retry_after = retry_after
        self._lock = threading.RLock()
        # Health rounds take turns among themselves, not with lifecycle calls: their probes
        # run without the manager's lock.
        self._health_lock = threading.Lock()
        self._closed = False
        # The parts, each over the ones it needs (see the module docstring).
        self._slots = slots = SlotTable(model_id)
        self._groups = PlacementGroups(model_id)
        self._publication = published = Publication(
            slots=slots,
            spec=spec,
            launch=launch,
            publisher=publisher,
            route_mode=route_mode,
            router_url=router_url,
            router=router,
        )
        self._heads = HeadCalls(slots, control_channel=control_channel, probe_timeout=t.rpc_margin)
        self._launcher = Launcher(
            publication=published,
            spec=spec,
            backend=backend,
            launch=launch,
            ray_gpu_fraction=placement.ray_gpu_fraction,
            timeouts=t,
            retry_after=retry_after,
        )
        self._memory = Memory(
            slots, self._heads, published, strict_drain=spec.strict_drain, timeouts=t
        )
        self._weights = WeightUpdates(slots, published, spec=spec, timeouts=t)
        self._recovery = Recovery(
            slots, self._launcher, published, timeouts=t, unhealthy_after=unhealthy_after
        )
        self._scaling = Scaling(
            slots,
            self._groups,
            self._launcher,
            self._recovery,
            published,
            nodes_per_replica=launch.nodes_per_replica,
            strict_drain=spec.strict_drain,
            timeouts=t,
        )
        self._scaling.add(placement.workers, placement.placement_group, owned=placement.owned)

    @property
    def control_channel(self) -> bool:
        """Whether onload/offload go over the heads' control channel (settable between calls)."""
        return self._heads.control_channel

    @control_channel.setter
    def control_channel(self, value: bool) -> None:
        self._heads.control_channel = value

    # -- queries -----------------------------------------------------------------------------

    @property
    def weight_version(self) -> str | None:
        """The published weight version (``None`` for sources that publish none)."""
        return self._publication.published_version

    def replicas(self) -> list[Replica]:
        """The replica records, by index (copies; mutate nothing)."""
        with self._lock:
            return [
                attrs.evolve(s.replica, history=list(s.replica.history))
                for s in self._slots.ordered()
            ]

    def states(self) -> dict[str, str]:
        """Engine id -> replica state."""
        with self._lock:
            return {s.engine_id: str(s.replica.state) for s in self._slots.ordered()}

    def workers(self, engine_id: str) -> list[WorkerSlot]:
        """The worker slots of one replica (head first).

        :raises KeyError: no such replica.
        """
        with self._lock:
            return list(self._slots.get(engine_id).workers)

    def engine_pids(self) -> dict[str, list[int | None]]:
        """Engine id -> the engine process id of each worker (head first)."""
        with self._lock:
            return {s.engine_id: [w.engine_pid for w in s.workers] for s in self._slots.ordered()}

    def launch_specs(self, *, dist_init_addr: str = "192.0.2.1:29500") -> dict[str, list[Any]]:
        """Engine id -> the ``EngineLaunchSpec`` of each of its workers (head first), as
        :meth:`start` would give them now; starts nothing (for dry runs and checks).

        A multi-node replica's workers join ``dist_init_addr``: at start it is the head
        worker's own address, known only then.
        """
        dist = dist_init_addr if self.launch.nodes_per_replica > 1 else None
        with self._lock:
            return {
                s.engine_id: [self._launcher.launch_spec(s, w, dist) for w in s.workers]
                for s in self._slots.ordered()
            }

    def admission_states(self) -> dict[str, dict[str, Any]]:
        """Engine id -> ``{"open": bool, "inflight": int}`` of each started replica's head.

        Asked of every head at once, over the same transport as onload/offload; a head that
        did not answer maps to ``{"error": "..."}``.
        """
        with self._lock:
            live = [s for s in self._slots.ordered() if s.live_head is not None]
            outs = self._heads.call(
                "admission_state", {s.replica.index: {} for s in live}, self.timeouts.health
            )
            return {
                self._slots.at(i).engine_id: (
                    dict(out.value) if out.ok else {"error": out.describe()}
                )
                for i, out in outs.items()
            }

    def unconfirmed_workers(self) -> list[UnconfirmedWorker]:
        """The workers whose cleanup is not confirmed: fenced ones (their actor died) and ones
        whose last shutdown is pending. Their placement groups must not be released: their
        engine processes may still hold the GPUs. Empty after a clean :meth:`shutdown`."""
        with self._lock:
            return self._slots.unconfirmed()

    def republish(self) -> None:
        """Publish the model and its heads again (a registry that lost track of the manager
        and marked them UNKNOWN gets their real state back). Idempotent."""
        with self._lock:
            self._publication.publish()

    def model_view(self) -> ModelView:
        """The model's schema-2 :class:`~relax_core.discovery.schema.ModelView` (heads only)."""
        with self._lock:
            return self._publication.view()

    # -- start, memory -----------------------------------------------------------------------

    def start(self) -> LifecycleResult:
        """Create every worker actor, launch every engine and open admission — all in parallel.

        A replica whose workers all start and whose head generates one token becomes READY;
        any other is FAILED (call :meth:`recover` or :meth:`shutdown`). Idempotent: replicas
        already started are reported NOOP.

        :raises InferenceRecoveryRequired: a worker is fenced (nothing starts).
        """
        return self._run("start", self._start, settle=False)

    def offload(
        self,
        tags: Iterable[str] | None = None,
        *,
        engine_ids: Iterable[str] | None = None,
        abort: bool = False,
    ) -> LifecycleResult:
        """Release ``tags`` (default: all) on every replica; per-replica results.

        ``engine_ids`` limits the call to those replicas (default: all).
        Each replica: close admission (DRAINING, no longer direct-eligible), drain in-flight
        requests (strict: wait up to the drain deadline, then abort), release, confirm →
        SLEEPING. A replica whose release is not confirmed is FAILED: its memory is NOT known
        to be free. Tags already released are skipped, so a repeated offload is a no-op.

        ``abort``: nothing the requests in flight would answer is wanted (their batch failed
        or was interrupted), so each head aborts them at once (``pause_generation``, mode
        ``abort``) instead of draining them, and continues generation after its release (the
        replica is left as any offload leaves it).

        :raises ValueError: an unknown tag. :raises KeyError: an unknown engine id.
        :raises InferenceRecoveryRequired: a worker is fenced (before or during the call).
        """
        wanted = normalize_tags(tags, where="offload(tags)")
        return self._run("offload", lambda: self._memory.offload(engine_ids, wanted, abort=abort))

    def onload(
        self, tags: Iterable[str] | None = None, *, engine_ids: Iterable[str] | None = None
    ) -> LifecycleResult:
        """Resume the missing ``tags`` (default: all) on every SLEEPING replica.

        ``engine_ids`` limits the call to those replicas (default: all).
        Each replica: ONLOADING, resume only what is missing (weights first), and — once every
        tag is resident — check one generation and reopen admission → READY; with a subset of
        tags it stays SLEEPING. READY replicas are a no-op. A replica whose resume is not
        confirmed is FAILED.

        :raises ValueError: an unknown tag. :raises KeyError: an unknown engine id.
        :raises InferenceRecoveryRequired: a worker is fenced (before or during the call).
        """
        wanted = normalize_tags(tags, where="onload(tags)")
        return self._run("onload", lambda: self._memory.onload(engine_ids, wanted))

    # -- health and recovery -----------------------------------------------------------------

    def health_check(self, *, recover: bool = True) -> HealthReport:
        """Probe every worker of every replica; fail, clean and (with ``recover``) rebuild.

        A head of a READY replica must generate one token; every worker's engine process must
        be alive. A replica whose engine process exited or whose worker actor died is FAILED
        at once; one whose probe failed or timed out while its process lives is FAILED only
        once ``unhealthy_after`` rounds in a row failed (until then it keeps its state and
        stays routable: a GC pause or a long prefill is not a reason to reload it). A FAILED
        replica is no longer published as routable; with ``recover`` it is cleaned as a whole
        and rebuilt once its cleanup is confirmed.

        The probes run without the manager's lock (each bounded by ``timeouts.health``, all
        replicas at once), so lifecycle calls are not held up by a slow engine; the lock is
        taken only to plan the round and to judge it. A probe that overlapped a lifecycle
        change of its replica is ignored. Health rounds run one at a time.

        :raises InferenceRecoveryRequired: a worker actor died without confirmed cleanup (its
            fence is kept and nothing is rebuilt); the report is on the error's ``report``.
        """
        with self._health_lock:
            with self._guard("health_check()", refuse_fenced=False):
                plan = self._recovery.plan_probes()
            outs = self._recovery.probe(plan)
            with self._guard("health_check()", refuse_fenced=False):
                report = self._recovery.apply_probes(plan, outs, recover=recover)
                if self._slots.fenced_workers():
                    message = self._slots.fence_message("health_check()")
                    raise InferenceRecoveryRequired(message, report=report)
                return report

    def recover(self) -> LifecycleResult:
        """Clean every FAILED replica (and retry pending cleanups) as a whole; rebuild those
        whose cleanup is confirmed. Per-replica results.

        :raises InferenceRecoveryRequired: a worker is fenced.
        """
        return self._run("recover", self._recovery.recover)

    def confirm_external_cleanup(self, engine_ids: Iterable[str] | None = None) -> list[str]:
        """Lift the fence of dead worker actors whose engine processes an operator confirmed gone.

        Only call this after checking the node or container (the manager cannot: the actor
        that owned the process is dead). Afterwards :meth:`recover` may rebuild the replicas
        and :meth:`shutdown` may release the placement group. Returns the workers unfenced.
        """
        with self._lock:
            return self._recovery.confirm_external_cleanup(engine_ids)

    # -- scaling and shutdown ----------------------------------------------------------------

    def scale_out(
        self,
        workers: Sequence[Sequence[Sequence[int]]] | None = None,
        *,
        count: int | None = None,
        placement_group: Any = None,
        owned: bool = False,
    ) -> LifecycleResult:
        """Add replicas and start them: ``workers[replica][node]`` are bundle indices (one node
        group per node of a replica — every node gets its slot), or ``count`` unplaced CPU
        replicas. ``placement_group`` defaults to the manager's own.

        :raises ValueError: a new replica has the wrong number of nodes, or a bundle is taken.
        :raises InferenceRecoveryRequired: a worker is fenced (nothing is added).
        """
        group = placement_group if placement_group is not None else self.placement.placement_group

        def add_and_start() -> dict[str, ReplicaResult]:
            new = self._scaling.check_new(workers, count, group)
            return self._scaling.scale_out(new, group, owned=owned)

        return self._run("scale_out", add_and_start, settle=False)

    def scale_in(
        self, *, count: int | None = None, urls: Sequence[str] | None = None
    ) -> LifecycleResult:
        """Remove replicas: ``count`` of them (partially cleaned ones first, then FAILED, then
        the newest), or the ones published under ``urls`` — a replica keeps its current URL
        while partially cleaned, so a failed scale-in can be retried by the same URL.

        Each chosen replica is drained, every worker shut down, confirmed actors killed; a
        fully cleaned replica is removed (DONE), one with an unconfirmed worker stays STOPPING
        (FAILED result, retry).

        :raises ValueError: an unknown URL or a bad count.
        :raises InferenceRecoveryRequired: a worker actor died without confirmed cleanup.
        """
        with self._guard("scale_in()", refuse_fenced=False):
            if (count is None) == (urls is None):
                raise ValueError("scale_in: give either count or urls, not both")
            chosen = self._scaling.choose(count, urls)
            begin = time.monotonic()
            results = self._scaling.scale_in(chosen)
            # In the order chosen: the removed replicas are no longer in the slot table.
            result = LifecycleResult(
                "scale_in", self.model_id, tuple(results.values()), time.monotonic() - begin
            )
            return self._slots.settle("scale_in()", result)

    def shutdown(self) -> None:
        """Stop everything: every worker's shutdown (waited for), then the actors, then the
        placement groups this manager owns (borrowed ones are never removed). Idempotent.

        :raises LifecycleError: a step was not confirmed; it stays pending and the next
            ``shutdown()`` retries it (owned placement groups are kept until then).
        :raises InferenceRecoveryRequired: a worker actor died without confirmed cleanup;
            its placement group is kept (fence) until :meth:`confirm_external_cleanup`.
        """
        with self._lock:
            self._recovery.stop_all()
            if self._slots.fenced_workers():
                raise InferenceRecoveryRequired(self._slots.fence_message("shutdown()"))
            self._groups.remove_owned()
            self._closed = True
            self._publication.publish()

    # -- weight updates ----------------------------------------------------------------------

    def update_weights_from_tensor(
        self,
        serialized_named_tensors: Sequence[str],
        *,
        load_format: str | None = None,
        weight_version: str | None = None,
        flush_cache: bool = True,
        pause: str | None = None,
        buckets: Sequence[Sequence[str]] = (),
    ) -> LifecycleResult:
        """Push tensors to every replica (``tensor`` path; ACTOR). Per-replica results.

        ``pause``: instead of the fence (admission closed, requests in flight finished first),
        pause generation with SGLang's mode (``in_place`` or ``retract``), update, continue:
        requests in flight are kept and go on with the new weights (their answers carry both
        versions), requests arriving meanwhile wait in the engine; ``abort``: requests in
        flight end with what they had (finish reason ``abort``; their callers continue them).

        ``buckets``: a push in several engine calls, one per bucket (each item a call's
        ``serialized_named_tensors``: one payload per TP rank, e.g.
        the buffer of a :class:`~relax_core.engine.buckets.WeightBucket` serialized with
        ``load_format="flattened_bucket"``), sent in order after ``serialized_named_tensors``
        (which may then be empty), all inside the one fence or pause. A replica's version
        moves only once its last bucket landed; a replica whose bucket failed is FAILED (its
        weights are a mix of both versions) and its result says which bucket.

        :raises CapabilityError: the weight source does not allow ``tensor`` updates.
        :raises ValueError: no payload at all.
        """
        calls = [list(p) for p in ([serialized_named_tensors] if serialized_named_tensors else [])]
        calls += [list(b) for b in buckets]
        if not calls:
            raise ValueError("update_weights_from_tensor: no payload (nor any bucket) to push")
        return self._update(
            "update_weights_from_tensor",
            {
                "serialized_named_tensors": calls[0],
                "load_format": load_format,
                "weight_version": weight_version,
                "flush_cache": flush_cache,
            },
            pause=pause,
            buckets=[{"serialized_named_tensors": c} for c in calls] if len(calls) > 1 else (),
        )

    def update_weights_from_disk(
        self, model_path: str, *, weight_version: str | None = None, load_format: str | None = None
    ) -> LifecycleResult:
        """Load a checkpoint directory on every replica (``disk`` path; ACTOR, DCS).

        :raises CapabilityError: the weight source does not allow ``disk`` updates.
        """
        return self._update(
            "update_weights_from_disk",
            {
                "model_path": model_path,
                "weight_version": weight_version,
                "load_format": load_format,
            },
        )

    def update_weights_from_distributed(
        self,
        names: Sequence[str],
        dtypes: Sequence[str],
        shapes: Sequence[Sequence[int]],
        *,
        group_name: str = "weight_update_group",
        weight_version: str | None = None,
        load_format: str | None = None,
        buckets: Sequence[WeightBucket] = (),
    ) -> LifecycleResult:
        """Receive tensors broadcast by the trainer (``distributed`` path; ACTOR).

        The trainer must broadcast concurrently (from another thread or process): each tensor
        in order, or with ``load_format="flattened_bucket"`` (SGLang's) each call's tensors as
        one flat ``uint8`` buffer. ``buckets``: a push in several engine calls, one per
        :class:`~relax_core.engine.buckets.WeightBucket` (its names, dtypes and shapes), in
        order after ``names`` (which may then be empty), inside the one fence; the trainer
        broadcasts bucket after bucket. The version moves as with
        :meth:`update_weights_from_tensor`'s buckets.

        :raises ValueError: no tensor at all.
        """
        calls = [(list(names), list(dtypes), [list(s) for s in shapes])] if names else []
        calls += [(list(b.names), list(b.dtypes), [list(s) for s in b.shapes]) for b in buckets]
        if not calls:
            raise ValueError("update_weights_from_distributed: no names (nor any bucket)")
        per_call = [{"names": n, "dtypes": d, "shapes": s} for n, d, s in calls]
        return self._update(
            "update_weights_from_distributed",
            {
                **per_call[0],
                "group_name": group_name,
                "weight_version": weight_version,
                **({"load_format": load_format} if load_format is not None else {}),
            },
            buckets=per_call if len(per_call) > 1 else (),
        )

    def init_weights_update_group(
        self,
        *,
        master_address: str,
        master_port: int,
        rank_offsets: Sequence[int],
        world_size: int,
        group_name: str = "weight_update_group",
        backend: str = "nccl",
    ) -> LifecycleResult:
        """Join every replica head to the trainer's broadcast group (``distributed`` path).

        ``rank_offsets[i]`` is replica ``i``'s first rank. No fence: admission stays as it is.

        :raises ValueError: not one rank offset per replica.
        """
        self._weights.check("init_weights_update_group")
        with self._lock:
            slots = self._slots.ordered()
            if len(rank_offsets) != len(slots):
                raise ValueError(
                    f"init_weights_update_group: {len(rank_offsets)} rank offsets for "
                    f"{len(slots)} replicas of model {self.model_id!r}"
                )
            offsets = {s.replica.index: int(o) for s, o in zip(slots, rank_offsets, strict=True)}
        return self._each_head(
            "init_weights_update_group",
            lambda index: {
                "master_address": master_address,
                "master_port": master_port,
                "rank_offset": offsets[index],
                "world_size": world_size,
                "group_name": group_name,
                "backend": backend,
            },
        )

    def destroy_weights_update_group(
        self, group_name: str = "weight_update_group"
    ) -> LifecycleResult:
        """Leave the trainer's broadcast group on every replica head."""
        self._weights.check("destroy_weights_update_group")
        return self._each_head(
            "destroy_weights_update_group", lambda _i: {"group_name": group_name}
        )

    def load_lora_adapter(self, lora_name: str, lora_path: str) -> LifecycleResult:
        """Load a LoRA adapter on every replica (``lora`` path; refused for STATIC models)."""
        return self._update("load_lora_adapter", {"lora_name": lora_name, "lora_path": lora_path})

    def unload_lora_adapter(self, lora_name: str) -> LifecycleResult:
        """Unload a LoRA adapter from every replica."""
        return self._update("unload_lora_adapter", {"lora_name": lora_name})

    def load_checkpoint(self, version: int | None = None) -> LifecycleResult:
        """DCS: load checkpoint ``version`` (default: the newest) on every replica, if newer.

        A version equal to the published one is a no-op.

        :raises CapabilityError: the weight source has no ``disk`` path.
        :raises LifecycleError: the model has no checkpoint directory, or it holds no version.
        """
        self._weights.check("update_weights_from_disk")
        wanted, path = self._weights.checkpoint(version)
        if self._publication.weight_version == str(wanted):
            with self._lock:
                results = {s.engine_id: s.result(Outcome.NOOP) for s in self._slots.ordered()}
                return self._slots.result("load_checkpoint", results, time.monotonic())
        return self._update(
            "update_weights_from_disk",
            {"model_path": path, "weight_version": str(wanted), "load_format": None},
        )

    # -- the shared steps of every call ------------------------------------------------------

    @contextlib.contextmanager
    def _guard(self, what: str, *, refuse_fenced: bool = True) -> Iterator[None]:
        """Hold the lock; refuse ``what`` after shutdown and (``refuse_fenced``) while a worker
        is fenced."""
        with self._lock:
            if self._closed:
                raise LifecycleError(f"model {self.model_id!r}: {what} after shutdown()")
            if refuse_fenced:
                self._slots.refuse_if_fenced(what)
            yield

    def _run(
        self,
        operation: str,
        step: Callable[[], dict[str, ReplicaResult]],
        *,
        settle: bool = True,
    ) -> LifecycleResult:
        """One lifecycle call: guarded (see :meth:`_guard`), ``step`` gives one result per
        replica; with ``settle``, a worker fenced by the call raises with the result on it."""
        what = f"{operation}()"
        with self._guard(what):
            begin = time.monotonic()
            result = self._slots.result(operation, step(), begin)
            return self._slots.settle(what, result) if settle else result

    def _start(self) -> dict[str, ReplicaResult]:
        """Start the STARTING replicas; the others are NOOP."""
        todo = [s for s in self._slots.ordered() if s.replica.state is ReplicaState.STARTING]
        results = self._launcher.start(todo)
        for slot in self._slots.ordered():
            results.setdefault(slot.engine_id, slot.result(Outcome.NOOP))
        return results

    def _update(
        self,
        method: str,
        kwargs: dict[str, Any],
        *,
        pause: str | None = None,
        buckets: Sequence[dict[str, Any]] = (),
    ) -> LifecycleResult:
        """One weight update on every replica that holds weights, behind the fence (or with
        generation paused in ``pause`` mode); ``buckets``: in several engine calls."""
        self._weights.check(method)
        if pause is not None and pause not in PAUSE_MODES:
            raise ValueError(f"pause={pause!r}: one of {PAUSE_MODES} (or None: the fence)")
        return self._run(
            method, lambda: self._weights.apply(method, kwargs, pause=pause, buckets=buckets)
        )

    def _each_head(
        self, method: str, kwargs_of: Callable[[int], dict[str, Any]]
    ) -> LifecycleResult:
        """One call on every serving replica's head, with no fence (a weight-update group)."""
        return self._run(method, lambda: self._weights.each_head(method, kwargs_of), settle=False)


#: The pause modes a weight update may take instead of the fence (SGLang's; ``abort`` ends the
#: requests in flight with what they generated: their callers send them on).
PAUSE_MODES = ("in_place", "retract", "abort")


def _check_inputs(
    model_id: str, backend: EngineBackend, launch: ModelLaunch, placement: ReplicaPlacement
) -> None:
    """:raises ValueError: the launch, the placement and the backend disagree."""
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

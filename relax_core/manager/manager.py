"""InferenceManager: one lifecycle core for every role's engines (one manager per model);
each public method takes its lock and hands the work to one of its parts (``docs/manager.md``)."""

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
from relax_core.manager.memory import Memory, Ran
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

#: What a lifecycle step returns: its results, or theirs and the seconds of its hops.
_Ran = dict[str, ReplicaResult] | Ran


class InferenceManager:
    """The lifecycle core of one model's engines: build it, then :meth:`start`.

    Every method blocks and takes the manager's lock; a lifecycle call fans out to all replicas
    and returns a :class:`~relax_core.manager.LifecycleResult` (one result per replica). A
    worker actor that died without confirmed cleanup *fences* the manager: lifecycle calls
    raise :class:`~relax_core.errors.InferenceRecoveryRequired` until
    :meth:`confirm_external_cleanup`.

    :param model_id: the model's id in its role; engine ids are ``{model_id}/replica-{i}``.
    :param spec: what the engines may do (role, weight source, operations, strict drain).
    :param backend: the engine backend record (``plugin_manager.engine_backend("hf")``).
    :param publisher: where the model's schema-2 view goes (``None``: nowhere).
    :param route_mode: ``DIRECT`` or ``SGLANG_ROUTER`` (then give ``router_url``).
    :param router: the router in front of the heads, told the heads to route to on every publish.
    :param control_channel: onload/offload over each head's private HTTP control endpoint
        (default); ``False``: as Ray actor calls.
    :param unhealthy_after: consecutive failed health probes of a live replica before it is
        FAILED (default 3).
    :raises ValueError: the inputs disagree (nodes per replica, device, multi-node support),
        or ``unhealthy_after`` is not a positive integer."""

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
        self.launch = launch
        self.placement = placement
        self.publisher = publisher
        self.timeouts = t = timeouts or ManagerTimeouts()
        self._lock = threading.RLock()
        self._health_lock = threading.Lock()
        self._closed = False
        self._slots = slots = SlotTable(model_id)
        self._groups = PlacementGroups(model_id)
        self._publication = published = Publication(
            slots, spec, launch, publisher, route_mode, router_url, router
        )
        self._heads = HeadCalls(slots, control_channel=control_channel, probe_timeout=t.rpc_margin)
        self._launcher = Launcher(published, spec, backend, launch, placement.ray_gpu_fraction, t)
        self._memory = Memory(slots, self._heads, published, spec.strict_drain, t)
        self._offload_tags = spec.offload_tags
        #: its weights, once released, could not come back (STATIC, no CPU copy)
        self._weights_irreplaceable = spec.is_static and not spec.weights_cpu_backup
        self._weights = WeightUpdates(slots, published, spec, t)
        self._recovery = Recovery(slots, self._launcher, published, t, unhealthy_after)
        self._scaling = Scaling(
            slots, self._groups, self._launcher, self._recovery, published, spec.strict_drain, t
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
        """The worker slots of one replica (head first). :raises KeyError: no such replica."""
        with self._lock:
            return list(self._slots.get(engine_id).workers)

    def engine_pids(self) -> dict[str, list[int | None]]:
        """Engine id -> the engine process id of each worker (head first)."""
        with self._lock:
            return {s.engine_id: [w.engine_pid for w in s.workers] for s in self._slots.ordered()}

    def launch_specs(self, *, dist_init_addr: str = "192.0.2.1:29500") -> dict[str, list[Any]]:
        """Engine id -> the ``EngineLaunchSpec`` of each worker (head first), as :meth:`start`
        would give them (multi-node ones joining ``dist_init_addr``); starts nothing."""
        dist = dist_init_addr if self.launch.nodes_per_replica > 1 else None
        with self._lock:
            return {
                s.engine_id: [self._launcher.launch_spec(s, w, dist) for w in s.workers]
                for s in self._slots.ordered()
            }

    def admission_states(self) -> dict[str, dict[str, Any]]:
        """Engine id -> ``{"open": bool, "inflight": int}`` of each started replica's head
        (``{"error": "..."}`` for one that did not answer)."""
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
        """The workers whose cleanup is not confirmed (fenced or pending): their placement
        groups must not be released. Empty after a clean :meth:`shutdown`."""
        with self._lock:
            return self._slots.unconfirmed()

    def republish(self) -> None:
        """Publish the model and its heads again (to a registry that lost track). Idempotent."""
        with self._lock:
            self._publication.publish()

    def model_view(self) -> ModelView:
        """The model's schema-2 :class:`~relax_core.discovery.schema.ModelView` (heads only)."""
        with self._lock:
            return self._publication.view()

    # -- start, memory -----------------------------------------------------------------------

    def start(self) -> LifecycleResult:
        """Create every worker actor, launch every engine and open admission, in parallel: a
        replica whose head generates one token is READY, any other FAILED. Idempotent.
        :raises InferenceRecoveryRequired: a worker is fenced (nothing starts)."""
        return self._run("start", self._start, settle=False)

    def offload(
        self,
        tags: Iterable[str] | None = None,
        *,
        engine_ids: Iterable[str] | None = None,
        abort: bool = False,
    ) -> LifecycleResult:
        """Release ``tags`` (default: all, but the weights of a spec that keeps them; see
        ``InferenceEngineSpec.offload_tags``) on every replica (or ``engine_ids``): close
        admission, drain, release, confirm → SLEEPING; an unconfirmed release is FAILED (its
        memory is NOT known to be free). Idempotent. ``abort``: abort the requests in flight
        instead of draining them.
        :raises ValueError: an unknown tag. :raises KeyError: an unknown engine id.
        :raises InferenceRecoveryRequired: a worker is fenced (before or during the call)."""
        wanted = self._offload_tags if tags is None else normalize_tags(tags, where="offload(tags)")
        if self._weights_irreplaceable and "weights" in wanted:
            raise ValueError(
                f"offload(tags): {self.model_id}'s STATIC weights have no CPU backup "
                "(offload_weights = false): a release would lose them; leave 'weights' out"
            )
        return self._run("offload", lambda: self._memory.offload(engine_ids, wanted, abort=abort))

    def onload(
        self, tags: Iterable[str] | None = None, *, engine_ids: Iterable[str] | None = None
    ) -> LifecycleResult:
        """Resume the missing ``tags`` (default: all) on every SLEEPING replica (or
        ``engine_ids``); once every tag is resident, check one generation and reopen → READY.
        READY replicas are a no-op; an unconfirmed resume is FAILED.
        :raises ValueError: an unknown tag. :raises KeyError: an unknown engine id.
        :raises InferenceRecoveryRequired: a worker is fenced (before or during the call)."""
        wanted = normalize_tags(tags, where="onload(tags)")
        return self._run("onload", lambda: self._memory.onload(engine_ids, wanted))

    # -- health and recovery -----------------------------------------------------------------

    def health_check(self, *, recover: bool = True) -> HealthReport:
        """Probe every worker of every replica; fail, clean and (with ``recover``) rebuild.

        A dead engine process or worker actor fails its replica at once; a failed probe of a
        live one only after ``unhealthy_after`` rounds in a row. The probes run without the
        manager's lock; health rounds run one at a time.
        :raises InferenceRecoveryRequired: a worker actor died without confirmed cleanup (its
            fence is kept and nothing is rebuilt); the report is on the error's ``report``."""
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
        """Clean every FAILED replica (and retry pending cleanups); rebuild the confirmed ones.
        :raises InferenceRecoveryRequired: a worker is fenced."""
        return self._run("recover", self._recovery.recover)

    def confirm_external_cleanup(self, engine_ids: Iterable[str] | None = None) -> list[str]:
        """Lift the fence of dead worker actors whose engine processes an operator confirmed
        gone (check the node first: the manager cannot). Returns the workers unfenced."""
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
        """Add replicas and start them: ``workers[replica][node]`` are bundle indices, or
        ``count`` unplaced CPU replicas. ``placement_group`` defaults to the manager's own.
        :raises ValueError: a new replica has the wrong number of nodes, or a bundle is taken.
        :raises InferenceRecoveryRequired: a worker is fenced (nothing is added)."""
        group = placement_group if placement_group is not None else self.placement.placement_group

        def add_and_start() -> dict[str, ReplicaResult]:
            new = self._scaling.check_new(workers, count, group)
            return self._launcher.start(self._scaling.add(new, group, owned=owned))

        return self._run("scale_out", add_and_start, settle=False)

    def scale_in(
        self, *, count: int | None = None, urls: Sequence[str] | None = None
    ) -> LifecycleResult:
        """Remove replicas: ``count`` of them (partially cleaned, then FAILED, then newest), or
        the ones published under ``urls``. One with an unconfirmed worker stays STOPPING
        (FAILED result; retry by the same URL).
        :raises ValueError: an unknown URL or a bad count.
        :raises InferenceRecoveryRequired: a worker actor died without confirmed cleanup."""
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
        """Stop every worker, then the actors, then the placement groups this manager owns.
        Idempotent.
        :raises LifecycleError: a step was not confirmed; it stays pending and the next
            ``shutdown()`` retries it (owned placement groups are kept until then).
        :raises InferenceRecoveryRequired: a worker actor died without confirmed cleanup;
            its placement group is kept (fence) until :meth:`confirm_external_cleanup`."""
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

        ``pause``: instead of the fence, pause generation in a mode of
        :data:`~.updates.PAUSE_MODES`, update, continue. ``buckets``: more engine calls (each
        one payload per TP rank), after ``serialized_named_tensors`` (which may then be
        empty), inside the one fence; a replica whose bucket failed is FAILED.
        :raises CapabilityError: the weight source does not allow ``tensor`` updates.
        :raises ValueError: no payload at all."""
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
        :raises CapabilityError: the weight source does not allow ``disk`` updates."""
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
        """Receive tensors broadcast by the trainer, concurrently (``distributed`` path);
        ``buckets``: more engine calls, one per :class:`~relax_core.engine.buckets.WeightBucket`,
        as :meth:`update_weights_from_tensor`'s. :raises ValueError: no tensor at all."""
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
        """Join every replica head to the trainer's broadcast group (no fence);
        ``rank_offsets[i]`` is replica ``i``'s first rank.
        :raises ValueError: not one rank offset per replica."""
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
        """DCS: load checkpoint ``version`` (default: the newest) on every replica, unless
        it is the published one.
        :raises CapabilityError: the weight source has no ``disk`` path.
        :raises LifecycleError: the model has no checkpoint directory, or it holds no version."""
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
        """Hold the lock; refuse ``what`` after shutdown and (``refuse_fenced``) while fenced."""
        with self._lock:
            if self._closed:
                raise LifecycleError(f"model {self.model_id!r}: {what} after shutdown()")
            if refuse_fenced and self._slots.fenced_workers():
                raise InferenceRecoveryRequired(self._slots.fence_message(f"{what} refused"))
            yield

    def _run(
        self, operation: str, step: Callable[[], _Ran], *, settle: bool = True
    ) -> LifecycleResult:
        """One guarded lifecycle call (``step``: its results, or theirs and the seconds of its
        hops); with ``settle``, a worker fenced by it raises."""
        what = f"{operation}()"
        with self._guard(what):
            begin = time.monotonic()
            ran = step()
            results, timings = ran if isinstance(ran, tuple) else (ran, {})
            result = attrs.evolve(self._slots.result(operation, results, begin), timings=timings)
            return self._slots.settle(what, result) if settle else result

    def _start(self) -> dict[str, ReplicaResult]:
        todo = [s for s in self._slots.ordered() if s.replica.state is ReplicaState.STARTING]
        results = self._launcher.start(todo)
        for slot in self._slots.ordered():
            results.setdefault(slot.engine_id, slot.result(Outcome.NOOP))
        return results

    def _update(self, method: str, kwargs: dict[str, Any], **how: Any) -> LifecycleResult:
        self._weights.check(method, pause=how.get("pause"))
        return self._run(method, lambda: self._weights.apply(method, kwargs, **how))

    def _each_head(
        self, method: str, kwargs_of: Callable[[int], dict[str, Any]]
    ) -> LifecycleResult:
        return self._run(method, lambda: self._weights.each_head(method, kwargs_of), settle=False)


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

"""Starting replicas (a start, a rebuild, a scale-out): every worker actor created at once,
every engine launched with one deadline, admission opened at each head after one generation;
a replica is READY only then, else FAILED (a dead actor fenced)."""

from __future__ import annotations

import functools
import os
import time
from typing import Any

import attrs

from relax_core.engine.spec import InferenceEngineSpec
from relax_core.engine.tags import ALL_TAGS
from relax_core.manager.fanout import gather
from relax_core.manager.publication import Publication
from relax_core.manager.results import Outcome, ReplicaResult
from relax_core.manager.slots import ManagerTimeouts, ModelLaunch, ReplicaSlot, WorkerSlot
from relax_core.manager.state import ReplicaState
from relax_core.manager.weights import CheckpointDirectory
from relax_core.manager.worker import EngineWorker
from relax_core.records import EngineBackend, EngineLaunchSpec


@functools.cache
def _remote_worker() -> Any:
    import ray

    return ray.remote(EngineWorker)


@attrs.define
class Launcher:
    """Starts replicas of one model. Not thread-safe. ``ray_gpu_fraction``: the GPU share
    each worker reserves."""

    publication: Publication
    spec: InferenceEngineSpec
    backend: EngineBackend
    launch: ModelLaunch
    ray_gpu_fraction: float
    timeouts: ManagerTimeouts

    def start(
        self, slots: list[ReplicaSlot], *, from_files: bool = False
    ) -> dict[str, ReplicaResult]:
        """Start ``slots`` (STARTING replicas); one result per replica. Blocking. ``from_files``
        (a rebuild): the engines are told no weight version, so each reports its files' (the
        engine's default, a DCS checkpoint's) until weights are pushed: its CPU copy died."""
        if not slots:
            return {}
        t = self.timeouts
        begin = time.monotonic()
        for slot in slots:
            for worker in slot.workers:
                if worker.actor is None:
                    self._create_actor(slot, worker)
        self.publication.publish()
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
                    failed[slot.replica.index] = slot.fail(slot.head, out, "rendezvous")
        refs = {
            (s.replica.index, w.node_rank): w.actor.start.remote(
                self.launch_spec(s, w, dist.get(s.replica.index), from_files=from_files), t.start
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
                    failed[index] = slot.fail(worker, out, "start")
                elif out.actor_died:
                    slot.fail(worker, out, "start")
            if index not in failed:
                started.append(slot)
        opens = gather(
            {
                s.replica.index: s.head.actor.open_admission.remote(check=True, timeout=t.health)
                for s in started
            },
            t.health + t.rpc_margin,
        )
        for slot in started:
            index, rep = slot.replica.index, slot.replica
            out = opens[index]
            if not out.ok:
                failed[index] = slot.fail(slot.head, out, "first generation")
                continue
            head = starts[(index, 0)].value
            slot.head.control = getattr(head, "control", None)
            rep.base_url = head.public_url
            rep.generation += 1
            rep.resident = ALL_TAGS
            rep.weights_valid = True
            rep.weight_version = head.weight_version
            rep.error = None
            rep.became_ready()
            if self.publication.weight_version is None and head.weight_version is not None:
                self.publication.weight_version = head.weight_version
        self.publication.publish()
        return {
            s.engine_id: s.result(
                Outcome.FAILED if s.replica.state is ReplicaState.FAILED else Outcome.DONE,
                error=failed.get(s.replica.index),
                seconds=time.monotonic() - begin,
            )
            for s in slots
        }

    def _create_actor(self, slot: ReplicaSlot, worker: WorkerSlot) -> None:
        options: dict[str, Any] = {"num_cpus": 0, "max_restarts": 0}
        if slot.placement_group is not None and worker.bundle is not None:
            from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

            options["num_gpus"] = self.ray_gpu_fraction
            options["scheduling_strategy"] = PlacementGroupSchedulingStrategy(
                placement_group=slot.placement_group,
                placement_group_bundle_index=worker.bundle,
                placement_group_capture_child_tasks=False,
            )
        worker.attach(
            _remote_worker()
            .options(**options)
            .remote(
                engine_id=slot.engine_id,
                node_rank=worker.node_rank,
                backend=self.backend,
                spec=self.spec,
                public_host=self.launch.public_host,
            )
        )

    def launch_spec(
        self, slot: ReplicaSlot, worker: WorkerSlot, dist: str | None, *, from_files: bool = False
    ) -> EngineLaunchSpec:
        """The :class:`~relax_core.records.EngineLaunchSpec` ``worker`` of ``slot`` is started
        with (``dist``: the replica's rendezvous address, multi-node replicas only)."""
        launch = self.launch
        model_path = launch.model_path
        version = None if from_files else self.publication.weight_version
        if self.spec.needs_checkpoint_dir:
            ckpt = CheckpointDirectory(self.spec.checkpoint_dir or "")
            latest = ckpt.latest()
            if latest is not None:
                model_path, version = ckpt.path(latest), str(latest)
        log_path = None
        if launch.log_dir:
            safe = slot.worker_name(worker).replace("/", "_")
            log_path = os.path.join(launch.log_dir, f"{safe}-gen{slot.replica.generation + 1}.log")
        return EngineLaunchSpec(
            engine_id=slot.worker_name(worker),
            model_path=model_path,
            host=launch.engine_host,
            **{name: getattr(launch, name) for name in ("device", "seed", "tp", "pp")},
            nnodes=launch.nodes_per_replica,
            node_rank=worker.node_rank,
            dist_init_addr=dist,
            served_model_name=launch.served_model_name,
            weight_version=version if self.spec.publishes_version else None,
            log_path=log_path,
            role=self.spec.role,
            static=self.spec.is_static,
            replica_index=slot.replica.index,
            # The engine spec decides the backup (a STATIC engine always keeps one).
            options=attrs.evolve(launch.options, weights_cpu_backup=self.spec.weights_cpu_backup),
            backend_options=launch.backend_options,
        )

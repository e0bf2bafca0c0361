"""Weight updates behind a fence, checked against the model's weight source.

Every update path is checked at the manager's API first (a STATIC model raises
:class:`~relax_core.errors.CapabilityError` before anything happens), then again in the engine
worker; the admission server refuses them at the public port.

The fence: the replicas to update are marked not direct-eligible and published; each one closes
admission, waits for its in-flight requests, applies the update, checks one generation and
reopens — so no request reaches a replica mid-update. The published ``weight_version`` moves
once the update is confirmed. DCS models load the newest ``version-N/`` of their checkpoint
directory through the same path (:meth:`WeightsMixin.load_checkpoint`).
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from typing import Any

from relax_core.errors import LifecycleError
from relax_core.manager.base import ManagerBase, with_result
from relax_core.manager.fanout import gather
from relax_core.manager.results import LifecycleResult, Outcome, ReplicaResult
from relax_core.manager.state import ReplicaState, ResidentTag
from relax_core.manager.weights import CheckpointDirectory
from relax_core.manager.worker import UPDATE_METHODS

__all__ = ["WeightsMixin"]

_S = ReplicaState


class WeightsMixin(ManagerBase):
    """Weight updates of :class:`~relax_core.manager.InferenceManager`."""

    def _check(self, method: str) -> None:
        self.spec.check(UPDATE_METHODS[method], engine_id=f"{self.model_id} (every replica)")

    def _update(
        self, method: str, kwargs: dict[str, Any], *, fence: bool = True
    ) -> LifecycleResult:
        """Apply one update call to every replica that holds weights, behind the fence."""
        self._check(method)
        with self._lock:
            self._refuse_if_closed(f"{method}()")
            self._refuse_if_fenced(f"{method}()")
            begin = time.monotonic()
            targets, results = [], {}
            for slot in self._ordered():
                rep = slot.replica
                if rep.state is _S.FAILED or rep.state is _S.STOPPING:
                    results[slot.engine_id] = ReplicaResult(
                        slot.engine_id, Outcome.SKIPPED, str(rep.state), error="not serving"
                    )
                elif rep.state in (_S.READY, _S.SLEEPING) and ResidentTag.WEIGHTS in rep.resident:
                    targets.append(slot)
                else:
                    raise LifecycleError(
                        f"{method} of model {self.model_id!r}: replica {slot.engine_id} is "
                        f"{rep.state} without resident weights; onload(['weights']) first"
                    )
            if not targets:
                raise LifecycleError(
                    f"{method} of model {self.model_id!r}: no replica holds weights to update; "
                    "start or onload the model first"
                )
            reopen = {s.replica.index: s.replica.state is _S.READY for s in targets}
            if fence:
                for slot in targets:
                    if reopen[slot.replica.index]:
                        slot.replica.admission_open = False
                        slot.replica.advance(_S.DRAINING)
                self._publish()
            t = self.timeouts
            outs = gather(
                {
                    s.replica.index: s.head.actor.update_weights.remote(
                        method,
                        kwargs,
                        fence=fence,
                        reopen=fence and reopen[s.replica.index],
                        drain_timeout=t.drain,
                        timeout=t.update,
                    )
                    for s in targets
                },
                t.drain + 2 * t.update + t.rpc_margin,
            )
            versions = set()
            for slot in targets:
                rep, out = slot.replica, outs[slot.replica.index]
                if out.ok:
                    rep.weights_valid = True
                    version = out.value["weight_version"]
                    rep.weight_version = (
                        version if version is not None else kwargs.get("weight_version")
                    )
                    versions.add(rep.weight_version)
                    if fence and reopen[rep.index]:
                        rep.became_ready()
                    results[slot.engine_id] = ReplicaResult(
                        slot.engine_id,
                        Outcome.DONE,
                        str(rep.state),
                        seconds=time.monotonic() - begin,
                    )
                else:
                    rep.weights_valid = False
                    error = self._fail(slot, slot.head, out, method)
                    results[slot.engine_id] = ReplicaResult(
                        slot.engine_id, Outcome.FAILED, str(rep.state), error=error
                    )
            if fence and versions and self.spec.publishes_version:
                requested = kwargs.get("weight_version")
                self._weight_version = (
                    requested if requested is not None else sorted(v for v in versions if v)[-1]
                )
            self._publish()
            result = self._result(method, results, begin)
            if self._fenced_workers():
                raise with_result(self._recovery_error(f"{method}()"), result)
            return result

    def update_weights_from_tensor(
        self,
        serialized_named_tensors: Sequence[str],
        *,
        load_format: str | None = None,
        weight_version: str | None = None,
        flush_cache: bool = True,
    ) -> LifecycleResult:
        """Push tensors to every replica (``tensor`` path; ACTOR). Per-replica results.

        :raises CapabilityError: the weight source does not allow ``tensor`` updates.
        """
        return self._update(
            "update_weights_from_tensor",
            {
                "serialized_named_tensors": list(serialized_named_tensors),
                "load_format": load_format,
                "weight_version": weight_version,
                "flush_cache": flush_cache,
            },
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
    ) -> LifecycleResult:
        """Receive tensors broadcast by the trainer (``distributed`` path; ACTOR).

        The trainer must broadcast concurrently (from another thread or process).
        """
        return self._update(
            "update_weights_from_distributed",
            {
                "names": list(names),
                "dtypes": list(dtypes),
                "shapes": [list(s) for s in shapes],
                "group_name": group_name,
                "weight_version": weight_version,
            },
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
        """
        self._check("init_weights_update_group")
        with self._lock:
            slots = self._ordered()
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
        self._check("destroy_weights_update_group")
        return self._each_head(
            "destroy_weights_update_group", lambda _i: {"group_name": group_name}
        )

    def load_lora_adapter(self, lora_name: str, lora_path: str) -> LifecycleResult:
        """Load a LoRA adapter on every replica (``lora`` path; refused for STATIC models)."""
        return self._update("load_lora_adapter", {"lora_name": lora_name, "lora_path": lora_path})

    def unload_lora_adapter(self, lora_name: str) -> LifecycleResult:
        """Unload a LoRA adapter from every replica."""
        return self._update("unload_lora_adapter", {"lora_name": lora_name})

    def _each_head(self, method: str, kwargs_of: Any) -> LifecycleResult:
        with self._lock:
            self._refuse_if_closed(f"{method}()")
            self._refuse_if_fenced(f"{method}()")
            begin = time.monotonic()
            slots = [s for s in self._ordered() if s.replica.state not in (_S.FAILED, _S.STOPPING)]
            t = self.timeouts
            outs = gather(
                {
                    s.replica.index: s.head.actor.update_weights.remote(
                        method,
                        kwargs_of(s.replica.index),
                        fence=False,
                        reopen=False,
                        drain_timeout=t.drain,
                        timeout=t.update,
                    )
                    for s in slots
                },
                t.update + t.rpc_margin,
            )
            results = {}
            for slot in slots:
                out = outs[slot.replica.index]
                if out.ok:
                    results[slot.engine_id] = ReplicaResult(
                        slot.engine_id, Outcome.DONE, str(slot.replica.state)
                    )
                else:
                    results[slot.engine_id] = ReplicaResult(
                        slot.engine_id,
                        Outcome.FAILED,
                        str(slot.replica.state),
                        error=self._fail(slot, slot.head, out, method),
                    )
            self._publish()
            return self._result(method, results, begin)

    def load_checkpoint(self, version: int | None = None) -> LifecycleResult:
        """DCS: load checkpoint ``version`` (default: the newest) on every replica, if newer.

        A version equal to the published one is a no-op.

        :raises CapabilityError: the weight source has no ``disk`` path.
        :raises LifecycleError: the model has no checkpoint directory, or it holds no version.
        """
        self._check("update_weights_from_disk")
        if not self.spec.checkpoint_dir:
            raise LifecycleError(
                f"load_checkpoint of model {self.model_id!r}: its engine spec has no "
                "checkpoint_dir; set InferenceEngineSpec.checkpoint_dir"
            )
        ckpt = CheckpointDirectory(self.spec.checkpoint_dir)
        wanted = ckpt.latest() if version is None else version
        if wanted is None or wanted not in ckpt.versions():
            raise LifecycleError(
                f"load_checkpoint of model {self.model_id!r}: no checkpoint version "
                f"{'(none published)' if wanted is None else wanted} in {ckpt.root}; "
                f"available: {ckpt.versions()}"
            )
        if self._weight_version == str(wanted):
            with self._lock:
                results = {
                    s.engine_id: ReplicaResult(s.engine_id, Outcome.NOOP, str(s.replica.state))
                    for s in self._ordered()
                }
                return self._result("load_checkpoint", results, time.monotonic())
        return self._update(
            "update_weights_from_disk",
            {"model_path": ckpt.path(wanted), "weight_version": str(wanted), "load_format": None},
        )

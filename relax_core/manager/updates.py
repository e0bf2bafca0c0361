"""Weight updates behind a fence (close, drain, update, check one generation, reopen),
checked against the model's weight source; the published version moves once confirmed."""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from typing import Any

import attrs

from relax_core.engine.spec import InferenceEngineSpec
from relax_core.engine.tags import ResidentTag
from relax_core.errors import LifecycleError
from relax_core.manager.fanout import gather
from relax_core.manager.publication import Publication
from relax_core.manager.results import Outcome, ReplicaResult
from relax_core.manager.slots import ManagerTimeouts, SlotTable
from relax_core.manager.state import ReplicaState
from relax_core.manager.weights import CheckpointDirectory
from relax_core.manager.worker import UPDATE_METHODS

#: The pause modes a weight update may take instead of the fence (SGLang's, and ``abort``).
PAUSE_MODES = ("in_place", "retract", "abort")

_S = ReplicaState


@attrs.define
class WeightUpdates:
    """Weight updates of one model's replicas. Not thread-safe (the manager's lock is held)."""

    slots: SlotTable
    publication: Publication
    spec: InferenceEngineSpec
    timeouts: ManagerTimeouts

    def check(self, method: str, *, pause: str | None = None) -> None:
        """:raises CapabilityError: the weight source does not allow ``method``'s update path.
        :raises ValueError: ``pause`` is not one of :data:`PAUSE_MODES`."""
        self.spec.check(UPDATE_METHODS[method], engine_id=f"{self.slots.model_id} (every replica)")
        if pause is not None and pause not in PAUSE_MODES:
            raise ValueError(f"pause={pause!r}: one of {PAUSE_MODES} (or None: the fence)")

    def apply(
        self,
        method: str,
        kwargs: dict[str, Any],
        *,
        pause: str | None = None,
        buckets: Sequence[dict[str, Any]] = (),
    ) -> dict[str, ReplicaResult]:
        """Apply one update to every replica that holds weights, behind the fence (FAILED
        and STOPPING ones are SKIPPED). Blocking. ``buckets``: see
        :meth:`~relax_core.manager.worker.EngineWorker.update_weights`.
        :raises LifecycleError: a serving replica has no resident weights, or none has any
            (refused before anything moves)."""
        model_id = self.slots.model_id
        begin = time.monotonic()
        targets, results = [], {}
        for slot in self.slots.ordered():
            rep = slot.replica
            if rep.state is _S.FAILED or rep.state is _S.STOPPING:
                results[slot.engine_id] = slot.result(Outcome.SKIPPED, error="not serving")
            elif rep.state in (_S.READY, _S.SLEEPING) and ResidentTag.WEIGHTS in rep.resident:
                targets.append(slot)
            else:
                raise LifecycleError(
                    f"{method} of model {model_id!r}: replica {slot.engine_id} is "
                    f"{rep.state} without resident weights; onload(['weights']) first"
                )
        if not targets:
            raise LifecycleError(
                f"{method} of model {model_id!r}: no replica holds weights to update; "
                "start or onload the model first"
            )
        # SLEEPING replicas stay asleep; with ``pause`` nothing is fenced.
        fenced = {s.replica.index: s.replica.state is _S.READY and pause is None for s in targets}
        for slot in targets:
            if fenced[slot.replica.index]:
                slot.replica.admission_open = False
                slot.replica.advance(_S.DRAINING)
        self.publication.publish()
        t = self.timeouts
        outs = gather(
            {
                s.replica.index: s.head.actor.update_weights.remote(
                    method,
                    kwargs,
                    fence=pause is None,
                    reopen=fenced[s.replica.index],
                    drain_timeout=t.drain,
                    timeout=t.update,
                    pause=pause,
                    buckets=list(buckets),
                )
                for s in targets
            },
            # Each engine call has its own deadline (t.update); a bucketed update makes several.
            t.drain + (1 + max(1, len(buckets))) * t.update + t.rpc_margin,
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
                if fenced[rep.index]:
                    rep.became_ready()
                results[slot.engine_id] = slot.result(
                    Outcome.DONE, seconds=time.monotonic() - begin
                )
            else:
                rep.weights_valid = False
                error = slot.fail(slot.head, out, method)
                results[slot.engine_id] = slot.result(Outcome.FAILED, error=error)
        if versions and self.spec.publishes_version:
            requested = kwargs.get("weight_version")
            self.publication.weight_version = (
                requested if requested is not None else sorted(v for v in versions if v)[-1]
            )
        self.publication.publish()
        return results

    def each_head(
        self, method: str, kwargs_of: Callable[[int], dict[str, Any]]
    ) -> dict[str, ReplicaResult]:
        """Call ``method(**kwargs_of(index))`` on every serving replica's head, with no fence
        (admission stays as it is). One result per replica. Blocking."""
        slots = [s for s in self.slots.ordered() if s.replica.state not in (_S.FAILED, _S.STOPPING)]
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
        results = {
            s.engine_id: s.result(Outcome.DONE)
            if (out := outs[s.replica.index]).ok
            else s.result(Outcome.FAILED, error=s.fail(s.head, out, method))
            for s in slots
        }
        self.publication.publish()
        return results

    def checkpoint(self, version: int | None) -> tuple[int, str]:
        """The DCS checkpoint ``version`` (default: the newest) and its directory.
        :raises LifecycleError: the model has no checkpoint directory, or not that version."""
        model_id = self.slots.model_id
        if not self.spec.checkpoint_dir:
            raise LifecycleError(
                f"load_checkpoint of model {model_id!r}: its engine spec has no "
                "checkpoint_dir; set InferenceEngineSpec.checkpoint_dir"
            )
        ckpt = CheckpointDirectory(self.spec.checkpoint_dir)
        wanted = ckpt.latest() if version is None else version
        if wanted is None or wanted not in ckpt.versions():
            raise LifecycleError(
                f"load_checkpoint of model {model_id!r}: no checkpoint version "
                f"{'(none published)' if wanted is None else wanted} in {ckpt.root}; "
                f"available: {ckpt.versions()}"
            )
        return wanted, ckpt.path(wanted)

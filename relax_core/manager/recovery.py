"""Health checks, cleanup and rebuild, scale-out/in, shutdown and ownership of placement groups.

Rules (the reference's failure table):

- a health check probes every worker of every replica (head: one real generation; each worker:
  its process alive); an unhealthy replica is FAILED and, when asked, cleaned as a whole;
- a replica is rebuilt only when the shutdown of every one of its workers is confirmed;
- a worker actor that died without confirmed cleanup is fenced (slot, pending record and
  placement group kept, nothing rebuilt) and the call raises ``InferenceRecoveryRequired``;
- shutdown waits for every worker's shutdown, then kills the actors, then removes the
  placement groups the manager owns (borrowed ones stay); an unconfirmed step stays pending and
  the next ``shutdown()`` retries it.
"""

from __future__ import annotations

import time
from collections.abc import Iterable, Sequence
from typing import Any

from relax_core.errors import LifecycleError
from relax_core.manager.base import ManagerBase, with_result
from relax_core.manager.fanout import gather
from relax_core.manager.results import (
    HealthReport,
    LifecycleResult,
    Outcome,
    ReplicaHealth,
    ReplicaResult,
)
from relax_core.manager.slots import ReplicaSlot, _workers
from relax_core.manager.state import ReplicaState

__all__ = ["RecoveryMixin"]

_S = ReplicaState


class RecoveryMixin(ManagerBase):
    """Health, recovery, scaling and shutdown of :class:`~relax_core.manager.InferenceManager`."""

    # -- cleanup ---------------------------------------------------------------------------

    def _cleanup(self, slots: Sequence[ReplicaSlot], *, during: str) -> None:
        """Shut down every live worker of ``slots`` (in parallel), then kill confirmed actors."""
        import ray

        t = self.timeouts
        for slot in slots:
            rep = slot.replica
            rep.admission_open = False
            if rep.state is not _S.STOPPING:
                rep.advance(_S.STOPPING)
        self._publish()
        refs = {
            (s.replica.index, w.node_rank): w.actor.shutdown.remote(t.shutdown)
            for s in slots
            for w in s.workers
            if w.actor is not None and not w.fenced
        }
        outs = gather(refs, t.shutdown + t.rpc_margin)
        confirmed = []
        for (index, rank), out in outs.items():
            slot = self._slots[index]
            worker = slot.workers[rank]
            name = self._worker_name(slot, worker)
            if out.ok:
                confirmed.append(worker)
            elif out.actor_died:
                worker.fenced = True
                worker.pending = "actor died without confirmed cleanup of its engine process"
            else:
                worker.pending = f"{during}: shutdown of {name} not confirmed: {out.describe()}"
        # Every shutdown has been waited for; only now are the confirmed actors killed.
        for worker in confirmed:
            ray.kill(worker.actor, no_restart=True)
            worker.actor = None
            worker.engine_pid = None
            worker.pending = None
        self._publish()

    def _recover_slots(self, slots: Sequence[ReplicaSlot]) -> dict[str, ReplicaResult]:
        """Clean ``slots`` as wholes; rebuild those whose cleanup is confirmed (if no fence)."""
        if not slots:
            return {}
        self._cleanup(slots, during="recovery")
        fenced = bool(self._fenced_workers())
        rebuild = [s for s in slots if s.cleaned and not fenced]
        for slot in rebuild:
            rep = slot.replica
            rep.resident = frozenset()
            rep.weights_valid = False
            rep.admission_open = False
            rep.advance(_S.STARTING)
        results = self._start_slots(rebuild)
        for slot in slots:
            if slot.engine_id in results:
                continue
            reasons = [w.pending for w in slot.workers if w.pending] or [
                "not rebuilt: another worker of this model is fenced"
            ]
            results[slot.engine_id] = ReplicaResult(
                slot.engine_id, Outcome.FAILED, str(slot.replica.state), error="; ".join(reasons)
            )
        return results

    # -- health ----------------------------------------------------------------------------

    def health_check(self, *, recover: bool = True) -> HealthReport:
        """Probe every worker of every replica; fail, clean and (with ``recover``) rebuild.

        A head of a READY replica must generate one token; every worker's engine process must
        be alive. An unhealthy or already FAILED replica is FAILED (no longer published as
        routable); with ``recover`` it is cleaned as a whole and rebuilt once its cleanup is
        confirmed.

        :raises InferenceRecoveryRequired: a worker actor died without confirmed cleanup (its
            fence is kept and nothing is rebuilt); the report is on the error's ``report``.
        """
        with self._lock:
            self._refuse_if_closed("health_check()")
            t = self.timeouts
            probes = {
                (s.replica.index, w.node_rank): w.actor.probe.remote(
                    generate=w.node_rank == 0 and s.replica.state is _S.READY, timeout=t.health
                )
                for s in self._ordered()
                if s.replica.state is not _S.STOPPING
                for w in s.workers
                if w.actor is not None and not w.fenced
            }
            outs = gather(probes, t.health + t.rpc_margin)
            problems: dict[str, list[str]] = {}
            for slot in self._ordered():
                rep = slot.replica
                found = problems.setdefault(slot.engine_id, [])
                if rep.state is _S.FAILED:
                    found.append(f"replica already FAILED: {rep.error}")
                for worker in slot.workers:
                    name = self._worker_name(slot, worker)
                    if worker.fenced:
                        found.append(f"{name}: fenced ({worker.pending})")
                        continue
                    out = outs.get((rep.index, worker.node_rank))
                    if out is None:
                        continue
                    if not out.ok:
                        found.append(f"{name}: probe failed: {out.describe()}")
                        if out.actor_died:
                            self._fail(slot, worker, out, "health check")
                    elif not out.value.healthy:
                        found.append(f"{name}: {out.value.error}")
                if found and rep.state is not _S.STOPPING:
                    self._mark_failed(slot, "; ".join(found))
            self._publish()
            actions: dict[str, str] = {}
            broken = [
                s
                for s in self._ordered()
                if s.replica.state is _S.FAILED
                or (s.replica.state is _S.STOPPING and not s.cleaned and not s.retiring)
            ]
            if recover and broken:
                for engine_id, res in self._recover_slots(broken).items():
                    slot = self._slot(engine_id)
                    if slot.fenced:
                        actions[engine_id] = "fenced"
                    elif res.outcome is Outcome.DONE:
                        actions[engine_id] = "rebuilt"
                    elif slot.cleaned:
                        actions[engine_id] = "cleaned"
                    else:
                        actions[engine_id] = "pending"
            report = HealthReport(
                self.model_id,
                tuple(
                    ReplicaHealth(
                        s.engine_id,
                        healthy=not problems.get(s.engine_id),
                        state=str(s.replica.state),
                        action=actions.get(
                            s.engine_id,
                            "fenced"
                            if s.fenced
                            else ("failed" if problems.get(s.engine_id) else "none"),
                        ),
                        problems=tuple(problems.get(s.engine_id, ())),
                    )
                    for s in self._ordered()
                ),
            )
            if self._fenced_workers():
                error = self._recovery_error("health_check()")
                error.report = report  # type: ignore[attr-defined]
                raise error
            return report

    def recover(self) -> LifecycleResult:
        """Clean every FAILED replica (and retry pending cleanups) as a whole; rebuild those
        whose cleanup is confirmed. Per-replica results.

        :raises InferenceRecoveryRequired: a worker is fenced.
        """
        with self._lock:
            self._refuse_if_closed("recover()")
            self._refuse_if_fenced("recover()")
            begin = time.monotonic()
            broken = [
                s
                for s in self._ordered()
                if s.replica.state is _S.FAILED
                or (s.replica.state is _S.STOPPING and not s.retiring)
            ]
            results = self._recover_slots(broken)
            result = self._result("recover", results, begin)
            if self._fenced_workers():
                raise with_result(self._recovery_error("recover()"), result)
            return result

    def confirm_external_cleanup(self, engine_ids: Iterable[str] | None = None) -> list[str]:
        """Lift the fence of dead worker actors whose engine processes an operator confirmed gone.

        Only call this after checking the node or container (the manager cannot: the actor
        that owned the process is dead). Afterwards :meth:`recover` may rebuild the replicas
        and :meth:`shutdown` may release the placement group. Returns the workers unfenced.
        """
        with self._lock:
            wanted = None if engine_ids is None else set(engine_ids)
            cleared = []
            for slot in self._ordered():
                if wanted is not None and slot.engine_id not in wanted:
                    continue
                for worker in slot.workers:
                    if worker.fenced:
                        cleared.append(self._worker_name(slot, worker))
                        worker.fenced = False
                        worker.actor = None
                        worker.engine_pid = None
                        worker.pending = None
            return cleared

    # -- scaling ---------------------------------------------------------------------------

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
        """
        with self._lock:
            self._refuse_if_closed("scale_out()")
            self._refuse_if_fenced("scale_out()")
            nodes = self.launch.nodes_per_replica
            if (workers is None) == (count is None):
                raise ValueError("scale_out: give either workers (bundles) or count, not both")
            if workers is None:
                assert count is not None
                if count < 1:
                    raise ValueError(f"scale_out(count={count}): give at least 1")
                workers = [((),) * nodes for _ in range(count)]
            new = _workers(workers)
            group = (
                placement_group if placement_group is not None else self.placement.placement_group
            )
            taken = {
                (
                    s.placement_group.id.hex() if s.placement_group is not None else None,
                    b,
                ): s.engine_id
                for s in self._slots.values()
                for w in s.workers
                for b in w.bundles
            }
            gid = group.id.hex() if group is not None else None
            for k, replica in enumerate(new):
                if len(replica) != nodes:
                    raise ValueError(
                        f"scale_out: new replica {k} has {len(replica)} node group(s); model "
                        f"{self.model_id!r} spans {nodes} node(s) per replica: give one bundle "
                        "group per node"
                    )
                for node in replica:
                    for bundle in node:
                        if (gid, bundle) in taken:
                            raise ValueError(
                                f"scale_out: bundle {bundle} is already used by "
                                f"{taken[(gid, bundle)]}"
                            )
            if group is None and any(b for r in new for n in r for b in n):
                raise ValueError("scale_out: bundles given but no placement group")
            begin = time.monotonic()
            added = self._add_slots(new, group, owned=owned)
            results = self._start_slots(added)
            return self._result("scale_out", results, begin)

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
        with self._lock:
            self._refuse_if_closed("scale_in()")
            if (count is None) == (urls is None):
                raise ValueError("scale_in: give either count or urls, not both")
            chosen = self._choose_for_scale_in(count, urls)
            begin = time.monotonic()
            t = self.timeouts
            draining = {
                s.replica.index: s.head.actor.drain.remote(
                    strict=self.spec.strict_drain, drain_timeout=t.drain, timeout=t.offload
                )
                for s in chosen
                if s.replica.state is not _S.STOPPING
                and s.head.actor is not None
                and not s.head.fenced
            }
            for slot in chosen:
                slot.retiring = True
            self._publish()  # out of the router before the drain
            gather(draining, t.drain + t.offload + t.rpc_margin)
            self._cleanup(chosen, during="scale-in")
            results: dict[str, ReplicaResult] = {}
            for slot in chosen:
                if slot.cleaned:
                    del self._slots[slot.replica.index]
                    results[slot.engine_id] = ReplicaResult(slot.engine_id, Outcome.DONE, "REMOVED")
                else:
                    pending = [w.pending for w in slot.workers if w.pending]
                    results[slot.engine_id] = ReplicaResult(
                        slot.engine_id,
                        Outcome.FAILED,
                        str(slot.replica.state),
                        error=f"cleanup not confirmed, retry scale_in: {pending}",
                    )
            self._publish()
            result = LifecycleResult(
                "scale_in", self.model_id, tuple(results.values()), time.monotonic() - begin
            )
            if self._fenced_workers():
                raise with_result(self._recovery_error("scale_in()"), result)
            return result

    def _choose_for_scale_in(
        self, count: int | None, urls: Sequence[str] | None
    ) -> list[ReplicaSlot]:
        if urls is not None:
            by_url = {
                s.replica.base_url.rstrip("/"): s for s in self._ordered() if s.replica.base_url
            }
            chosen = []
            for url in urls:
                slot = by_url.get(url.rstrip("/"))
                if slot is None:
                    raise ValueError(
                        f"scale_in: no replica of model {self.model_id!r} is published under "
                        f"{url!r}; current URLs: {sorted(by_url)}"
                    )
                if slot not in chosen:
                    chosen.append(slot)
            return chosen
        assert count is not None
        if count < 1 or count > len(self._slots):
            raise ValueError(
                f"scale_in(count={count}): model {self.model_id!r} has "
                f"{len(self._slots)} replica(s)"
            )

        def priority(s: ReplicaSlot) -> tuple[int, int]:
            if s.replica.state is _S.STOPPING:
                rank = 0
            elif s.replica.state is _S.FAILED:
                rank = 1
            else:
                rank = 2
            return (rank, -s.replica.index)

        return sorted(self._slots.values(), key=priority)[:count]

    # -- shutdown --------------------------------------------------------------------------

    def shutdown(self) -> None:
        """Stop everything: every worker's shutdown (waited for), then the actors, then the
        placement groups this manager owns (borrowed ones are never removed). Idempotent.

        :raises LifecycleError: a step was not confirmed; it stays pending and the next
            ``shutdown()`` retries it (owned placement groups are kept until then).
        :raises InferenceRecoveryRequired: a worker actor died without confirmed cleanup;
            its placement group is kept (fence) until :meth:`confirm_external_cleanup`.
        """
        with self._lock:
            live = [s for s in self._ordered() if not s.cleaned]
            if live:
                self._cleanup(live, during="shutdown")
            pending = [
                f"{self._worker_name(s, w)}: {w.pending}"
                for s in self._ordered()
                for w in s.workers
                if w.actor is not None and not w.fenced
            ]
            if pending:
                raise LifecycleError(
                    f"model {self.model_id!r}: shutdown not confirmed for {pending}; the "
                    "placement group is kept; call shutdown() again"
                )
            if self._fenced_workers():
                raise self._recovery_error("shutdown()")
            self._remove_owned_groups()
            self._closed = True
            self._publish()

    def _remove_owned_groups(self) -> None:
        """Remove every owned placement group and confirm it is gone; borrowed ones stay."""
        import ray
        from ray.util import remove_placement_group

        errors = []
        for gid, (group, owned) in list(self._groups.items()):
            if not owned:
                continue
            try:
                remove_placement_group(group)
                deadline = time.monotonic() + 10.0
                while ray.util.placement_group_table(group).get("state", "REMOVED") != "REMOVED":
                    if time.monotonic() > deadline:
                        raise LifecycleError("still not REMOVED after 10s")
                    time.sleep(0.05)
            except Exception as exc:  # reported below and kept pending: shutdown() retries it
                self._pending_groups[gid] = f"{type(exc).__name__}: {exc}"
                errors.append(f"placement group {gid}: {type(exc).__name__}: {exc}")
                continue
            self._pending_groups.pop(gid, None)
            del self._groups[gid]
        if errors:
            raise LifecycleError(
                f"model {self.model_id!r}: removing its owned placement group(s) was not "
                f"confirmed ({'; '.join(errors)}); they stay pending: call shutdown() again"
            )

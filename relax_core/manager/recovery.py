"""Health checks, cleanup and rebuild of failed replicas, and stopping every worker.

Rules (the reference's failure table):

- a health check probes every worker of every replica (head: one real generation; each worker:
  its process alive); an unhealthy replica is FAILED and, when asked, cleaned as a whole;
- a replica is rebuilt only when the shutdown of every one of its workers is confirmed;
- a worker actor that died without confirmed cleanup is fenced (slot, pending record and
  placement group kept, nothing rebuilt) and the call raises ``InferenceRecoveryRequired``;
- a cleanup waits for every worker's shutdown, then kills the confirmed actors; an unconfirmed
  step stays pending and the next cleanup retries it.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

import attrs

from relax_core.errors import LifecycleError
from relax_core.manager.fanout import gather
from relax_core.manager.launcher import Launcher
from relax_core.manager.publication import Publication
from relax_core.manager.results import HealthReport, Outcome, ReplicaHealth, ReplicaResult
from relax_core.manager.slots import ManagerTimeouts, ReplicaSlot, SlotTable
from relax_core.manager.state import ReplicaState

__all__ = ["Recovery"]

_S = ReplicaState


@attrs.define
class Recovery:
    """Health, cleanup and rebuild of one model's replicas. Not thread-safe (the manager's
    lock is held)."""

    slots: SlotTable
    launcher: Launcher
    publication: Publication
    timeouts: ManagerTimeouts

    # -- cleanup ---------------------------------------------------------------------------

    def cleanup(self, slots: Sequence[ReplicaSlot], *, during: str) -> None:
        """STOPPING; shut down every live worker of ``slots`` (in parallel), then kill the
        actors whose shutdown is confirmed. Blocking; never raises for a worker (an unconfirmed
        shutdown stays ``pending``, a dead actor is fenced)."""
        import ray

        t = self.timeouts
        for slot in slots:
            rep = slot.replica
            rep.admission_open = False
            if rep.state is not _S.STOPPING:
                rep.advance(_S.STOPPING)
        self.publication.publish()
        refs = {
            (s.replica.index, w.node_rank): w.actor.shutdown.remote(t.shutdown)
            for s in slots
            for w in s.workers
            if w.actor is not None and not w.fenced
        }
        outs = gather(refs, t.shutdown + t.rpc_margin)
        confirmed = []
        for (index, rank), out in outs.items():
            slot = self.slots.at(index)
            worker = slot.workers[rank]
            if out.ok:
                confirmed.append(worker)
            elif out.actor_died:
                worker.fence()
            else:
                worker.pending = (
                    f"{during}: shutdown of {slot.worker_name(worker)} not confirmed: "
                    f"{out.describe()}"
                )
        # Every shutdown has been waited for; only now are the confirmed actors killed.
        for worker in confirmed:
            ray.kill(worker.actor, no_restart=True)
            worker.detach()
        self.publication.publish()

    def rebuild(self, slots: Sequence[ReplicaSlot]) -> dict[str, ReplicaResult]:
        """Clean ``slots`` as wholes; start again those whose cleanup is confirmed, unless a
        worker of the model is fenced. One result per replica. Blocking."""
        if not slots:
            return {}
        self.cleanup(slots, during="recovery")
        fenced = bool(self.slots.fenced_workers())
        rebuild = [s for s in slots if s.cleaned and not fenced]
        for slot in rebuild:
            rep = slot.replica
            rep.resident = frozenset()
            rep.weights_valid = False
            rep.admission_open = False
            rep.advance(_S.STARTING)
        results = self.launcher.start(rebuild)
        for slot in slots:
            if slot.engine_id in results:
                continue
            reasons = slot.pending or ["not rebuilt: another worker of this model is fenced"]
            results[slot.engine_id] = slot.result(Outcome.FAILED, error="; ".join(reasons))
        return results

    def recover(self) -> dict[str, ReplicaResult]:
        """Rebuild every FAILED replica, and retry every pending cleanup (not of replicas that
        scale-in is retiring). One result per replica. Blocking."""
        broken = [
            s
            for s in self.slots.ordered()
            if s.replica.state is _S.FAILED or (s.replica.state is _S.STOPPING and not s.retiring)
        ]
        return self.rebuild(broken)

    def confirm_external_cleanup(self, engine_ids: Iterable[str] | None) -> list[str]:
        """Lift the fence of ``engine_ids``' workers (default: all); return the ones lifted."""
        wanted = None if engine_ids is None else set(engine_ids)
        cleared = []
        for slot in self.slots.ordered():
            if wanted is not None and slot.engine_id not in wanted:
                continue
            for worker in slot.workers:
                if worker.fenced:
                    cleared.append(slot.worker_name(worker))
                    worker.detach()
        return cleared

    def stop_all(self) -> None:
        """Clean every replica not cleaned yet (shutdown's first step). Blocking.

        :raises LifecycleError: a live worker's shutdown was not confirmed (call again).
        """
        live = [s for s in self.slots.ordered() if not s.cleaned]
        if live:
            self.cleanup(live, during="shutdown")
        pending = [
            f"{s.worker_name(w)}: {w.pending}"
            for s in self.slots.ordered()
            for w in s.workers
            if w.actor is not None and not w.fenced
        ]
        if pending:
            raise LifecycleError(
                f"model {self.slots.model_id!r}: shutdown not confirmed for {pending}; the "
                "placement group is kept; call shutdown() again"
            )

    # -- health ----------------------------------------------------------------------------

    def health_check(self, *, recover: bool) -> HealthReport:
        """Probe every worker of every replica; fail the unhealthy ones; with ``recover``,
        clean and rebuild every broken one. Blocking; the caller raises for a fence."""
        t = self.timeouts
        probes = {
            (s.replica.index, w.node_rank): w.actor.probe.remote(
                generate=w.node_rank == 0 and s.replica.state is _S.READY, timeout=t.health
            )
            for s in self.slots.ordered()
            if s.replica.state is not _S.STOPPING
            for w in s.workers
            if w.actor is not None and not w.fenced
        }
        outs = gather(probes, t.health + t.rpc_margin)
        problems: dict[str, list[str]] = {}
        for slot in self.slots.ordered():
            rep = slot.replica
            found = problems.setdefault(slot.engine_id, [])
            if rep.state is _S.FAILED:
                found.append(f"replica already FAILED: {rep.error}")
            for worker in slot.workers:
                name = slot.worker_name(worker)
                if worker.fenced:
                    found.append(f"{name}: fenced ({worker.pending})")
                    continue
                out = outs.get((rep.index, worker.node_rank))
                if out is None:
                    continue
                if not out.ok:
                    found.append(f"{name}: probe failed: {out.describe()}")
                    if out.actor_died:
                        slot.fail(worker, out, "health check")
                elif not out.value.healthy:
                    found.append(f"{name}: {out.value.error}")
            if found and rep.state is not _S.STOPPING:
                slot.mark_failed("; ".join(found))
        self.publication.publish()
        actions: dict[str, str] = {}
        broken = [
            s
            for s in self.slots.ordered()
            if s.replica.state is _S.FAILED
            or (s.replica.state is _S.STOPPING and not s.cleaned and not s.retiring)
        ]
        if recover and broken:
            for engine_id, res in self.rebuild(broken).items():
                slot = self.slots.get(engine_id)
                if slot.fenced:
                    actions[engine_id] = "fenced"
                elif res.outcome is Outcome.DONE:
                    actions[engine_id] = "rebuilt"
                elif slot.cleaned:
                    actions[engine_id] = "cleaned"
                else:
                    actions[engine_id] = "pending"
        return HealthReport(
            self.slots.model_id,
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
                for s in self.slots.ordered()
            ),
        )

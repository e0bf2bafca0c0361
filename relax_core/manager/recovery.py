"""Health checks, cleanup and rebuild of failed replicas, and stopping every worker (the rules:
``docs/manager.md``'s "Health, recovery and the fence")."""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from typing import Any

import attrs

from relax_core.errors import LifecycleError
from relax_core.manager.fanout import CallOutcome, gather
from relax_core.manager.launcher import Launcher
from relax_core.manager.publication import Publication
from relax_core.manager.results import HealthReport, Outcome, ReplicaHealth, ReplicaResult
from relax_core.manager.slots import ManagerTimeouts, ReplicaSlot, SlotTable
from relax_core.manager.state import ReplicaState

_S = ReplicaState


@attrs.define
class Recovery:
    """Health, cleanup and rebuild of one model's replicas. Not thread-safe (the manager's
    lock is held)."""

    slots: SlotTable
    launcher: Launcher
    publication: Publication
    timeouts: ManagerTimeouts
    #: consecutive failed probes of a live replica before it is FAILED
    unhealthy_after: int = 3

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
            slot.failed_probes = 0
            rep = slot.replica
            rep.resident = frozenset()
            rep.weights_valid = False
            rep.admission_open = False
            rep.advance(_S.STARTING)
        results = self.launcher.start(rebuild, from_files=True)
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
        :raises LifecycleError: a live worker's shutdown was not confirmed (call again)."""
        if live := [s for s in self.slots.ordered() if not s.cleaned]:
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

    def plan_probes(self) -> ProbePlan:
        """What one health round probes: every live, unfenced worker of every replica that is
        not STOPPING (a head of a READY replica also generates one token), with the actor and
        the replica's transition count it is probed under. Cheap; the lock is held."""
        targets = {}
        for slot in self.slots.ordered():
            rep = slot.replica
            if rep.state is _S.STOPPING:
                continue
            for worker in slot.workers:
                if worker.actor is not None and not worker.fenced:
                    targets[(rep.index, worker.node_rank)] = _Probed(
                        worker.actor,
                        rep.transitions,
                        generate=worker.node_rank == 0 and rep.state is _S.READY,
                    )
        return targets

    def probe(self, plan: ProbePlan) -> dict[tuple[int, int], CallOutcome]:
        """Run ``plan``'s probes, all at once, each bounded by the health deadline. Blocking;
        needs no lock (it touches no slot)."""
        t = self.timeouts
        refs = {
            key: probed.actor.probe.remote(generate=probed.generate, timeout=t.health)
            for key, probed in plan.items()
        }
        return gather(refs, t.health + t.rpc_margin)

    def apply_probes(
        self, plan: ProbePlan, outs: Mapping[tuple[int, int], CallOutcome], *, recover: bool
    ) -> HealthReport:
        """Judge one round's probes; fail the replicas that are dead or failed
        ``unhealthy_after`` probes in a row; with ``recover``, clean and rebuild every broken
        one. Blocking (a rebuild); the caller holds the lock and raises for a fence. A probe
        that overlapped a lifecycle change of its replica (or whose worker was replaced) is
        ignored; the rest is :meth:`InferenceManager.health_check`'s rule."""
        problems: dict[str, list[str]] = {}
        suspects: dict[str, int] = {}
        for slot in self.slots.ordered():
            rep = slot.replica
            found = problems.setdefault(slot.engine_id, [])
            if rep.state is _S.FAILED:
                found.append(f"replica already FAILED: {rep.error}")
            soft, definite, probed_any = [], False, False
            for worker in slot.workers:
                name = slot.worker_name(worker)
                if worker.fenced:
                    found.append(f"{name}: fenced ({worker.pending})")
                    continue
                key = (rep.index, worker.node_rank)
                probed = plan.get(key)
                out = outs.get(key)
                if probed is None or out is None or worker.actor is not probed.actor:
                    continue  # not probed this round, or the worker was replaced since
                if out.actor_died:
                    found.append(f"{name}: probe failed: {out.describe()}")
                    slot.fail(worker, out, "health check")
                    definite = True
                    continue
                if rep.transitions != probed.transitions:
                    continue  # the replica changed state while it was probed: stale
                probed_any = True
                if not out.ok:
                    soft.append(f"{name}: probe failed: {out.describe()}")
                elif not out.value.alive or out.value.pid is None:
                    found.append(f"{name}: {out.value.error}")
                    definite = True
                elif not out.value.healthy:
                    soft.append(f"{name}: {out.value.error}")
            if soft and not definite and rep.state is not _S.FAILED:
                slot.failed_probes += 1
                suspects[slot.engine_id] = slot.failed_probes
                if slot.failed_probes < self.unhealthy_after:
                    found.extend(
                        f"{p} (failed probe {slot.failed_probes} of {self.unhealthy_after} "
                        "before FAILED)"
                        for p in soft
                    )
                    continue
                found.extend(f"{p} ({slot.failed_probes} probes failed in a row)" for p in soft)
            elif probed_any and not soft and not definite:
                slot.failed_probes = 0
            failing = definite or soft or rep.state is _S.FAILED or slot.fenced
            if found and failing and rep.state is not _S.STOPPING:
                slot.mark_failed("; ".join(found))
        self.publication.publish()
        broken = [
            s
            for s in self.slots.ordered()
            if s.replica.state is _S.FAILED
            or (s.replica.state is _S.STOPPING and not s.cleaned and not s.retiring)
        ]
        rebuilt = self.rebuild(broken) if recover else {}
        verdicts = []
        for s in self.slots.ordered():
            found = problems.get(s.engine_id, [])
            res = rebuilt.get(s.engine_id)
            if s.fenced:
                action = "fenced"
            elif res is not None and res.outcome is Outcome.DONE:
                action = "rebuilt"
            elif res is not None:
                action = "cleaned" if s.cleaned else "pending"
            elif not found:
                action = "none"
            elif s.replica.state is _S.FAILED:
                action = "failed"
            else:
                action = "suspect"
            verdicts.append(
                ReplicaHealth(
                    s.engine_id,
                    healthy=not found,
                    state=str(s.replica.state),
                    action=action,
                    problems=tuple(found),
                    failed_probes=suspects.get(s.engine_id, 0),
                )
            )
        return HealthReport(self.slots.model_id, tuple(verdicts))


@attrs.frozen
class _Probed:
    """One worker probed in a round: its actor and its replica's transition count then."""

    actor: Any
    transitions: int
    generate: bool


#: The workers one health round probes, by ``(replica index, node rank)``.
ProbePlan = dict[tuple[int, int], _Probed]

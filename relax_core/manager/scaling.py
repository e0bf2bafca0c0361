"""Scale-out and scale-in: replicas added with one slot per node, or drained, cleaned and
removed (a partially cleaned one stays STOPPING under its last URL; retry by that URL)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import attrs

from relax_core.manager.fanout import gather
from relax_core.manager.groups import PlacementGroups
from relax_core.manager.launcher import Launcher
from relax_core.manager.publication import Publication
from relax_core.manager.recovery import Recovery
from relax_core.manager.results import Outcome, ReplicaResult
from relax_core.manager.slots import ManagerTimeouts, ReplicaSlot, SlotTable, _workers
from relax_core.manager.state import ReplicaState

_S = ReplicaState


@attrs.define
class Scaling:
    """Adding and removing replicas of one model. Not thread-safe (the manager's lock is held)."""

    slots: SlotTable
    groups: PlacementGroups
    launcher: Launcher
    recovery: Recovery
    publication: Publication
    strict_drain: bool
    timeouts: ManagerTimeouts

    def add(
        self, workers: Sequence[Sequence[Sequence[int]]], group: Any, *, owned: bool
    ) -> list[ReplicaSlot]:
        """New STARTING replicas on ``group`` (checked by :meth:`check_new`; not started)."""
        self.groups.use(group, owned=owned)
        return self.slots.add(workers, group)

    def check_new(
        self, workers: Sequence[Sequence[Sequence[int]]] | None, count: int | None, group: Any
    ) -> tuple[tuple[tuple[int, ...], ...], ...]:
        """The bundles of the replicas to add: ``workers``, or ``count`` unplaced ones.
        :raises ValueError: both or neither, a bad count or node count, a bundle taken."""
        nodes = self.launcher.launch.nodes_per_replica
        if (workers is None) == (count is None):
            raise ValueError("scale_out: give either workers (bundles) or count, not both")
        if workers is None:
            assert count is not None
            if count < 1:
                raise ValueError(f"scale_out(count={count}): give at least 1")
            workers = [((),) * nodes for _ in range(count)]
        new = _workers(workers)
        taken = self.slots.bundle_users()
        gid = group.id.hex() if group is not None else None
        for k, replica in enumerate(new):
            if len(replica) != nodes:
                raise ValueError(
                    f"scale_out: new replica {k} has {len(replica)} node group(s); model "
                    f"{self.slots.model_id!r} spans {nodes} node(s) per replica: give one "
                    "bundle group per node"
                )
            for node in replica:
                for bundle in node:
                    if (gid, bundle) in taken:
                        raise ValueError(
                            f"scale_out: bundle {bundle} is already used by {taken[(gid, bundle)]}"
                        )
        if group is None and any(b for r in new for n in r for b in n):
            raise ValueError("scale_out: bundles given but no placement group")
        return new

    def choose(self, count: int | None, urls: Sequence[str] | None) -> list[ReplicaSlot]:
        """The replicas to remove: those under ``urls``, or ``count`` (partially cleaned,
        FAILED, newest). :raises ValueError: an unknown URL, or a count out of range."""
        model_id = self.slots.model_id
        if urls is not None:
            by_url = {
                s.replica.base_url.rstrip("/"): s
                for s in self.slots.ordered()
                if s.replica.base_url
            }
            chosen = []
            for url in urls:
                slot = by_url.get(url.rstrip("/"))
                if slot is None:
                    raise ValueError(
                        f"scale_in: no replica of model {model_id!r} is published under "
                        f"{url!r}; current URLs: {sorted(by_url)}"
                    )
                if slot not in chosen:
                    chosen.append(slot)
            return chosen
        assert count is not None
        if count < 1 or count > len(self.slots):
            raise ValueError(
                f"scale_in(count={count}): model {model_id!r} has {len(self.slots)} replica(s)"
            )
        rank = {_S.STOPPING: 0, _S.FAILED: 1}
        slots = self.slots.ordered()
        return sorted(slots, key=lambda s: (rank.get(s.replica.state, 2), -s.replica.index))[:count]

    def scale_in(self, chosen: list[ReplicaSlot]) -> dict[str, ReplicaResult]:
        """Drain ``chosen``, clean them and remove those whose cleanup is confirmed (DONE,
        state ``REMOVED``); the others stay STOPPING (FAILED: retry). Blocking."""
        t = self.timeouts
        for slot in chosen:
            slot.retiring = True
        self.publication.publish()  # out of the router before the drain starts
        draining = {
            s.replica.index: s.head.actor.drain.remote(
                strict=self.strict_drain, drain_timeout=t.drain, timeout=t.offload
            )
            for s in chosen
            if s.replica.state is not _S.STOPPING and s.live_head is not None
        }
        gather(draining, t.drain + t.offload + t.rpc_margin)
        self.recovery.cleanup(chosen, during="scale-in")
        results: dict[str, ReplicaResult] = {}
        for slot in chosen:
            if slot.cleaned:
                self.slots.remove(slot)
                results[slot.engine_id] = ReplicaResult(slot.engine_id, Outcome.DONE, "REMOVED")
            else:
                results[slot.engine_id] = slot.result(
                    Outcome.FAILED, error=f"cleanup not confirmed, retry scale_in: {slot.pending}"
                )
        self.publication.publish()
        return results

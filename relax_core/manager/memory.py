"""Onload and offload: resident tags released and resumed per replica, in parallel.

Each replica's plan comes from the pure functions of :mod:`.state` (only resident tags are
released, only missing ones resumed), so repeated calls are no-ops; each replica's outcome is
its own (partial success: confirmed ones SLEEPING/READY, unconfirmed ones FAILED). Both go to
the replica heads through :class:`~.heads.HeadCalls` (the private control channel by default).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any, Protocol, TypeVar

from relax_core.errors import NotApplicable
from relax_core.manager.heads import HeadCalls
from relax_core.manager.publication import Publication
from relax_core.manager.results import Outcome, ReplicaResult
from relax_core.manager.slots import ManagerTimeouts, ReplicaSlot, SlotTable
from relax_core.manager.state import (
    OffloadPlan,
    OnloadPlan,
    Replica,
    ReplicaState,
    plan_offload,
    plan_onload,
)

__all__ = ["Memory"]

_S = ReplicaState


class _Plan(Protocol):
    @property
    def tags(self) -> tuple[str, ...]: ...

    @property
    def noop(self) -> bool: ...


_P = TypeVar("_P", bound=_Plan)


class Memory:
    """Offload and onload of one model's replicas. Not thread-safe (the manager's lock is held).

    :param strict_drain: an offload waits for in-flight requests (up to the drain deadline)
        before aborting them; otherwise it aborts them at once.
    """

    def __init__(
        self,
        slots: SlotTable,
        heads: HeadCalls,
        publication: Publication,
        *,
        strict_drain: bool,
        timeouts: ManagerTimeouts,
    ) -> None:
        self.slots = slots
        self.heads = heads
        self.publication = publication
        self.strict_drain = strict_drain
        self.timeouts = timeouts

    def offload(self, slots: list[ReplicaSlot], wanted: frozenset[str]) -> dict[str, ReplicaResult]:
        """Release ``wanted`` on ``slots``: close admission (DRAINING), drain, release, confirm
        → SLEEPING; unconfirmed → FAILED. One result per replica. Blocking."""
        t = self.timeouts

        def drain(rep: Replica, plan: OffloadPlan) -> dict[str, Any]:
            rep.admission_open = False
            rep.advance(_S.DRAINING)
            return {
                "tags": list(plan.tags),
                "strict": self.strict_drain,
                "drain_timeout": t.drain,
                "timeout": t.offload,
            }

        def released(rep: Replica, plan: OffloadPlan) -> None:
            rep.resident -= frozenset(plan.tags)
            rep.advance(_S.SLEEPING)

        return self._run(
            "offload",
            slots,
            plan_offload,
            wanted,
            begin=drain,
            confirm=released,
            timeout=t.drain + t.offload + t.rpc_margin,
        )

    def onload(self, slots: list[ReplicaSlot], wanted: frozenset[str]) -> dict[str, ReplicaResult]:
        """Resume what is missing of ``wanted`` on the SLEEPING ``slots`` (ONLOADING); once
        every tag is resident, check one generation and reopen → READY, else stay SLEEPING;
        unconfirmed → FAILED. One result per replica. Blocking."""
        t = self.timeouts

        def resume(rep: Replica, plan: OnloadPlan) -> dict[str, Any]:
            rep.advance(_S.ONLOADING)
            return {"tags": list(plan.tags), "reopen": plan.reopen, "timeout": t.onload}

        def resumed(rep: Replica, plan: OnloadPlan) -> None:
            rep.resident |= frozenset(plan.tags)
            if plan.reopen:
                rep.became_ready()
            else:
                rep.advance(_S.SLEEPING)

        return self._run(
            "onload",
            slots,
            plan_onload,
            wanted,
            begin=resume,
            confirm=resumed,
            timeout=t.onload * 2 + t.rpc_margin,
        )

    def _run(
        self,
        method: str,
        slots: list[ReplicaSlot],
        planner: Callable[[Replica, frozenset[str]], _P],
        wanted: frozenset[str],
        *,
        begin: Callable[[Replica, _P], Mapping[str, Any]],
        confirm: Callable[[Replica, _P], None],
        timeout: float,
    ) -> dict[str, ReplicaResult]:
        """Plan each replica; ``begin`` moves it into its transitional state and gives the head
        call's arguments; every head is called at once (published before and after); ``confirm``
        records each confirmed step, and each unconfirmed one fails its replica."""
        results: dict[str, ReplicaResult] = {}
        todo: dict[int, tuple[_P, Mapping[str, Any]]] = {}
        for slot in slots:
            early, plan = _triage(slot, planner, wanted)
            if early is not None:
                results[slot.engine_id] = early
                continue
            assert plan is not None
            todo[slot.replica.index] = (plan, begin(slot.replica, plan))
        if not todo:
            return results
        self.publication.publish()
        outs = self.heads.call(method, {i: kwargs for i, (_, kwargs) in todo.items()}, timeout)
        for i, (plan, _) in todo.items():
            slot, out = self.slots.at(i), outs[i]
            if out.ok:
                confirm(slot.replica, plan)
                results[slot.engine_id] = slot.result(
                    Outcome.DONE, tags=plan.tags, seconds=out.value
                )
            else:
                # FAILED now (it was DRAINING or ONLOADING).
                error = slot.fail(slot.head, out, method)
                results[slot.engine_id] = slot.result(Outcome.FAILED, tags=plan.tags, error=error)
        self.publication.publish()
        return results


def _triage(
    slot: ReplicaSlot, planner: Callable[[Replica, frozenset[str]], _P], wanted: frozenset[str]
) -> tuple[ReplicaResult | None, _P | None]:
    """The replica's plan, or the result that settles it without a call (FAILED, cleaned,
    SKIPPED when the plan does not apply, NOOP when nothing is to do)."""
    rep = slot.replica
    if rep.state is _S.FAILED:
        error = (
            f"replica is FAILED ({rep.error}); its memory is not known to be free: "
            "recover() or shut it down"
        )
        return slot.result(Outcome.FAILED, error=error), None
    if rep.state is _S.STOPPING:
        if slot.cleaned:
            return slot.result(Outcome.NOOP), None
        return slot.result(Outcome.FAILED, error=f"cleanup pending: {slot.pending}"), None
    try:
        plan = planner(rep, wanted)
    except NotApplicable as exc:
        return slot.result(Outcome.SKIPPED, error=str(exc)), None
    if plan.noop:
        return slot.result(Outcome.NOOP), None
    return None, plan

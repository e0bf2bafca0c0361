"""Onload and offload: resident tags released and resumed per replica, in parallel, planned by
:mod:`.state` (so repeated calls are no-ops), sent through :class:`~.heads.HeadCalls`."""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterable, Mapping
from itertools import pairwise
from typing import Any, TypeVar

import attrs

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

log = logging.getLogger(__name__)

_S = ReplicaState


_P = TypeVar("_P", OffloadPlan, OnloadPlan)
#: What an onload or offload returns: one result per engine id, and the seconds of each hop.
Ran = tuple[dict[str, ReplicaResult], dict[str, float]]


@attrs.define
class Memory:
    """Offload and onload of one model's replicas. Not thread-safe (the manager's lock is held).
    ``strict_drain``: an offload waits for in-flight requests before aborting them."""

    slots: SlotTable
    heads: HeadCalls
    publication: Publication
    strict_drain: bool
    timeouts: ManagerTimeouts

    def offload(
        self, engine_ids: Iterable[str] | None, wanted: frozenset[str], *, abort: bool = False
    ) -> Ran:
        """Release ``wanted`` on the replicas ``engine_ids`` (``None``: all): close admission
        (DRAINING), drain (``abort``: abort the requests in flight at once instead), release,
        confirm → SLEEPING; unconfirmed → FAILED. :data:`Ran`. Blocking.
        :raises KeyError: an unknown engine id."""
        t = self.timeouts
        drain = {"strict": self.strict_drain, "drain_timeout": t.drain, "timeout": t.offload}
        return self._run(
            "offload",
            self.slots.select(engine_ids),
            plan_offload,
            wanted,
            lambda plan: {"tags": list(plan.tags), **drain, "abort": abort},
            t.drain + t.offload + t.rpc_margin,
        )

    def onload(self, engine_ids: Iterable[str] | None, wanted: frozenset[str]) -> Ran:
        """Resume what is missing of ``wanted`` on the SLEEPING replicas ``engine_ids``
        (``None``: all; ONLOADING); once every tag is resident, check one generation and reopen
        → READY, else stay SLEEPING; unconfirmed → FAILED. :data:`Ran`. Blocking.
        :raises KeyError: an unknown engine id."""
        t = self.timeouts
        return self._run(
            "onload",
            self.slots.select(engine_ids),
            plan_onload,
            wanted,
            lambda plan: {"tags": list(plan.tags), "reopen": plan.reopen, "timeout": t.onload},
            t.onload * 2 + t.rpc_margin,
        )

    def _run(
        self,
        method: str,
        slots: list[ReplicaSlot],
        planner: Callable[[Replica, frozenset[str]], _P],
        wanted: frozenset[str],
        kwargs: Callable[[_P], Mapping[str, Any]],
        timeout: float,
    ) -> Ran:
        """Plan each replica and begin its step; call ``method(**kwargs(plan))`` on every head
        at once (published before and after); confirm each confirmed step, fail the others.
        The results, and the seconds of each hop (see ``LifecycleResult.timings``)."""
        results: dict[str, ReplicaResult] = {}
        todo: dict[int, _P] = {}
        for slot in slots:
            plan = _triage(slot, planner, wanted)
            if isinstance(plan, ReplicaResult):
                results[slot.engine_id] = plan
                continue
            plan.begin(slot.replica)
            todo[slot.replica.index] = plan
        if not todo:
            return results, {}
        marks = {"": time.perf_counter()}  # the end of each hop, in order
        # Published while the heads work: each head closes its own admission first thing.
        published = self.publication.publish_begin()
        marks["publish_begin"] = time.perf_counter()
        outs = self.heads.call(method, {i: kwargs(plan) for i, plan in todo.items()}, timeout)
        marks["heads"] = time.perf_counter()
        for i, plan in todo.items():
            slot, out = self.slots.at(i), outs[i]
            if out.ok:
                plan.confirm(slot.replica)
                timings = dict(out.value)
                seconds = timings.pop("seconds")
                results[slot.engine_id] = slot.result(
                    Outcome.DONE, tags=plan.tags, seconds=seconds, timings=timings
                )
            else:
                # FAILED now (it was DRAINING or ONLOADING).
                error = slot.fail(slot.head, out, method)
                results[slot.engine_id] = slot.result(Outcome.FAILED, tags=plan.tags, error=error)
        try:
            published()
        except Exception as exc:  # the publication below sends the whole view again (or raises)
            log.warning("%s: publishing before the %s failed: %s", self.slots.model_id, method, exc)
        marks["publish_wait"] = time.perf_counter()
        self.publication.publish()
        marks["publish"] = time.perf_counter()
        return results, {hop: marks[hop] - marks[before] for before, hop in pairwise(marks)}


def _triage(
    slot: ReplicaSlot, planner: Callable[[Replica, frozenset[str]], _P], wanted: frozenset[str]
) -> ReplicaResult | _P:
    """The replica's plan, or the result that settles it without a call (FAILED, cleaned,
    SKIPPED when the plan does not apply, NOOP when nothing is to do)."""
    rep = slot.replica
    if rep.state is _S.FAILED:
        error = (
            f"replica is FAILED ({rep.error}); its memory is not known to be free: "
            "recover() or shut it down"
        )
        return slot.result(Outcome.FAILED, error=error)
    if rep.state is _S.STOPPING:
        if slot.cleaned:
            return slot.result(Outcome.NOOP)
        return slot.result(Outcome.FAILED, error=f"cleanup pending: {slot.pending}")
    try:
        plan = planner(rep, wanted)
    except NotApplicable as exc:
        return slot.result(Outcome.SKIPPED, error=str(exc))
    return slot.result(Outcome.NOOP) if plan.noop else plan

"""Onload and offload: resident tags released and resumed per replica, in parallel.

Each replica's plan comes from the pure functions of :mod:`.state` (only resident tags are
released, only missing ones resumed), so repeated calls are no-ops; each replica's outcome is
its own (partial success: confirmed ones SLEEPING/READY, unconfirmed ones FAILED).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable
from typing import Protocol, TypeVar

from relax_core.manager.base import ManagerBase, with_result
from relax_core.manager.results import LifecycleResult, Outcome, ReplicaResult
from relax_core.manager.slots import ReplicaSlot
from relax_core.manager.state import (
    NotApplicable,
    Replica,
    ReplicaState,
    normalize_tags,
    plan_offload,
    plan_onload,
)

__all__ = ["MemoryMixin"]

_S = ReplicaState


class _Plan(Protocol):
    @property
    def noop(self) -> bool: ...


_P = TypeVar("_P", bound=_Plan)


class MemoryMixin(ManagerBase):
    """Onload and offload of :class:`~relax_core.manager.InferenceManager`."""

    def offload(
        self, tags: Iterable[str] | None = None, *, engine_ids: Iterable[str] | None = None
    ) -> LifecycleResult:
        """Release ``tags`` (default: all) on every replica; per-replica results.

        ``engine_ids`` limits the call to those replicas (default: all).
        Each replica: close admission (DRAINING, no longer direct-eligible), drain in-flight
        requests (strict: wait up to the drain deadline, then abort), release, confirm →
        SLEEPING. A replica whose release is not confirmed is FAILED: its memory is NOT known
        to be free. Tags already released are skipped, so a repeated offload is a no-op.

        :raises InferenceRecoveryRequired: a worker is fenced (before or during the call).
        """
        wanted = normalize_tags(tags, where="offload(tags)")
        with self._lock:
            self._refuse_if_closed("offload()")
            self._refuse_if_fenced("offload()")
            slots = self._select(engine_ids)
            begin = time.monotonic()
            results: dict[str, ReplicaResult] = {}
            todo: dict[int, tuple[str, ...]] = {}
            for slot in slots:
                rep = slot.replica
                early, plan = self._triage(slot, plan_offload, wanted)
                if early is not None:
                    results[slot.engine_id] = early
                    continue
                assert plan is not None
                rep.admission_open = False
                rep.advance(_S.DRAINING)
                todo[rep.index] = plan.tags
            if todo:
                self._publish()
                t = self.timeouts
                outs = self._call_heads(
                    "offload",
                    {
                        i: {
                            "tags": list(tags),
                            "strict": self.spec.strict_drain,
                            "drain_timeout": t.drain,
                            "timeout": t.offload,
                        }
                        for i, tags in todo.items()
                    },
                    t.drain + t.offload + t.rpc_margin,
                )
                for i, tags in todo.items():
                    slot, out = self._slots[i], outs[i]
                    if out.ok:
                        slot.replica.resident -= frozenset(tags)
                        slot.replica.advance(_S.SLEEPING)
                        results[slot.engine_id] = ReplicaResult(
                            slot.engine_id, Outcome.DONE, str(_S.SLEEPING), tags, seconds=out.value
                        )
                    else:
                        error = self._fail(slot, slot.head, out, "offload")
                        results[slot.engine_id] = ReplicaResult(
                            slot.engine_id, Outcome.FAILED, str(_S.FAILED), tags, error=error
                        )
                self._publish()
            result = self._result("offload", results, begin)
            if self._fenced_workers():
                raise with_result(self._recovery_error("offload()"), result)
            return result

    def onload(
        self, tags: Iterable[str] | None = None, *, engine_ids: Iterable[str] | None = None
    ) -> LifecycleResult:
        """Resume the missing ``tags`` (default: all) on every SLEEPING replica.

        ``engine_ids`` limits the call to those replicas (default: all).
        Each replica: ONLOADING, resume only what is missing (weights first), and — once every
        tag is resident — check one generation and reopen admission → READY; with a subset of
        tags it stays SLEEPING. READY replicas are a no-op. A replica whose resume is not
        confirmed is FAILED.

        :raises InferenceRecoveryRequired: a worker is fenced (before or during the call).
        """
        wanted = normalize_tags(tags, where="onload(tags)")
        with self._lock:
            self._refuse_if_closed("onload()")
            self._refuse_if_fenced("onload()")
            slots = self._select(engine_ids)
            begin = time.monotonic()
            results: dict[str, ReplicaResult] = {}
            todo: dict[int, tuple[tuple[str, ...], bool]] = {}
            for slot in slots:
                rep = slot.replica
                early, plan = self._triage(slot, plan_onload, wanted)
                if early is not None:
                    results[slot.engine_id] = early
                    continue
                assert plan is not None
                rep.advance(_S.ONLOADING)
                todo[rep.index] = (plan.tags, plan.reopen)
            if todo:
                self._publish()
                t = self.timeouts
                outs = self._call_heads(
                    "onload",
                    {
                        i: {"tags": list(tags), "reopen": reopen, "timeout": t.onload}
                        for i, (tags, reopen) in todo.items()
                    },
                    t.onload * 2 + t.rpc_margin,
                )
                for i, (tags, reopen) in todo.items():
                    slot, out = self._slots[i], outs[i]
                    rep = slot.replica
                    if out.ok:
                        rep.resident |= frozenset(tags)
                        if reopen:
                            rep.became_ready()
                        else:
                            rep.advance(_S.SLEEPING)
                        results[slot.engine_id] = ReplicaResult(
                            slot.engine_id, Outcome.DONE, str(rep.state), tags, seconds=out.value
                        )
                    else:
                        error = self._fail(slot, slot.head, out, "onload")
                        results[slot.engine_id] = ReplicaResult(
                            slot.engine_id, Outcome.FAILED, str(_S.FAILED), tags, error=error
                        )
                self._publish()
            result = self._result("onload", results, begin)
            if self._fenced_workers():
                raise with_result(self._recovery_error("onload()"), result)
            return result

    def _triage(
        self,
        slot: ReplicaSlot,
        planner: Callable[[Replica, frozenset[str]], _P],
        wanted: frozenset[str],
    ) -> tuple[ReplicaResult | None, _P | None]:
        """The replica's plan, or the result that settles it without a call (FAILED, cleaned,
        SKIPPED when the plan does not apply, NOOP when nothing is to do)."""
        early = self._not_applicable(slot)
        if early is not None:
            return early, None
        rep = slot.replica
        try:
            plan = planner(rep, wanted)
        except NotApplicable as exc:
            skipped = ReplicaResult(slot.engine_id, Outcome.SKIPPED, str(rep.state), error=str(exc))
            return skipped, None
        if plan.noop:
            return ReplicaResult(slot.engine_id, Outcome.NOOP, str(rep.state)), None
        return None, plan

    def _not_applicable(self, slot: ReplicaSlot) -> ReplicaResult | None:
        rep = slot.replica
        if rep.state is _S.FAILED:
            return ReplicaResult(
                slot.engine_id,
                Outcome.FAILED,
                str(rep.state),
                error=f"replica is FAILED ({rep.error}); its memory is not known to be free: "
                "recover() or shut it down",
            )
        if rep.state is _S.STOPPING:
            if slot.cleaned:
                return ReplicaResult(slot.engine_id, Outcome.NOOP, str(rep.state))
            pending = [w.pending for w in slot.workers if w.pending]
            return ReplicaResult(
                slot.engine_id, Outcome.FAILED, str(rep.state), error=f"cleanup pending: {pending}"
            )
        return None

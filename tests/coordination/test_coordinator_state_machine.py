"""The LifecycleCoordinator against random interleavings, with real asyncio.

Hypothesis drives a real coordinator on a real event loop through random sequences of every
call (begin_batch, acknowledgments, activate/deactivate with new, repeated and reused operation
ids, student scoring, fail_batch, sink puts and commits with real and forged receipts, waiters,
operator resets) while the fake manager handles succeed, fail, raise, hang or answer late.

The handles are fakes on purpose: an engine that hangs forever or answers after an exact
deadline, thousands of times, is what one machine cannot produce with real engines (the real
faults — SIGSTOP, kill -9 — are in test_deferred_real.py). Each fake models the GPU it would
hold ("resident": an onload that began and was not followed by a confirmed offload), so the
safety invariant is checked on what the GPUs would hold, not only on the lease table.

Invariants, after every step:

- the roles of one defer slice that are not SLEEPING always fit beside each other (one at a time
  under the default residency; genrm and teacher together under the residency plan of the second
  machine, never rollout beside either), and no role starts loading while a role of its slice it
  does not fit beside may still hold the GPUs (confirmed offloads only free them);
- a BLOCKED lease is left only by the operator reset (never by a late reply);
- a batch is committed only while every role is SLEEPING and with the receipt of a successful
  sink put of its partition;
- every waiter wakes on commit (with the receipt) or on failure (with BatchFailedError);
- an operation id is never executed twice;
- the coordinator raises nothing but its own errors.
"""

from __future__ import annotations

import asyncio
import contextvars
from typing import Any

from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from relax_core.coordination import (
    BatchState,
    LeaseState,
    LifecycleCoordinator,
    SinkReceipt,
    partition_name,
)
from relax_core.coordination.residency import ResidencyPlan, SliceResidency
from relax_core.errors import BatchFailedError, CoordinationError
from relax_core.manager import LifecycleResult, Outcome, ReplicaResult
from tests.support.machines import machine_settings, misbehave

DEADLINE = 0.001
GEN = "rollout"
SLICES = {"rollout": "A", "genrm": "A", "teacher": "A", "rm2": "B"}
DEFERRED = ("genrm", "teacher", "rm2")
BEHAVIOURS = ("ok", "ok", "ok", "fail", "raise", "hang", "late")
OP: contextvars.ContextVar[str | None] = contextvars.ContextVar("op", default=None)


def result(operation: str, role: str, ok: bool) -> LifecycleResult:
    state = ("READY" if operation == "onload" else "SLEEPING") if ok else "FAILED"
    outcome = Outcome.DONE if ok else Outcome.FAILED
    replica = ReplicaResult(f"{role}/replica-0", outcome, state, error=None if ok else "boom")
    return LifecycleResult(operation, role, (replica,))


class Gpu:
    """What the GPUs of each slice would hold, and every safety violation seen."""

    def __init__(self, residency: ResidencyPlan) -> None:
        self.residency = residency
        self.resident: set[str] = set()
        self.violations: list[str] = []

    def load(self, role: str) -> None:
        others = {r for r in self.resident if r != role and SLICES[r] == SLICES[role]}
        if others and not self.residency.fits(SLICES[role], {*others, role}):
            self.violations.append(f"{role} began loading while {others} may hold slice")
        self.resident.add(role)


class FakeHandle:
    """A manager handle whose next call succeeds, fails, raises, hangs or answers late."""

    def __init__(self, role: str, gpu: Gpu) -> None:
        self.role = role
        self.name = f"{role}.model"
        self.gpu = gpu
        self.next = "ok"
        self.calls: list[str | None] = []
        self.never = asyncio.Event()

    async def _call(self, operation: str) -> LifecycleResult:
        behaviour, self.next = self.next, "ok"
        self.calls.append(OP.get())
        if operation == "onload":
            self.gpu.load(self.role)
        await misbehave(behaviour, self.never, DEADLINE * 3, f"{self.role} {operation}")
        ok = behaviour != "fail"
        if operation == "offload" and ok:
            self.gpu.resident.discard(self.role)
        return result(operation, self.role, ok)

    async def onload(self) -> LifecycleResult:
        return await self._call("onload")

    async def offload(self) -> LifecycleResult:
        return await self._call("offload")


#: The arguments of a lease call: a deferred role, and (see ``_op``) whether its operation id
#: is new, an earlier one with its earlier request (a retry) or with another (refused).
LEASE_CALL = {
    "role": st.sampled_from(DEFERRED),
    "choice": st.sampled_from(["new", "new", "repeat", "reuse"]),
    "pick": st.sampled_from([0, 0, 0, 1, 2, 5]),
}


class CoordinatorMachine(RuleBasedStateMachine):
    #: Which roles of a slice may be resident together (default: one at a time).
    RESIDENCY = ResidencyPlan()

    def __init__(self) -> None:
        super().__init__()
        self.loop = asyncio.new_event_loop()
        self.gpu = Gpu(self.RESIDENCY)
        self.handles = {r: FakeHandle(r, self.gpu) for r in DEFERRED}
        self.coord = LifecycleCoordinator(
            slices=SLICES,
            managers={r: [h] for r, h in self.handles.items()},
            generation_role=GEN,
            operation_timeout=DEADLINE,
            residency=self.RESIDENCY,
        )
        self.next_batch = 0
        self.current: int | None = None
        self.ops = 0
        self.history: list[tuple[str, str, str, int]] = []
        self.good_receipts: dict[int, SinkReceipt] = {}
        self.committed: set[int] = set()
        self.waiters: list[tuple[int, asyncio.Task[Any]]] = []
        self.tasks: list[asyncio.Task[Any]] = []
        self.before = self.coord.leases()
        self.reset_role: str | None = None
        self.errors: list[BaseException] = []

    # -- driving the loop -------------------------------------------------------------------

    def run(self, coro: Any, op: str | None = None) -> asyncio.Task[Any]:
        self.before = self.coord.leases()
        self.reset_role = None
        ctx = contextvars.copy_context()
        ctx.run(OP.set, op)
        task = self.loop.create_task(coro, context=ctx)
        self.tasks.append(task)
        self.loop.run_until_complete(asyncio.wait([task], timeout=DEADLINE * 20))
        self.settle()
        return task

    def settle(self) -> None:
        for _ in range(4):
            self.loop.run_until_complete(asyncio.sleep(0))

    def outcome(self, task: asyncio.Task[Any]) -> Any:
        if not task.done():
            return None
        if task.cancelled():
            return None
        exc = task.exception()
        if exc is not None:
            if not isinstance(exc, CoordinationError):
                self.errors.append(exc)
            return exc
        return task.result()

    # -- the generation role ----------------------------------------------------------------

    @rule(which=st.sampled_from(["next", "next", "same", "older"]))
    def begin_batch(self, which: str) -> None:
        if which == "next":
            batch = self.next_batch
        elif which == "same":
            batch = self.current if self.current is not None else self.next_batch
        else:
            batch = max(0, self.next_batch - 2)
        task = self.run(self.coord.begin_batch(batch))
        out = self.outcome(task)
        if out is BatchState.PENDING and batch != self.current:
            # The producer onloads rollout now that it holds the lease.
            assert self.coord.lease(GEN) is LeaseState.ACTIVE
            self.gpu.load(GEN)
            self.current = batch
            self.next_batch = batch + 1
        if out is BatchState.COMMITTED:
            assert batch in self.committed

    @precondition(lambda self: self.current is not None)
    @rule(confirmed=st.sampled_from([True, True, True, False]))
    def acknowledge_rollout(self, confirmed: bool) -> None:
        self._acknowledge(confirmed)

    def _acknowledge(self, confirmed: bool) -> None:
        assert self.current is not None
        if confirmed:
            self.gpu.resident.discard(GEN)  # the local offload was confirmed
        offload = result("offload", GEN, confirmed)
        self.run(self.coord.acknowledge_rollout_offloaded(self.current, offload))
        if not confirmed:
            assert self.coord.lease(GEN) in (LeaseState.BLOCKED, LeaseState.SLEEPING)

    @precondition(lambda self: self.current is not None)
    @rule()
    def begin_student_scoring(self) -> None:
        assert self.current is not None
        leases = self.coord.leases()
        task = self.run(self.coord.begin_student_scoring(self.current))
        if self.outcome(task) is LeaseState.ACTIVE and leases[GEN] is LeaseState.SLEEPING:
            self.gpu.load(GEN)

    # -- deferred roles --------------------------------------------------------------------

    @rule(
        genrm=st.sampled_from(BEHAVIOURS),
        teacher=st.sampled_from(BEHAVIOURS),
        confirmed=st.sampled_from([True, True, True, True, False]),
        wait=st.booleans(),
        retry=st.booleans(),
    )
    def full_step(self, genrm: str, teacher: str, confirmed: bool, wait: bool, retry: bool) -> None:
        # The sequence a deferred batch runs, with whatever each manager call does.
        batch = self.next_batch
        if wait:
            self.wait_committed("next")
        self.begin_batch("next")
        if self.current != batch:
            return
        self._acknowledge(confirmed)
        for role, behaviour in (("genrm", genrm), ("teacher", teacher)):
            self.handles[role].next = behaviour
            self.activate(role, "new")
            self.deactivate(role, "new")
            if retry:
                # Both replies were "lost": the retries share the first executions.
                self.activate(role, "repeat")
                self.deactivate(role, "repeat")
        self.put_and_commit(True, "real")

    # The whole sequence is twice as likely as any single call.
    full_step_again = rule(
        genrm=st.sampled_from(BEHAVIOURS),
        teacher=st.sampled_from(BEHAVIOURS),
        confirmed=st.sampled_from([True, True, True, True, False]),
        wait=st.booleans(),
        retry=st.booleans(),
    )(lambda self, **kw: self.full_step(**kw))

    @rule(role=st.sampled_from(DEFERRED), behaviour=st.sampled_from(BEHAVIOURS))
    def set_behaviour(self, role: str, behaviour: str) -> None:
        self.handles[role].next = behaviour

    def _op(self, method: str, role: str, choice: str, pick: int) -> tuple[str, int]:
        """A new operation id, an earlier id with its earlier request (a retry: it must not run
        again), or an earlier id with another request (refused)."""
        batch = self.current if self.current is not None else self.next_batch
        if choice == "repeat":
            same = [op for op in self.history if op[1:3] == (method, role)]
            if same:
                op_id, _, _, old_batch = same[-1 - pick % len(same)]
                return op_id, old_batch
        if choice == "reuse" and self.history:
            op_id, _, _, _ = self.history[pick % len(self.history)]
            return op_id, batch
        self.ops += 1
        op_id = f"op-{self.ops}"
        self.history.append((op_id, method, role, batch))
        return op_id, batch

    @rule(**LEASE_CALL)
    def activate(self, role: str, choice: str, pick: int = 0) -> None:
        op_id, batch = self._op("activate", role, choice, pick)
        self.run(self.coord.activate(role, op_id, batch_id=batch), op_id)

    @rule(**LEASE_CALL)
    def deactivate(self, role: str, choice: str, pick: int = 0) -> None:
        op_id, batch = self._op("deactivate", role, choice, pick)
        self.run(self.coord.deactivate(role, op_id, batch_id=batch), op_id)

    # -- batches ---------------------------------------------------------------------------

    @precondition(lambda self: self.current is not None)
    @rule(release_unconfirmed=st.booleans())
    def fail_batch(self, release_unconfirmed: bool) -> None:
        assert self.current is not None
        self.run(
            self.coord.fail_batch(
                self.current, "the producer failed", release_unconfirmed=release_unconfirmed
            )
        )

    @precondition(lambda self: self.current is not None)
    @rule(put_ok=st.booleans(), receipt=st.sampled_from(["real", "real", "forged", "open"]))
    def put_and_commit(self, put_ok: bool, receipt: str) -> None:
        assert self.current is not None
        batch = self.current
        if receipt == "real":
            if not put_ok:
                return  # a failed put returns no receipt: nothing to commit with
            given = SinkReceipt(partition_name(batch), 8, True)
            self.good_receipts[batch] = given
        elif receipt == "forged":
            given = SinkReceipt(partition_name(batch + 1), 8, True)
        else:
            given = SinkReceipt(partition_name(batch), 8, False)
        leases = self.coord.leases()
        task = self.run(self.coord.commit_batch(batch, given))
        if self.outcome(task) is BatchState.COMMITTED and batch not in self.committed:
            assert all(s is LeaseState.SLEEPING for s in leases.values()), leases
            assert not self.gpu.resident, self.gpu.resident
            assert self.good_receipts.get(batch) == given
            self.committed.add(batch)

    @rule(which=st.sampled_from(["current", "next", "committed"]))
    def wait_committed(self, which: str) -> None:
        if which == "committed" and self.committed:
            batch = max(self.committed)
        elif which == "current" and self.current is not None:
            batch = self.current
        else:
            batch = self.next_batch
        task = self.loop.create_task(self.coord.wait_committed(batch))
        self.waiters.append((batch, task))
        self.settle()

    @rule(role=st.sampled_from((GEN, *DEFERRED)), confirm=st.booleans())
    def operator_reset(self, role: str, confirm: bool) -> None:
        task = self.run(self.coord.reset_blocked(role, confirm_clean=confirm))
        if self.outcome(task) is LeaseState.SLEEPING:
            # The operator confirmed the GPUs clean (they stopped the engines).
            self.gpu.resident.discard(role)
            self.reset_role = role

    @rule()
    def time_passes(self) -> None:
        self.before = self.coord.leases()
        self.reset_role = None
        self.loop.run_until_complete(asyncio.sleep(DEADLINE * 4))
        self.settle()

    # -- invariants -------------------------------------------------------------------------

    @invariant()
    def the_awake_roles_of_a_slice_fit_beside_each_other(self) -> None:
        busy: dict[str, list[str]] = {}
        for role, state in self.coord.leases().items():
            if state is not LeaseState.SLEEPING:
                busy.setdefault(SLICES[role], []).append(role)
        assert all(self.RESIDENCY.fits(sid, roles) for sid, roles in busy.items()), busy
        assert self.gpu.violations == []

    @invariant()
    def blocked_is_left_only_by_the_operator_reset(self) -> None:
        now = self.coord.leases()
        for role, state in self.before.items():
            if state is LeaseState.BLOCKED and now[role] is not LeaseState.BLOCKED:
                assert self.reset_role == role, (role, now[role])
        self.before = now
        self.reset_role = None

    @invariant()
    def every_waiter_wakes_on_commit_or_failure(self) -> None:
        failure = self.coord.failure
        for batch, task in self.waiters:
            state = self.coord.batch_state(batch)
            if state is BatchState.COMMITTED:
                assert task.done() and task.result() == self.good_receipts[batch]
            elif state is BatchState.FAILED or (failure and batch >= failure.batch_id):
                assert task.done() and isinstance(task.exception(), BatchFailedError)
            else:
                assert not task.done()

    @invariant()
    def no_operation_runs_twice(self) -> None:
        for handle in self.handles.values():
            assert len(handle.calls) == len(set(handle.calls)), handle.calls
            assert None not in handle.calls

    @invariant()
    def only_coordination_errors(self) -> None:
        assert self.errors == []

    def teardown(self) -> None:
        async def cancel_all() -> None:
            tasks = [t for t in asyncio.all_tasks() if t is not asyncio.current_task()]
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)

        self.loop.run_until_complete(cancel_all())
        for task in self.tasks + [t for _, t in self.waiters]:
            if not task.cancelled():
                task.exception()  # retrieved: each was checked by the invariants
        self.loop.close()


# The lease states themselves (switch, BLOCKED, rebuilds, late replies) are drawn 500 times by
# tests/coordination/test_lease_engine_state_machine.py; this machine adds the coordinator's
# own calls (batches, receipts, student scoring, resets) over them.
CoordinatorMachine.TestCase.settings = machine_settings(
    400, 25, derandomize=True, filter_too_much=True
)
test_coordinator_keeps_every_invariant_under_random_interleavings = CoordinatorMachine.TestCase


class ResidentCoordinatorMachine(CoordinatorMachine):
    """The same calls under a residency plan where genrm and teacher fit beside each other on
    slice A and rollout fits beside neither."""

    RESIDENCY = ResidencyPlan(
        {
            "A": SliceResidency(
                "A",
                ("genrm", "rollout", "teacher"),
                80.0,
                {"rollout": {0: 60.0}, "genrm": {0: 30.0}, "teacher": {0: 30.0}},
            )
        },
        mode="planned",
    )


ResidentCoordinatorMachine.TestCase.settings = machine_settings(
    200, 25, derandomize=True, filter_too_much=True
)
test_coordinator_under_a_residency_plan_keeps_every_invariant = ResidentCoordinatorMachine.TestCase

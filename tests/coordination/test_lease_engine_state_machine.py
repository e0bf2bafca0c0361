"""One lease engine, both of its uses, against random interleavings with real asyncio.

``relax run``'s :class:`LifecycleCoordinator` (activate / deactivate within a batch, the
operator's reset) and ``relax serve``'s :class:`WakeController` (a request wakes its role, idle
roles go back to sleep) drive the same :class:`LeaseEngine`. One machine plays both: each
example picks the front end, then hypothesis asks for roles, lets them go, makes the next call
of a model succeed, fail, raise, hang, answer late or die (the engine's replica FAILED), kills
an engine between calls, and resets BLOCKED roles.

The models are fakes on purpose (thousands of hangs and deaths are what one machine cannot
produce with real engines; the real ones are in test_deferred_real.py and
test_serve_defer.py). Each models what its GPUs may hold: an onload or a rebuild that began,
not followed by a confirmed offload.

Invariants, after every step, for both front ends:

- the roles of one slice whose GPUs may be held always fit beside each other (the residency
  plan: one at a time);
- a BLOCKED lease is left only by the operator's reset (never by a late reply);
- a role switched onto its slice has every model READY: an engine that died was rebuilt;
- the front end's view of a role is its lease in the engine, and a role granted its slice
  is one whose GPUs hold it;
- nothing raises but the front end's own errors.
"""

from __future__ import annotations

import asyncio
import itertools
from typing import Any

from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from relax_core.config import ServeSettings
from relax_core.coordination import LeaseState, LifecycleCoordinator
from relax_core.coordination.leases import LeaseEngine
from relax_core.coordination.residency import ResidencyPlan
from relax_core.errors import CoordinationError, ModelNotReadyError
from relax_core.jobs.wake import WakeController
from relax_core.manager import LifecycleResult, Outcome, ReplicaResult
from tests.support.machines import machine_settings, misbehave
from tests.support.virtual_clock import VirtualClockLoop

DEADLINE = 0.002
GEN = "rollout"
SLICES = {"genrm": "A", "teacher": "A", "rm2": "B"}
ROLES = tuple(SLICES)
BEHAVIOURS = ("ok", "ok", "ok", "fail", "raise", "hang", "late", "die")


class Gpus:
    """What the GPUs of each slice may hold, and every safety violation seen."""

    def __init__(self) -> None:
        self.held: set[str] = set()
        self.violations: list[str] = []

    def load(self, role: str) -> None:
        beside = {r for r in self.held if r != role and SLICES[r] == SLICES[role]}
        if beside:
            self.violations.append(f"{role} began loading while {beside} may hold its slice")
        self.held.add(role)


class Model:
    """One model of a role: READY, SLEEPING or FAILED; its next call as hypothesis says."""

    def __init__(self, role: str, gpus: Gpus) -> None:
        self.role, self.gpus, self.name = role, gpus, f"{role}.model"
        self.state = "SLEEPING"
        self.next = "ok"
        self.never = asyncio.Event()

    def _result(self, operation: str, ok: bool) -> LifecycleResult:
        outcome = Outcome.DONE if ok else Outcome.FAILED
        replica = ReplicaResult(f"{self.role}/0", outcome, self.state)
        return LifecycleResult(operation, self.role, (replica,))

    async def _call(self, operation: str) -> LifecycleResult:
        behaviour, self.next = self.next, "ok"
        if operation in ("onload", "recover"):
            self.gpus.load(self.role)
        await misbehave(behaviour, self.never, DEADLINE * 3, f"{self.name} {operation}")
        if behaviour == "die":
            self.state = "FAILED"
        if behaviour in ("fail", "die") or (self.state == "FAILED" and operation != "recover"):
            return self._result(operation, False)
        self.state = "SLEEPING" if operation == "offload" else "READY"
        if operation == "offload":
            self.gpus.held.discard(self.role)
        return self._result(operation, True)

    async def onload(self) -> LifecycleResult:
        return await self._call("onload")

    async def offload(self) -> LifecycleResult:
        return await self._call("offload")

    async def failed(self) -> list[str]:
        return [f"{self.role}/0"] if self.state == "FAILED" else []

    async def recover(self) -> LifecycleResult:
        return await self._call("recover")


class RunFront:
    """``relax run``: the coordinator, one batch whose generation release is acknowledged."""

    errors = (CoordinationError,)

    def __init__(self, models: dict[str, Model]) -> None:
        self.coordinator = LifecycleCoordinator(
            slices={GEN: "A", **SLICES},
            managers={role: [model] for role, model in models.items()},
            generation_role=GEN,
            operation_timeout=DEADLINE,
        )
        self.engine: LeaseEngine = self.coordinator._engine
        self.ids = itertools.count()

    async def open(self) -> None:
        await self.coordinator.begin_batch(0)
        sleeping = ReplicaResult(f"{GEN}/0", Outcome.DONE, "SLEEPING")
        await self.coordinator.acknowledge_rollout_offloaded(
            0, LifecycleResult("offload", GEN, (sleeping,))
        )

    async def want(self, role: str) -> None:
        await self.coordinator.activate(role, f"op-{next(self.ids)}", batch_id=0)

    async def let_go(self, role: str) -> None:
        await self.coordinator.deactivate(role, f"op-{next(self.ids)}", batch_id=0)

    async def reset(self, role: str) -> None:
        await self.coordinator.reset_blocked(role, confirm_clean=True)

    def granted(self, role: str) -> bool:
        return self.coordinator.lease(role) is LeaseState.ACTIVE


class ServeFront:
    """``relax serve``: the wake controller on a clock of the test's (no waiting)."""

    errors = (ModelNotReadyError, CoordinationError)

    def __init__(self, models: dict[str, Model]) -> None:
        self.now = 0.0
        self.controller = WakeController(
            {role: (SLICES[role], [model]) for role, model in models.items()},
            residency=ResidencyPlan(),
            settings=ServeSettings(
                wake_timeout=5.0, idle_seconds=1.0, min_residency=0.0, operation_timeout=DEADLINE
            ),
            clock=lambda: self.now,
        )
        self.engine = self.controller.engine

    async def open(self) -> None:
        pass

    async def want(self, role: str) -> None:
        await self.controller.wake(role)

    async def let_go(self, role: str) -> None:
        self.now += 2.0  # past idle_seconds: every idle awake role goes back to sleep
        await self.controller.sleep_idle()

    async def reset(self, role: str) -> None:
        self.engine.reset(role)  # serve's operator restarts it; the engine's reset is the same

    def granted(self, role: str) -> bool:
        return self.controller.ready(role)


class LeaseMachine(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        # Virtual time: the 2 ms operation deadline and the 40 ms wait never race under load
        # (hypothesis needs every example to draw the same way when it replays it).
        self.loop = VirtualClockLoop()
        self.gpus = Gpus()
        self.models = {role: Model(role, self.gpus) for role in ROLES}
        self.front: Any = None
        self.errors: list[BaseException] = []
        self.before: dict[str, LeaseState] = {}
        self.reset_role: str | None = None
        self.tasks: list[asyncio.Task[Any]] = []

    @initialize(front=st.sampled_from(["run", "serve"]))
    def choose_front(self, front: str) -> None:
        self.front = (RunFront if front == "run" else ServeFront)(self.models)
        self.run(self.front.open())

    def run(self, coro: Any) -> asyncio.Task[Any]:
        self.before = dict(self.front.engine.leases)
        self.reset_role = None
        task = self.loop.create_task(coro)
        self.tasks.append(task)
        self.loop.run_until_complete(asyncio.wait([task], timeout=DEADLINE * 20))
        for _ in range(4):
            self.loop.run_until_complete(asyncio.sleep(0))
        if task.done() and not task.cancelled():
            exc = task.exception()
            if exc is not None and not isinstance(exc, self.front.errors):
                self.errors.append(exc)
        return task

    @rule(role=st.sampled_from(ROLES))
    def want(self, role: str) -> None:
        was = self.front.engine.leases[role]
        task = self.run(self.front.want(role))
        granted = task.done() and not task.cancelled() and task.exception() is None
        if granted and was is not LeaseState.ACTIVE:
            # Switched in: an engine that died before or during the onload was rebuilt.
            assert self.models[role].state == "READY", self.models[role].state
            assert self.front.granted(role)

    @rule(role=st.sampled_from(ROLES))
    def let_go(self, role: str) -> None:
        self.run(self.front.let_go(role))

    @rule(role=st.sampled_from(ROLES), behaviour=st.sampled_from(BEHAVIOURS))
    def next_call(self, role: str, behaviour: str) -> None:
        self.models[role].next = behaviour

    @rule(role=st.sampled_from(ROLES))
    def an_engine_dies(self, role: str) -> None:
        self.models[role].state = "FAILED"

    @precondition(lambda self: LeaseState.BLOCKED in self.front.engine.leases.values())
    @rule(data=st.data())
    def operator_reset(self, data: st.DataObject) -> None:
        engine = self.front.engine
        role = data.draw(st.sampled_from(sorted(engine.blocked)))
        # The operator confirms the GPUs clean: the engines are stopped.
        self.models[role].state = "SLEEPING"
        self.gpus.held.discard(role)
        self.run(self.front.reset(role))
        self.reset_role = role

    @invariant()
    def the_gpus_of_a_slice_are_never_held_by_roles_that_do_not_fit(self) -> None:
        assert self.gpus.violations == []

    @invariant()
    def a_blocked_lease_is_left_only_by_the_operator_reset(self) -> None:
        if self.front is None:
            return
        for role, state in self.before.items():
            now = self.front.engine.leases[role]
            if state is LeaseState.BLOCKED and now is not LeaseState.BLOCKED:
                assert role == self.reset_role, (role, now)

    @invariant()
    def the_front_ends_view_of_a_role_is_its_lease(self) -> None:
        if self.front is None:
            return
        for role in ROLES:
            active = self.front.engine.leases[role] is LeaseState.ACTIVE
            assert self.front.granted(role) == active, role
            if active:
                assert role in self.gpus.held

    @invariant()
    def nothing_raises_but_the_front_ends_own_errors(self) -> None:
        assert self.errors == []

    def teardown(self) -> None:
        for model in self.models.values():
            model.never.set()

        async def settle() -> None:
            for task in asyncio.all_tasks():
                if task is not asyncio.current_task():
                    task.cancel()
            await asyncio.sleep(0)

        self.loop.run_until_complete(settle())
        self.loop.close()


LeaseMachine.TestCase.settings = machine_settings(500, 20, derandomize=True, filter_too_much=True)
test_both_front_ends_keep_every_lease_invariant_under_random_interleavings = LeaseMachine.TestCase

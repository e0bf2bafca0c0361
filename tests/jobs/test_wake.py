"""On-demand wake (``relax_core.jobs.wake``), driven by hypothesis against fake handles.

The handles are fakes (their "GPU" is a set of resident roles per slice, checked on every
load): the point is the controller's concurrency — wakes racing wakes, evictions, idle sleeps,
engines that die or hang — which a real engine would only make slower. ``relax serve`` with
real engines is tested in tests/coordination/test_serve_defer.py.

A request is played as the role gateway plays it (``relax_core.gateway.handler``): ``enter``,
``wake`` while not admitted, forward (the engine must be READY, and stays so until the answer),
``end``.
"""

from __future__ import annotations

import asyncio
from typing import Any

import hypothesis.strategies as st
import pytest
from hypothesis.stateful import (
    RuleBasedStateMachine,
    initialize,
    invariant,
    precondition,
    rule,
)

from relax_core.config import ServeSettings
from relax_core.coordination.residency import ResidencyPlan, SliceResidency
from relax_core.errors import ModelNotReadyError
from relax_core.jobs.wake import WakeController, WakeState
from relax_core.manager import LifecycleResult, Outcome, ReplicaResult
from tests.support.machines import machine_settings

ROLES = ("a", "b", "c")
SLICE = "pool:0-0"
#: Times are short (a few ms) so an example runs in a fraction of a second on a busy machine.
FAST = ServeSettings(
    wake_timeout=1.0, idle_seconds=0.12, min_residency=0.04, operation_timeout=0.15
)


def _plan(together: bool) -> ResidencyPlan:
    """Exclusive (one role at a time), or planned with a budget where b + c fit and a does
    not fit beside either."""
    if not together:
        return ResidencyPlan({SLICE: SliceResidency(SLICE, ROLES)}, mode="exclusive")
    demand = {"a": {0: 7.0}, "b": {0: 4.0}, "c": {0: 4.0}}
    return ResidencyPlan(
        {SLICE: SliceResidency(SLICE, ROLES, capacity_gib=10.0, demand=demand)},
        mode="planned",
    )


class World:
    """What the fake engines hold, and every broken promise seen."""

    def __init__(self, plan: ResidencyPlan) -> None:
        self.plan = plan
        self.resident: set[str] = set()
        self.inflight: dict[str, int] = dict.fromkeys(ROLES, 0)
        self.violations: list[str] = []
        self.onloads = 0

    def load(self, role: str) -> None:
        self.resident.add(role)
        if not self.plan.fits(SLICE, self.resident):
            self.violations.append(f"resident together: {sorted(self.resident)}")

    def unload(self, role: str, *, died: bool = False) -> None:
        if not died and self.inflight[role]:
            self.violations.append(f"{role} offloaded with {self.inflight[role]} in flight")
        self.resident.discard(role)


class FakeHandle:
    """One model of one role: SLEEPING / READY / FAILED, an onload or offload of a few ms."""

    def __init__(self, world: World, role: str, *, awake: bool = False) -> None:
        self.world, self.role, self.name = world, role, f"{role}.model"
        self.state = "READY" if awake else "SLEEPING"
        self.hangs = False
        if awake:
            world.load(role)

    def _result(self, op: str, outcome: Outcome) -> LifecycleResult:
        replica = ReplicaResult(f"{self.role}/replica-0", outcome, self.state)
        return LifecycleResult(op, self.name, (replica,))

    async def _step(self) -> None:
        if self.hangs:
            await asyncio.Event().wait()  # never answers: the controller's bound ends it
        await asyncio.sleep(0.002)

    async def onload(self) -> LifecycleResult:
        await self._step()
        if self.state == "FAILED":
            return self._result("onload", Outcome.FAILED)
        if self.state != "READY":
            self.world.load(self.role)
            self.world.onloads += 1
            self.state = "READY"
        return self._result("onload", Outcome.DONE)

    async def offload(self) -> LifecycleResult:
        await self._step()
        if self.state == "FAILED":
            return self._result("offload", Outcome.FAILED)
        self.world.unload(self.role)
        self.state = "SLEEPING"
        return self._result("offload", Outcome.DONE)

    async def failed(self) -> list[str]:
        return [f"{self.role}/replica-0"] if self.state == "FAILED" else []

    async def recover(self) -> LifecycleResult:
        await self._step()
        self.world.load(self.role)
        self.state = "READY"
        return self._result("recover", Outcome.DONE)

    def die(self) -> None:
        if self.state == "READY":
            self.world.unload(self.role, died=True)
        self.state = "FAILED"


async def play(c: WakeController, h: FakeHandle, hold: float, outcomes: list[Any]) -> None:
    """One request, as a role gateway plays it."""
    world, role = h.world, h.role
    loop = asyncio.get_running_loop()
    until = loop.time() + c.settings.wake_timeout
    try:
        first = True
        while not c.enter(role, first=first):
            first = False
            if loop.time() >= until:
                raise ModelNotReadyError("evicted again", role=role, model="*", state="?")
            await c.wake(role, timeout=until - loop.time())
    except ModelNotReadyError as exc:
        outcomes.append(("refused", role, exc.message))
        return
    world.inflight[role] += 1
    try:
        if h.state == "FAILED":
            # What the resolver answers when the model's only replica is FAILED (unroutable).
            outcomes.append(("refused", role, "no READY replica: its engine FAILED"))
            return
        if h.state != "READY":
            world.violations.append(f"a request for {role} forwarded to a {h.state} engine")
        end = loop.time() + hold
        while loop.time() < end:
            await asyncio.sleep(0.002)
            if h.state == "FAILED":
                outcomes.append(("failed", role, "the engine died under the request"))
                return
            if h.state != "READY":
                world.violations.append(f"{role} went {h.state} under a request")
        outcomes.append(("answered", role, ""))
    finally:
        world.inflight[role] -= 1
        c.end(role)


class WakeMachine(RuleBasedStateMachine):
    """Requests, time, deaths and hangs in any order; the promises hold throughout."""

    def __init__(self) -> None:
        super().__init__()
        self.loop = asyncio.new_event_loop()
        self.outcomes: list[Any] = []
        self.requests: list[asyncio.Task[None]] = []
        self.hung = False
        self.deaths: dict[str, int] = {}

    @initialize(together=st.booleans(), awake=st.sampled_from((None, *ROLES)))
    def build(self, together: bool, awake: str | None) -> None:
        self.world = World(_plan(together))
        self.handles = {r: FakeHandle(self.world, r, awake=r == awake) for r in ROLES}
        self.c = WakeController(
            {r: (SLICE, [h]) for r, h in self.handles.items()},
            residency=self.world.plan,
            awake=[awake] if awake else [],
            settings=FAST,
        )
        self.housekeeper = self.loop.create_task(self.c.housekeep())

    def _run(self, seconds: float) -> None:
        self.loop.run_until_complete(asyncio.sleep(seconds))

    @rule(role=st.sampled_from(ROLES), hold=st.sampled_from((0.0, 0.005, 0.03)))
    def request(self, role: str, hold: float) -> None:
        task = self.loop.create_task(play(self.c, self.handles[role], hold, self.outcomes))
        self.requests.append(task)
        self._run(0.001)

    @rule(seconds=st.sampled_from((0.005, 0.02, 0.06, 0.15)))
    def wait(self, seconds: float) -> None:
        self._run(seconds)

    @rule(role=st.sampled_from(ROLES))
    def die(self, role: str) -> None:
        self.handles[role].die()
        self.deaths[role] = self.deaths.get(role, 0) + 1

    @precondition(lambda self: not self.hung)
    @rule(role=st.sampled_from(ROLES))
    def hang(self, role: str) -> None:
        self.hung = True
        self.deaths[role] = 99  # counted as a role allowed to end BLOCKED
        self.handles[role].hangs = True

    @invariant()
    def promises_hold(self) -> None:
        if hasattr(self, "world"):
            assert self.world.violations == []
            states = self.c.states()
            for role, h in self.handles.items():
                if states[role] == WakeState.SLEEPING:
                    assert h.state != "READY", (role, states, h.state)

    def teardown(self) -> None:
        try:
            if not hasattr(self, "world"):
                return
            # Every request ends: answered, or refused with a reason, within its bound.
            limit = FAST.wake_timeout + 4 * FAST.operation_timeout + 1.0
            pending = [t for t in self.requests if not t.done()]
            if pending:
                _, left = self.loop.run_until_complete(asyncio.wait(pending, timeout=limit))
                assert not left, f"{len(left)} request(s) never ended"
            for task in self.requests:
                assert task.exception() is None, task.exception()
            assert len(self.outcomes) == len(self.requests)
            for kind, role, why in self.outcomes:
                assert kind in ("answered", "refused", "failed"), kind
                if kind != "answered":
                    assert why, (kind, role)
            states = self.c.states()
            blocked = [r for r, s in states.items() if s.startswith("BLOCKED")]
            # Only a hung handle, or an engine that died again while its rebuild's transition
            # was retried, leaves a role BLOCKED; one death is healed.
            assert all(self.deaths.get(r, 0) >= 2 for r in blocked), (states, self.deaths)
            if blocked:
                # A BLOCKED slice refuses every later request at once, saying what to do.
                out: list[Any] = []
                role = next(iter(ROLES))
                if not self.c.ready(role):
                    self.loop.run_until_complete(play(self.c, self.handles[role], 0, out))
                    assert out[0][0] == "refused" and "BLOCKED" in out[0][2], out
            assert self.world.violations == []
        finally:
            tasks = [self.housekeeper, *self.requests] if hasattr(self, "housekeeper") else []
            for task in tasks:
                task.cancel()
            self.loop.run_until_complete(asyncio.gather(*tasks, return_exceptions=True))
            self.loop.close()


TestWakeMachine = WakeMachine.TestCase
TestWakeMachine.settings = machine_settings(25, 20)


@pytest.mark.parametrize("min_residency", [0.02, 0.05])
def test_alternating_requests_that_arrive_together_wake_each_role_once(
    min_residency: float,
) -> None:
    """Six requests for two roles of one slice, alternating, all waiting at once: the slice
    switches once (a, then b after its minimum residency), not once per request; every
    request is answered. The count does not depend on how long anything took."""
    world = World(_plan(False))
    handles = {r: FakeHandle(world, r) for r in ("a", "b")}
    c = WakeController(
        {r: (SLICE, [h]) for r, h in handles.items()},
        residency=world.plan,
        settings=ServeSettings(wake_timeout=30, idle_seconds=0, min_residency=min_residency),
    )
    outcomes: list[Any] = []

    async def main() -> None:
        tasks = [
            asyncio.create_task(play(c, handles[("a", "b")[i % 2]], 0.002, outcomes))
            for i in range(6)
        ]
        await asyncio.wait_for(asyncio.gather(*tasks), 60)

    asyncio.run(main())
    assert [k for k, _, _ in outcomes] == ["answered"] * 6
    assert world.violations == []
    assert world.onloads == 2, world.onloads


def test_a_request_for_an_awake_role_is_admitted_without_a_switch() -> None:
    world = World(_plan(True))
    handles = {r: FakeHandle(world, r, awake=r == "b") for r in ROLES}
    c = WakeController(
        {r: (SLICE, [h]) for r, h in handles.items()},
        residency=world.plan,
        awake=["b"],
        settings=FAST,
    )
    outcomes: list[Any] = []

    async def main() -> None:
        await play(c, handles["b"], 0, outcomes)
        # c fits beside b (4 + 4 of 10 GiB): woken without evicting b.
        await play(c, handles["c"], 0, outcomes)
        assert world.resident == {"b", "c"}
        # a fits beside neither: both evicted once their residency has passed, least
        # recently used first.
        await play(c, handles["a"], 0, outcomes)
        assert world.resident == {"a"}

    asyncio.run(main())
    assert [k for k, _, _ in outcomes] == ["answered"] * 3
    assert c.counts("b").avoided >= 2  # admitted at once, and kept beside c's wake
    assert c.counts("c").wakes == 1 and c.counts("a").wakes == 1
    assert c.counts("b").evictions == 1 and c.counts("c").evictions == 1
    assert world.violations == []

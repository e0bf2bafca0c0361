"""The lease engine's calls per switch: one manager call per handle on the common path.

The manager is asked for its FAILED replicas only where the engine does not know what a handle
holds (its last switch was not confirmed); a replica that failed since the last switch (or
before the first: the job's start confirmed its models) is in the switch's own answer and is
rebuilt before the role is granted.
"""

from __future__ import annotations

import asyncio

from relax_core.coordination import LeaseState
from relax_core.coordination.leases import LeaseEngine
from relax_core.manager import LifecycleResult, Outcome, ReplicaResult


class _Manager:
    """One model with two replicas; records every call the engine makes."""

    name = "judge.model"

    def __init__(self) -> None:
        self.states = {"judge/0": "SLEEPING", "judge/1": "SLEEPING"}
        self.calls: list[str] = []

    def _answer(self, operation: str, to: str) -> LifecycleResult:
        replicas = []
        for engine, state in self.states.items():
            if state == "FAILED" and operation != "recover":
                replicas.append(ReplicaResult(engine, Outcome.FAILED, "FAILED", error="dead"))
                continue
            self.states[engine] = to
            replicas.append(ReplicaResult(engine, Outcome.DONE, to))
        return LifecycleResult(operation, "judge", tuple(replicas))

    async def onload(self) -> LifecycleResult:
        self.calls.append("onload")
        return self._answer("onload", "READY")

    async def offload(self) -> LifecycleResult:
        self.calls.append("offload")
        return self._answer("offload", "SLEEPING")

    async def failed(self) -> list[str]:
        self.calls.append("failed")
        return [e for e, s in self.states.items() if s == "FAILED"]

    async def recover(self) -> LifecycleResult:
        self.calls.append("recover")
        return self._answer("recover", "READY")


def _engine(manager: _Manager) -> LeaseEngine:
    return LeaseEngine({"genrm": "A"}, {"genrm": [manager]}, operation_timeout=5.0)


def test_every_switch_of_a_confirmed_handle_is_the_managers_call_alone() -> None:
    manager = _Manager()
    engine = _engine(manager)

    async def cycle() -> None:
        for _ in range(3):
            assert await engine.switch("genrm", out=False) is None
            assert await engine.switch("genrm", out=True) is None

    asyncio.run(cycle())
    # The first switch too: nothing is asked before it.
    assert manager.calls == ["onload", "offload"] * 3
    assert engine.leases["genrm"] is LeaseState.SLEEPING


def test_a_replica_that_failed_before_the_first_switch_is_rebuilt_before_the_grant() -> None:
    manager = _Manager()
    manager.states["judge/0"] = "FAILED"  # died asleep before the run's first switch
    engine = _engine(manager)

    assert asyncio.run(engine.switch("genrm", out=False)) is None
    assert manager.calls == ["onload", "failed", "recover", "onload"]
    assert manager.states == {"judge/0": "READY", "judge/1": "READY"}


def test_a_replica_that_failed_since_the_last_switch_is_rebuilt_before_the_grant() -> None:
    manager = _Manager()
    engine = _engine(manager)

    async def scenario() -> str | None:
        assert await engine.switch("genrm", out=False) is None
        assert await engine.switch("genrm", out=True) is None
        manager.states["judge/1"] = "FAILED"  # died asleep (a health round marked it)
        manager.calls.clear()
        return await engine.switch("genrm", out=False)

    assert asyncio.run(scenario()) is None
    # The switch's own answer named the FAILED replica: rebuilt, then called once more.
    assert manager.calls == ["onload", "failed", "recover", "onload"]
    assert manager.states == {"judge/0": "READY", "judge/1": "READY"}
    assert engine.leases["genrm"] is LeaseState.ACTIVE


def test_a_replica_that_failed_since_is_rebuilt_and_released_before_the_slice_is_handed_on() -> (
    None
):
    manager = _Manager()
    engine = _engine(manager)

    async def scenario() -> str | None:
        assert await engine.switch("genrm", out=False) is None
        manager.states["judge/0"] = "FAILED"
        manager.calls.clear()
        return await engine.switch("genrm", out=True)

    assert asyncio.run(scenario()) is None
    assert manager.calls == ["offload", "failed", "recover", "offload"]
    assert manager.states == {"judge/0": "SLEEPING", "judge/1": "SLEEPING"}
    assert engine.leases["genrm"] is LeaseState.SLEEPING


def test_after_an_unconfirmed_switch_the_next_one_asks_first() -> None:
    manager = _Manager()
    engine = _engine(manager)

    async def scenario() -> None:
        assert await engine.switch("genrm", out=False) is None
        manager.states["judge/0"] = "FAILED"

        async def refuse() -> LifecycleResult:
            manager.calls.append("recover")
            raise RuntimeError("the actor died")

        manager.recover = refuse  # type: ignore[method-assign]
        assert await engine.switch("genrm", out=True) is not None  # BLOCKED: not rebuilt
        engine.reset("genrm")
        del manager.recover
        manager.calls.clear()
        assert await engine.switch("genrm", out=False) is None

    asyncio.run(scenario())
    # Not known clean: the FAILED replica is rebuilt before the switch's call.
    assert manager.calls == ["failed", "recover", "onload"]

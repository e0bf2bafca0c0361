"""A lease of some of a role's models: two judges of one role take turns on GPUs that hold one
of them at a time, each stage onloading only its own.

The handles are in-process fakes that confirm at once (the sequencing is the point; real
managers behind the same calls are in test_deferred_real.py and the relax run tests)."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest

from relax_core.coordination import LeaseState, LifecycleCoordinator
from relax_core.errors import CoordinationError
from relax_core.manager import LifecycleResult, Outcome, ReplicaResult


class Handle:
    def __init__(self, name: str, log: list[str]) -> None:
        self.name, self.log = name, log

    async def _do(self, op: str, state: str) -> LifecycleResult:
        self.log.append(f"{self.name}.{op}")
        return LifecycleResult(
            op, self.name, (ReplicaResult(f"{self.name}/0", Outcome.DONE, state),)
        )

    async def onload(self) -> LifecycleResult:
        return await self._do("onload", "READY")

    async def offload(self) -> LifecycleResult:
        return await self._do("offload", "SLEEPING")


def coordinator(log: list[str]) -> LifecycleCoordinator:
    return LifecycleCoordinator(
        slices={"rollout": "A", "genrm": "A"},
        managers={"genrm": [Handle("genrm.judge-a", log), Handle("genrm.judge-b", log)]},
        generation_role="rollout",
    )


async def _ready(c: LifecycleCoordinator) -> None:
    await c.begin_batch(0)
    await c.acknowledge_rollout_offloaded(0, LifecycleResult("offload", "policy", ()))


def test_each_judge_of_a_role_is_onloaded_and_offloaded_alone() -> None:
    log: list[str] = []
    c = coordinator(log)

    async def go() -> None:
        await _ready(c)
        for model in ("judge-a", "judge-b"):
            assert await c.activate("genrm", f"{model}:on", batch_id=0, models=[model]) is (
                LeaseState.ACTIVE
            )
            assert await c.deactivate("genrm", f"{model}:off", batch_id=0) is LeaseState.SLEEPING

    asyncio.run(go())
    assert log == [
        "genrm.judge-a.onload", "genrm.judge-a.offload",
        "genrm.judge-b.onload", "genrm.judge-b.offload",
    ]  # fmt: skip


def test_no_models_is_every_model_of_the_role() -> None:
    log: list[str] = []
    c = coordinator(log)

    async def go() -> None:
        await _ready(c)
        await c.activate("genrm", "on", batch_id=0)
        await c.deactivate("genrm", "off", batch_id=0)

    asyncio.run(go())
    assert sorted(log) == [
        "genrm.judge-a.offload", "genrm.judge-a.onload",
        "genrm.judge-b.offload", "genrm.judge-b.onload",
    ]  # fmt: skip


def test_an_unknown_model_and_another_model_of_an_active_role_are_refused() -> None:
    log: list[str] = []
    c = coordinator(log)

    async def go() -> Any:
        await _ready(c)
        with pytest.raises(CoordinationError, match=r"no handle of model\(s\) \['judge-c'\]"):
            await c.activate("genrm", "c", batch_id=0, models=["judge-c"])
        await c.activate("genrm", "a", batch_id=0, models=["judge-a"])
        # judge-a awake: asking for it again changes nothing; judge-b needs a deactivation.
        assert await c.activate("genrm", "a2", batch_id=0, models=["judge-a"]) is (
            LeaseState.ACTIVE
        )
        with pytest.raises(CoordinationError, match="deactivate it first"):
            await c.activate("genrm", "b", batch_id=0, models=["judge-b"])

    asyncio.run(go())
    assert log == ["genrm.judge-a.onload"]


def test_an_operation_id_reused_for_other_models_is_refused() -> None:
    c = coordinator([])

    async def go() -> None:
        await _ready(c)
        await c.activate("genrm", "op", batch_id=0, models=["judge-a"])
        with pytest.raises(CoordinationError, match="was used for activate"):
            await c.activate("genrm", "op", batch_id=0, models=["judge-b"])

    asyncio.run(go())

"""Simulated engines with fixed per-phase times, behind the real step machinery.

What is real: the :class:`~relax_core.coordination.LifecycleCoordinator` (the commit gate),
:class:`~relax_core.coordination.DeferredBatch`, :class:`~relax_core.coordination.
MemoryBatchSink` and the step driver of ``relax run`` (:mod:`relax_core.run.driver`: its
staleness gate, its streaming scorer, its sync and async orders). What is simulated, because
one machine cannot give three GPU engines of fixed speed: each role's engine is a resource that
does one thing at a time for a fixed time.

- :class:`SimRollout`: generates a batch's groups one after another, ``generate_s / groups``
  each (an engine that streams its batch out); every response is ``tokens`` tokens, and a
  push that lands while a group is generated updates the weights in place: the tokens after
  it carry the new version (``Sample.weight_versions``).
- :class:`SimJudge`: a stage (``streaming``) that scores ``score_s / groups`` per group, one
  group at a time.
- :class:`SimTrainer`: waits for the commit (``wait_committed``), reads the partition, trains
  ``train_s``, deletes it; ``push`` takes ``push_s`` and moves the rollout's version.

``faults`` (the stateful test) make a phase raise at a given step.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Sequence
from typing import Any

import attrs

from relax_core import (
    REWARD_FIELDS,
    DeferredCollector,
    LifecycleCoordinator,
    LifecycleResult,
    MemoryBatchSink,
    Outcome,
    ReplicaResult,
    ResidencyPlan,
    Sample,
    StageContext,
    StageReport,
    partition_name,
)

__all__ = [
    "SimJudge",
    "SimRollout",
    "SimTrainer",
    "Times",
    "coordinator",
]


class _Fault(RuntimeError):
    """A fault injected into a simulated phase."""


@attrs.frozen
class Times:
    """Seconds per batch of each phase (``push_s`` per push)."""

    generate_s: float = 0.2
    score_s: float = 0.2
    train_s: float = 0.2
    push_s: float = 0.005
    groups: int = 4
    samples_per_group: int = 2
    tokens: int = 8


class _Handle:
    """A manager handle that confirms every call at once (a switch costs nothing here); an
    offload of ``rollout`` that ``discards`` loses its weights."""

    def __init__(self, name: str, rollout: SimRollout | None = None) -> None:
        self.name, self.rollout = name, rollout

    async def onload(self) -> LifecycleResult:
        return self._result("onload", "READY")

    async def offload(self) -> LifecycleResult:
        if self.rollout is not None and self.rollout.discards:
            self.rollout.version = None
        return self._result("offload", "SLEEPING")

    async def weight_version(self) -> str | None:
        return None

    def _result(self, op: str, state: str) -> LifecycleResult:
        replica = ReplicaResult(f"{self.name}/replica-0", Outcome.DONE, state)
        return LifecycleResult(op, self.name, (replica,))


def coordinator(*, free_rollout: bool = True, deferred: Sequence[str] = ()) -> LifecycleCoordinator:
    """A coordinator of a split layout (the generation role on GPUs of its own, free), or,
    with ``deferred`` roles, of a defer layout: those roles take turns with the policy on one
    GPU (every transition issued)."""
    if deferred:
        return LifecycleCoordinator(
            slices={"policy": "gpu0", **dict.fromkeys(deferred, "gpu0")},
            managers={role: [handle(role)] for role in deferred},
            generation_role="policy",
            residency=ResidencyPlan(mode="exclusive"),
        )
    return LifecycleCoordinator(
        slices={"policy": "policy:own"},
        managers={},
        generation_role="policy",
        residency=ResidencyPlan(
            free=frozenset({"policy"}) if free_rollout else frozenset(), mode="planned"
        ),
    )


def handle(name: str = "policy", rollout: SimRollout | None = None) -> _Handle:
    """A role's handle (the generation role's by default, of ``rollout``)."""
    return _Handle(name, rollout)


class SimRollout:
    """The policy engine: one group at a time, ``generate_s / groups`` each; its weight
    ``version`` moves on a push, in place (a group in flight goes on with the new weights).

    ``lag``: a push is reported to the driver at once but reaches the engine only after this
    many more groups (the stateful test's engine that serves older weights than it was told).
    ``fail_at``: step -> group index whose generation raises :class:`_Fault`. ``discards``:
    an offload loses the weights (no CPU backup): a group fails until a push.
    """

    def __init__(
        self,
        times: Times,
        *,
        lag: int = 0,
        fail_at: dict[int, int] | None = None,
        discards: bool = False,
    ) -> None:
        self.times = times
        self.version: str | None = "0"
        self.discards = discards
        self._pending: list[tuple[int, str]] = []
        self.lag = lag
        self.fail_at = dict(fail_at or {})
        self._lock = asyncio.Lock()
        self._counter = 0
        #: every sample generated (the stateful test accounts for each)
        self.generated: list[Sample] = []

    def pushed(self, version: str) -> None:
        """The trainer pushed ``version`` (it lands after ``lag`` more groups)."""
        self._pending.append((self._counter + self.lag, version))
        self._land()

    def _land(self) -> None:
        while self._pending and self._pending[0][0] <= self._counter:
            self.version = self._pending.pop(0)[1]

    def producer(self) -> SimProducer:
        """A step producer over this engine."""
        return SimProducer(self)

    async def group(self, batch_id: int, index: int) -> list[Sample]:
        """One group: ``samples_per_group`` responses of ``tokens`` tokens."""
        t = self.times
        async with self._lock:
            if self.fail_at.get(batch_id) == index:
                raise _Fault(f"rollout failed on group {index} of step {batch_id}")
            if self.version is None:
                raise _Fault(f"step {batch_id}: weights lost at the offload, no push since")
            per_token = t.generate_s / t.groups / t.tokens
            boundaries: list[tuple[int, str]] = [(0, self.version)]
            for i in range(t.tokens):
                await asyncio.sleep(per_token)
                self._land()
                if self.version not in (None, boundaries[-1][1]) and i + 1 < t.tokens:
                    boundaries.append((i + 1, str(self.version)))
            self._counter += 1
            self._land()
        gid = f"b{batch_id}-p{index}"
        out = [
            Sample(
                f"{gid}-s{j}",
                gid,
                (1, 2, 3),
                tuple(range(10, 10 + t.tokens)),
                rollout_logprobs=tuple(-0.5 for _ in range(t.tokens)),
                weight_version=boundaries[-1][1],
                weight_versions=tuple(boundaries) if len(boundaries) > 1 else (),
            )
            for j in range(t.samples_per_group)
        ]
        self.generated.extend(out)
        return out


class SimProducer:
    """A step producer (``first`` and ``generate``) over :class:`SimRollout`."""

    def __init__(self, rollout: SimRollout) -> None:
        self.rollout = rollout
        self._next = 0

    async def first(
        self,
        batch_id: int,
        collector: DeferredCollector,
        *,
        on_group: Callable[[int], None] | None = None,
    ) -> None:
        for done in range(1, self.rollout.times.groups + 1):
            collector.add(await self.rollout.group(batch_id, self._take()))
            if on_group is not None:
                on_group(done)

    async def generate(
        self,
        batch_id: int,
        *,
        groups: int | None = None,
        prompts: Sequence[Any] | None = None,
        samples_per_prompt: int | None = None,
        temperature: float | None = None,
    ) -> list[list[Sample]]:
        count = groups if groups is not None else len(prompts or ())
        return [await self.rollout.group(batch_id, self._take()) for _ in range(count)]

    def _take(self) -> int:
        self._next += 1
        return self._next - 1


class SimJudge:
    """A reward stage on a judge of its own: ``score_s / groups`` per group, one at a time;
    it streams. ``fail_at``: a step whose scoring raises :class:`_Fault`."""

    name, role, models = "judge", "judge", ()
    fields = REWARD_FIELDS
    streaming = True

    def __init__(self, times: Times, *, fail_at: int | None = None) -> None:
        self.times = times
        self.fail_at = fail_at
        self._lock = asyncio.Lock()

    async def run(self, samples: Sequence[Sample], ctx: StageContext) -> StageReport:
        groups = len({s.group_id for s in samples})
        async with self._lock:
            if ctx.batch_id == self.fail_at:
                raise _Fault(f"the judge failed on step {ctx.batch_id}")
            await asyncio.sleep(self.times.score_s / self.times.groups * groups)
        for s in samples:
            s.fields["rewards"] = {"judge": 1.0}
            s.fields["reward"] = 1.0
        return StageReport(self.name, {"scored": len(samples)})


class SimTrainer:
    """The trainer: ``train(N)`` waits for the commit, reads ``train_N``, trains, deletes it;
    ``push`` moves the rollout's weights. ``trained`` lists ``(step, sample ids, trainer
    version)`` in order; ``fail_at``: a step whose training raises :class:`_Fault`."""

    def __init__(
        self,
        times: Times,
        coordinator: LifecycleCoordinator,
        sink: MemoryBatchSink,
        rollout: SimRollout,
        *,
        fail_at: int | None = None,
    ) -> None:
        self.times = times
        self.coordinator = coordinator
        self.sink = sink
        self.rollout = rollout
        self.fail_at = fail_at
        self.version = 0
        self.trained: list[tuple[int, list[Sample], int]] = []

    async def train(self, batch_id: int) -> dict[str, Any]:
        receipt = await self.coordinator.wait_committed(batch_id, timeout=60)
        samples = await self.sink.get(receipt.partition)
        if batch_id == self.fail_at:
            raise _Fault(f"the trainer failed on step {batch_id}")
        await asyncio.sleep(self.times.train_s)
        self.trained.append((batch_id, list(samples), self.version))
        self.version += 1
        await self.sink.delete(partition_name(batch_id))
        return {"samples": len(samples), "loss": 0.0}

    async def push(self, version: str) -> dict[str, Any]:
        await asyncio.sleep(self.times.push_s)
        self.rollout.pushed(version)
        return {"weight_version": version}

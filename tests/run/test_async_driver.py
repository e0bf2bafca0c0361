"""The step driver as a state machine (a sync run is its ``max_staleness = 0``): hypothesis
picks the order in which the simulated engines finish their work (a group generated, a group
scored, a batch trained, a push confirmed, a push reaching the engine late) and where a fault
lands, and after every move the driver's contract is checked against the real coordinator and sink:

- no sample trained on is more than ``max_staleness`` versions older than the trainer;
- the trainer is asked for a batch only once the coordinator committed it;
- at the end, every sample the engine generated was trained on exactly once, or reported
  dropped with its reason, or (the run failed) reported with the failed step;
- a failure in generation, a stage or training ends the run: nothing is committed for the
  failed batch (a stage or generation failure) and nothing after it is trained;
- switching (a defer layout: the policy takes turns with the judge on one GPU): the two are
  never awake together, the policy generates and takes pushes only while awake.

The engines are simulated (one machine cannot run engines whose every step a test controls):
each phase waits until the state machine releases it.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Sequence
from typing import Any

import pytest
from hypothesis import strategies as st
from hypothesis.stateful import (
    RuleBasedStateMachine,
    initialize,
    invariant,
    precondition,
    rule,
)
from relax_bench._steps_sim import coordinator, handle

from relax_core import gather_all
from relax_core.coordination import (
    REWARD_FIELDS,
    BatchState,
    DeferredCollector,
    LifecycleCoordinator,
    MemoryBatchSink,
    Sample,
    StageContext,
    StageReport,
    Timeline,
    partition_name,
)
from relax_core.coordination.residency import ResidencyPlan
from relax_core.coordination.stages import RoleClients
from relax_core.errors import EmptyBatchError
from relax_core.manager.results import LifecycleResult
from relax_core.run.driver import STALENESS_STAGE, DriverSettings, StepDriver, _StepFailure
from tests.support.machines import machine_settings

KINDS = ("group", "score", "train", "push")


class Fault(RuntimeError):
    pass


class Gates:
    """Every simulated phase waits here until the machine releases it (or fails it)."""

    def __init__(self) -> None:
        self.waiting: dict[str, list[asyncio.Future[None]]] = {k: [] for k in KINDS}

    async def wait(self, kind: str) -> None:
        fut: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self.waiting[kind].append(fut)
        await fut

    def pending(self, kind: str) -> int:
        self.waiting[kind] = [f for f in self.waiting[kind] if not f.done()]
        return len(self.waiting[kind])

    def release(self, kind: str, *, fail: bool = False) -> None:
        fut = self.waiting[kind].pop(0)
        if fail:
            fut.set_exception(Fault(f"{kind} failed"))
        else:
            fut.set_result(None)


class Gpu:
    """One shared GPU of a defer layout: which roles are onloaded, and every breach of the
    turn-taking (``None``: a split layout, nothing shared)."""

    def __init__(self) -> None:
        self.awake = {"policy"}
        self.breaches: list[str] = []

    def require(self, role: str, what: str) -> None:
        if role not in self.awake:
            self.breaches.append(f"{what} while {role} sleeps")


class GpuHandle:
    """A role's manager handle on the shared GPU: onload only once the other role slept (the
    simulated engines' handle confirms each call)."""

    def __init__(self, gpu: Gpu, name: str) -> None:
        self.gpu = gpu
        self.name = name
        self._confirms = handle(name)

    async def onload(self) -> LifecycleResult:
        others = self.gpu.awake - {self.name}
        if others:
            self.gpu.breaches.append(f"{self.name} onloaded while {sorted(others)} awake")
        self.gpu.awake.add(self.name)
        return await self._confirms.onload()

    async def offload(self) -> LifecycleResult:
        self.gpu.awake.discard(self.name)
        return await self._confirms.offload()


class Engine:
    """The policy: a group is generated between its start and its release; a push reaches it
    when the machine lets it (``land``), possibly after the trainer's push returned."""

    def __init__(self, gates: Gates, samples_per_group: int, gpu: Gpu | None = None) -> None:
        self.gates = gates
        self.samples_per_group = samples_per_group
        self.gpu = gpu
        self.version = "0"
        self.incoming: list[str] = []
        self.generated: list[Sample] = []

    def land(self) -> None:
        self.version = self.incoming.pop(0)

    async def group(self, batch_id: int, index: int) -> list[Sample]:
        began = self.version
        if self.gpu is not None:
            self.gpu.require("policy", f"a group of step {batch_id} began")
        await self.gates.wait("group")
        if self.gpu is not None:
            self.gpu.require("policy", f"a group of step {batch_id} ended")
        ended = self.version
        gid = f"b{batch_id}-p{index}"
        boundaries = ((0, began), (2, ended)) if ended != began else ()
        out = [
            Sample(
                f"{gid}-s{j}",
                gid,
                (1, 2),
                (5, 6, 7, 8),
                rollout_logprobs=(-0.1,) * 4,
                weight_version=began,
                weight_versions=boundaries,
            )
            for j in range(self.samples_per_group)
        ]
        self.generated += out
        return out


class Producer:
    def __init__(self, engine: Engine, groups: int) -> None:
        self.engine = engine
        self.groups = groups
        self._next = 0

    async def first(
        self,
        batch_id: int,
        collector: DeferredCollector,
        *,
        on_group: Callable[[int], None] | None = None,
    ) -> None:
        async def one() -> None:
            collector.add(await self.engine.group(batch_id, self._take()))

        await gather_all([one() for _ in range(self.groups)])

    async def generate(self, batch_id: int, *, groups: int | None = None, **_: Any) -> Any:
        return await gather_all(
            [self.engine.group(batch_id, self._take()) for _ in range(groups or 0)]
        )

    def _take(self) -> int:
        self._next += 1
        return self._next - 1


class Judge:
    name, role, models = "judge", "judge", ()
    fields = REWARD_FIELDS
    streaming = True

    def __init__(self, gates: Gates) -> None:
        self.gates = gates

    async def run(self, samples: Sequence[Sample], ctx: StageContext) -> StageReport:
        await self.gates.wait("score")
        for s in samples:
            s.fields["rewards"] = {"judge": 1.0}
            s.fields["reward"] = 1.0
        return StageReport(self.name, {"scored": len(samples)})


class Trainer:
    def __init__(self, gates: Gates, coord: Any, sink: MemoryBatchSink, engine: Engine) -> None:
        self.gates = gates
        self.coord = coord
        self.sink = sink
        self.engine = engine
        self.version = 0
        self.trained: list[tuple[int, list[Sample], int]] = []
        self.asked_before_commit: list[int] = []

    async def train(self, batch_id: int) -> dict[str, Any]:
        if self.coord.batch_state(batch_id) is not BatchState.COMMITTED:
            self.asked_before_commit.append(batch_id)
        receipt = await self.coord.wait_committed(batch_id, timeout=30)
        samples = await self.sink.get(receipt.partition)
        await self.gates.wait("train")
        self.trained.append((batch_id, list(samples), self.version))
        self.version += 1
        await self.sink.delete(partition_name(batch_id))
        return {"samples": len(samples)}

    async def push(self, version: str) -> dict[str, Any]:
        gpu = self.engine.gpu
        if gpu is not None:
            gpu.require("policy", f"push {version} began")
        await self.gates.wait("push")
        if gpu is not None:
            gpu.require("policy", f"push {version} ended")
        self.engine.incoming.append(version)
        return {"weight_version": version}


class DriverMachine(RuleBasedStateMachine):
    @initialize(
        steps=st.integers(2, 4),
        k=st.integers(0, 2),
        groups=st.integers(1, 3),
        action=st.sampled_from(["regenerate", "drop"]),
        stream=st.booleans(),
        switching=st.booleans(),
    )
    def start(
        self, steps: int, k: int, groups: int, action: str, stream: bool, switching: bool
    ) -> None:
        self.loop = asyncio.new_event_loop()
        self.k = k
        self.steps = steps
        self.gates = Gates()
        self.gpu = Gpu() if switching else None
        if self.gpu is not None:
            self.coord = LifecycleCoordinator(
                slices={"policy": "gpu0", "judge": "gpu0"},
                managers={"judge": [GpuHandle(self.gpu, "judge")]},
                generation_role="policy",
                residency=ResidencyPlan(free=frozenset(), mode="exclusive"),
            )
        else:
            self.coord = coordinator()
        self.sink = MemoryBatchSink()
        self.engine = Engine(self.gates, 2, self.gpu)
        self.trainer = Trainer(self.gates, self.coord, self.sink, self.engine)
        self.outcomes: list[Any] = []
        self.faults: dict[str, int] = {}
        #: the steps whose batch was empty (every group stale and dropped): skipped
        self.skipped: list[_StepFailure] = []

        async def skipped(failure: _StepFailure) -> None:
            assert failure.skipped and isinstance(failure.error, EmptyBatchError), failure
            self.skipped.append(failure)

        self.driver = StepDriver(
            DriverSettings(
                steps=steps, prompts_per_step=groups, max_staleness=k, stale_action=action,
                stream_scoring=stream, on_empty_batch="skip",
            ),
            coordinator=self.coord,
            rollout=handle() if self.gpu is None else GpuHandle(self.gpu, "policy"),
            stages=[Judge(self.gates)],
            sink=self.sink,
            clients=RoleClients({}),
            producer=lambda: Producer(self.engine, groups),
            trainer=self.trainer,
            generation_role="policy",
            deferred_roles=() if self.gpu is None else ("judge",),
            initial_version="0",
            switching=self.gpu is not None,
            timeline=Timeline(registry=_registry()),
            on_step=self.outcomes.append,
            on_failed=skipped,
        )  # fmt: skip
        self.task = self.loop.create_task(self.driver.run())
        self._settle()

    def _settle(self) -> None:
        async def spin() -> None:
            for _ in range(50):
                await asyncio.sleep(0)

        self.loop.run_until_complete(spin())

    def _can(self, kind: str) -> bool:
        return not self.task.done() and self.gates.pending(kind) > 0

    @rule()
    def nothing_happens(self) -> None:
        """No engine finishes anything for a while (the run may have ended already)."""
        self._settle()

    @precondition(lambda self: self._can("group"))
    @rule()
    def generate_group(self) -> None:
        self.gates.release("group")
        self._settle()

    @precondition(lambda self: self._can("score"))
    @rule()
    def score_group(self) -> None:
        self.gates.release("score")
        self._settle()

    @precondition(lambda self: self._can("train"))
    @rule()
    def train_batch(self) -> None:
        self.gates.release("train")
        self._settle()

    @precondition(lambda self: self._can("push"))
    @rule()
    def confirm_push(self) -> None:
        self.gates.release("push")
        self._settle()

    @precondition(lambda self: not self.task.done() and self.engine.incoming)
    @rule()
    def push_reaches_engine(self) -> None:
        self.engine.land()
        self._settle()

    @precondition(lambda self: not self.task.done() and not self.faults)
    @rule(kind=st.sampled_from(KINDS))
    def fault(self, kind: str) -> None:
        if self.gates.pending(kind) == 0:
            return
        self.faults[kind] = self.driver.committing
        self.gates.release(kind, fail=True)
        self._settle()

    @invariant()
    def staleness_bounded(self) -> None:
        if not hasattr(self, "trainer"):
            return
        skipped = [f.step for f in self.skipped]

        def optimizer_steps(index: int) -> int:
            # the weights named after step ``index``: steps that trained nothing don't count
            return index - sum(1 for n in skipped if n < index)

        for step, samples, version in self.trainer.trained:
            assert version == optimizer_steps(step)
            for s in samples:
                oldest = min(int(v) for _, v in s.versions)
                assert version - optimizer_steps(oldest) <= self.k, (s.id, s.versions, version)

    @invariant()
    def turns_taken(self) -> None:
        gpu = getattr(self, "gpu", None)
        if gpu is not None:
            assert gpu.breaches == [], gpu.breaches
            assert len(gpu.awake) <= 1, gpu.awake

    @invariant()
    def gated(self) -> None:
        if hasattr(self, "trainer"):
            assert self.trainer.asked_before_commit == []

    def teardown(self) -> None:
        if not hasattr(self, "loop"):
            return
        try:
            # Let every pending phase finish (pushes reaching the engine at once), then check.
            for _ in range(10_000):
                if self.task.done():
                    break
                released = False
                for kind in KINDS:
                    if self.gates.pending(kind):
                        self.gates.release(kind)
                        released = True
                while self.engine.incoming:
                    self.engine.land()
                    released = True
                self._settle()
                if not released and not self.task.done():
                    self.loop.run_until_complete(asyncio.sleep(0.001))
            assert self.task.done(), "the driver did not finish"
            self._check_end()
        finally:
            if not self.task.done():
                self.task.cancel()
                self.loop.run_until_complete(asyncio.gather(self.task, return_exceptions=True))
            self.loop.close()

    def _check_end(self) -> None:
        error = self.task.exception()
        trained = [s.id for _, samples, _ in self.trainer.trained for s in samples]
        assert len(trained) == len(set(trained)), "a sample was trained on twice"
        dropped: dict[str, str] = {}
        for o in self.outcomes:
            for d in o.batch.dropped:
                assert d.reason
                for sid in d.samples:
                    dropped[sid] = d.reason
            for d in o.result.dropped:
                assert d.stage == STALENESS_STAGE
        generated = {s.id for s in self.engine.generated}
        # a skipped step: every group dropped, nothing committed nor trained, all reported
        skipped = {s.id for f in self.skipped for s in f.samples}
        for f in self.skipped:
            assert all(step != f.step for step, _, _ in self.trainer.trained)
        assert not skipped & set(trained)
        dropped = {**dropped, **dict.fromkeys(skipped, "skipped")}
        if error is None:
            assert not self.faults
            assert len(self.trainer.trained) == self.steps - len(self.skipped)
            assert generated == set(trained) | set(dropped)
            assert not set(trained) & set(dropped)
            return
        assert isinstance(error, _StepFailure), error
        assert self.faults, f"the run failed with no fault: {error!r}"
        failed = error.step
        reported = {s.id for s in (*error.samples, *error.ahead)}
        assert generated == set(trained) | set(dropped) | reported
        assert all(step < failed for step, _, _ in self.trainer.trained)
        if not {"train", "push"} & set(self.faults):
            # generation or a stage failed: nothing of the batch, nor after it, committed
            for n in range(failed, self.steps):
                assert self.coord.batch_state(n) is not BatchState.COMMITTED


def _registry() -> Any:
    from prometheus_client import CollectorRegistry

    return CollectorRegistry()


TestDriver = DriverMachine.TestCase
TestDriver.settings = machine_settings(120, 40)


@pytest.mark.parametrize("k", [0, 1, 2])
def test_a_lagging_engine_never_trains_stale_samples(k: int) -> None:
    """A push that reaches the engine only after the trainer's push returned: the groups it
    generated meanwhile carry the old version and are regenerated (dropped and counted)."""
    from relax_bench._steps_sim import SimJudge, SimRollout, SimTrainer, Times

    async def go() -> list[Any]:
        times = Times(generate_s=0.02, score_s=0.02, train_s=0.02, push_s=0.0, groups=3)
        coord = coordinator()
        sink = MemoryBatchSink()
        rollout = SimRollout(times, lag=2)
        trainer = SimTrainer(times, coord, sink, rollout)
        outcomes: list[Any] = []
        await StepDriver(
            DriverSettings(steps=5, prompts_per_step=3, max_staleness=k),
            coordinator=coord, rollout=handle(), stages=[SimJudge(times)], sink=sink,
            clients=RoleClients({}), producer=rollout.producer, trainer=trainer,
            generation_role="policy", initial_version="0",
            timeline=Timeline(registry=_registry()), on_step=outcomes.append,
        ).run()  # fmt: skip
        for _step, samples, version in trainer.trained:
            for s in samples:
                assert version - min(int(v) for _, v in s.versions) <= k
        return outcomes

    outcomes = asyncio.run(go())
    assert max(o.metrics["max_staleness_seen"] for o in outcomes) <= k
    if k == 0:
        assert sum(o.metrics["stale"]["dropped_groups"] for o in outcomes) > 0
        assert sum(o.metrics["stale"]["regenerated_groups"] for o in outcomes) > 0


def test_switching_a_push_waits_for_rollouts_turn() -> None:
    """A defer layout: training overlaps the next generation, but a push that comes while the
    judge holds the GPU waits until the policy is onloaded for the next step."""
    m = DriverMachine()
    m.start(steps=3, k=1, groups=1, action="drop", stream=False, switching=True)
    try:
        assert m.gpu is not None
        m.generate_group()  # step 0 generated; the commit lane offloads the policy
        assert m.gpu.awake == {"judge"}
        m.score_group()  # step 0 committed; the policy onloaded for step 1
        assert m.gpu.awake == {"policy"} and m.gates.pending("train") == 1
        m.generate_group()  # step 1 generated while step 0 trains: the judge's turn again
        assert m.gpu.awake == {"judge"} and m.gates.pending("train") == 1
        m.train_batch()  # step 0 trained: the push of version 1 must wait
        assert m.gates.pending("push") == 0
        m.score_group()  # step 1 committed: the policy onloaded for step 2, the push goes
        assert m.gpu.awake == {"policy"} and m.gates.pending("push") == 1
        assert m.gpu.breaches == []
    finally:
        m.teardown()
    assert m.task.exception() is None
    # every step trained, or skipped for an empty batch (the engine got version 1 only after
    # step 2's one group was generated: stale, dropped; an empty batch is never trained)
    trained = [step for step, _, _ in m.trainer.trained]
    assert sorted(trained + [f.step for f in m.skipped]) == [0, 1, 2] and trained[:2] == [0, 1]
    assert m.gpu.breaches == []


def test_a_train_fault_while_the_next_step_is_half_generated_reports_its_samples() -> None:
    # Found by TestDriver: the run's stop cancelled the generation lane twice; the second cut
    # its cleanup short and the half-generated step's samples were in no report.
    state = DriverMachine()
    state.start(steps=3, k=2, groups=2, action="regenerate", stream=True, switching=False)
    for name in ("generate_group",) * 4 + ("score_group", "generate_group", "score_group"):
        getattr(state, name)()
    state.fault(kind="train")
    state.teardown()  # every generated sample trained, dropped or reported

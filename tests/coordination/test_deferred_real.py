"""Deferred scoring with real managers and real hf engines on a local Ray, and each defer row of
the reference's failure table produced for real.

One module-scoped job: a rollout manager in this process (the producer offloads it itself), a
genrm manager (one replica) and a teacher manager (two replicas) each hosted by a CPU-only Ray
actor and publishing into a role registry actor; all three share one defer slice. Every test
gets its own coordinator actor and batch sink; the engines are shared (each test starts from
rollout READY, genrm and teacher SLEEPING) and every process is checked gone at the end.
"""

from __future__ import annotations

import asyncio
import itertools
import json
import math
import os
import signal
import subprocess
import sys
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import pytest
from relax_teacher import DistillationStage

from relax_core.client.client import InferenceClient
from relax_core.coordination import (
    DeferredBatch,
    DeferredCollector,
    LeaseState,
    LocalManagerHandle,
    RayBatchSink,
    RewardStage,
    RoleClients,
    Sample,
    StageContext,
    StageReport,
    Timeline,
    abort_generation,
    start_coordinator,
)
from relax_core.discovery.actor import start_registry_actor
from relax_core.discovery.publisher import RegistryPublisher
from relax_core.discovery.schema import RoutingSpec
from relax_core.engine.spec import InferenceEngineSpec
from relax_core.errors import (
    BatchFailedError,
    LeaseBlockedError,
    LifecycleError,
    ScoringError,
    SinkError,
)
from relax_core.manager import InferenceManager, ManagerTimeouts, ModelLaunch, ReplicaPlacement
from relax_core.manager.actor import start_manager_actor
from relax_core.records import RewardSpec
from relax_core.testing import wait_for
from tests.support import manager as support

pytestmark = [pytest.mark.ray, pytest.mark.slow]

#: The coordinator's deadline of one manager RPC: short, so a SIGSTOPped engine times out fast,
#: yet far above a micro model's onload or offload on a busy 2-core machine.
RPC_DEADLINE = 8.0
#: The managers' own deadlines: long enough for a busy machine, short enough that the manager's
#: late reply to a SIGSTOPped engine's offload arrives within a test.
TIMEOUTS = ManagerTimeouts(
    start=120.0, offload=12.0, onload=30.0, drain=5.0, update=60.0, health=10.0, shutdown=10.0
)
SLICES = {"rollout": "actor:0-1", "genrm": "actor:0-1", "teacher": "actor:0-1"}
_JOBS = itertools.count()


class Job:
    """The shared engines: rollout (local), genrm and teacher (manager actors)."""

    def __init__(self) -> None:
        import ray
        from ray.util.placement_group import placement_group

        pm = support.plugins()
        self.plugins = pm
        self.model = support.tiny_model()
        self.group = placement_group([{"GPU": 1.0, "CPU": 0.01}] * 2, strategy="PACK")
        ray.get(self.group.ready(), timeout=60)
        backend = pm.engine_backend("hf")

        def placement(replicas: int) -> ReplicaPlacement:
            # Every role on the same two bundles, a quarter of each GPU per worker.
            return ReplicaPlacement(
                self.group, [[[i % 2]] for i in range(replicas)], ray_gpu_fraction=0.25
            )

        def launch(name: str) -> ModelLaunch:
            return ModelLaunch(model_path=self.model, served_model_name=name)

        self.rollout_publisher = RegistryPublisher("rollout", RoutingSpec(default_model="policy"))
        self.rollout = InferenceManager(
            "policy",
            spec=InferenceEngineSpec(
                role="rollout", weight_source=pm.weight_source("ACTOR"), weights_cpu_backup=True
            ),
            backend=backend,
            launch=launch("policy"),
            placement=placement(1),
            publisher=self.rollout_publisher,
            timeouts=TIMEOUTS,
        )
        self.registries = {
            "genrm": start_registry_actor("genrm", RoutingSpec(default_model="judge")),
            "teacher": start_registry_actor("teacher", RoutingSpec(default_model="math")),
        }
        static = pm.weight_source("STATIC")
        self.actors = {
            role: start_manager_actor(
                model,
                spec=InferenceEngineSpec(role=role, weight_source=static),
                backend=backend,
                launch=launch(model),
                placement=placement(replicas),
                publisher=self.registries[role],
                timeouts=TIMEOUTS,
            )
            for role, model, replicas in (("genrm", "judge", 1), ("teacher", "math", 2))
        }
        self.pids: set[int] = set()

    def start(self) -> None:
        import ray

        refs = {role: actor.start.remote() for role, actor in self.actors.items()}
        self.rollout.start().raise_for_failures()
        for role, ref in refs.items():
            ray.get(ref, timeout=240).raise_for_failures()
            # Deferred roles start, then sleep: only the coordinator wakes them.
            ray.get(self.actors[role].offload.remote(), timeout=120).raise_for_failures()
        self.track()

    def engine_pids(self, role: str) -> list[int]:
        import ray

        if role == "rollout":
            pids = self.rollout.engine_pids()
        else:
            pids = ray.get(self.actors[role].engine_pids.remote(), timeout=30)
        return [p for ps in pids.values() for p in ps if p]

    def states(self, role: str) -> dict[str, str]:
        import ray

        if role == "rollout":
            return self.rollout.states()
        return dict(ray.get(self.actors[role].states.remote(), timeout=60))

    def track(self) -> None:
        for role in ("rollout", "genrm", "teacher"):
            self.pids.update(self.engine_pids(role))

    def reset(self) -> None:
        """Every test starts from rollout READY, genrm and teacher SLEEPING."""
        import ray

        for pid in self.pids:
            support.signal_quietly(pid, signal.SIGCONT)
        for actor in self.actors.values():
            ray.get(actor.recover.remote(), timeout=240)
            ray.get(actor.offload.remote(), timeout=120).raise_for_failures()
        self.rollout.recover()
        self.rollout.onload().raise_for_failures()
        self.track()

    def shutdown(self) -> None:
        import ray

        for pid in self.pids:
            support.signal_quietly(pid, signal.SIGCONT)
        for actor in self.actors.values():
            ray.get(actor.shutdown.remote(), timeout=120)
            ray.kill(actor, no_restart=True)
        self.rollout.shutdown()
        for registry in self.registries.values():
            registry.stop()
        ray.util.remove_placement_group(self.group)


@pytest.fixture(scope="module")
def job(ray_local: Any) -> Iterator[Job]:
    started = Job()
    try:
        started.start()
        yield started
    finally:
        started.shutdown()
        wait_for(
            lambda: not any(support.pid_alive(p) for p in started.pids),
            timeout=30,
            what="every engine process gone",
        )


class Step:
    """One test's coordinator, sink and the producer's view of the rollout engine."""

    def __init__(self, job: Job) -> None:
        self.job = job
        self.name = f"deferred-{os.getpid()}-{next(_JOBS)}"
        self.coordinator = start_coordinator(
            self.name,
            slices=SLICES,
            managers={
                "genrm": [("genrm.judge", job.actors["genrm"])],
                "teacher": [("teacher.math", job.actors["teacher"])],
            },
            generation_role="rollout",
            operation_timeout=RPC_DEADLINE,
        )
        self.sink = RayBatchSink.start()
        self.rollout = LocalManagerHandle(job.rollout)
        self.fetches = {"genrm": 0, "teacher": 0}
        self.clients = RoleClients(
            {role: self._counting(role) for role in ("genrm", "teacher")}, ttl=600.0
        )

    def _counting(self, role: str) -> Any:
        fetch = self.job.registries[role].fetch

        async def provider() -> dict[str, Any]:
            self.fetches[role] += 1
            return await fetch()

        return provider

    def close(self) -> None:
        self.coordinator.stop()
        self.sink.stop()

    async def generate(self, batch_id: int, groups: int = 4, n: int = 2) -> DeferredCollector:
        """The producer: ``groups`` prompts x ``n`` samples from the real rollout engine."""
        collector = DeferredCollector(batch_id)
        async with InferenceClient(snapshot_provider=self.job.rollout_publisher.snapshot) as c:
            for g in range(groups):
                prompt = [5 + g, 17, 42 + g, 9]
                group = []
                for i in range(n):
                    sampling = {"max_new_tokens": 4, "temperature": 1.0, "ignore_eos": True}
                    out = await c.generate(
                        {"input_ids": prompt, "sampling_params": sampling, "return_logprob": True}
                    )
                    meta = out["meta_info"]
                    group.append(
                        Sample(
                            f"b{batch_id}-g{g}-s{i}",
                            f"b{batch_id}-g{g}",
                            prompt,
                            out["output_ids"],
                            prompt=f"question {g}: {prompt}",
                            response=out["text"],
                            label="4" if g % 2 == 0 else None,
                            rollout_logprobs=[e[0] for e in meta["output_token_logprobs"]],
                            weight_version=meta.get("weight_version"),
                        )
                    )
                collector.add(group)
        return collector

    def batch(
        self, batch_id: int, samples: Sequence[Sample], stages: Sequence[Any], **kw: Any
    ) -> DeferredBatch:
        return DeferredBatch(
            batch_id, samples, coordinator=self.coordinator, rollout=self.rollout,
            stages=stages, sink=self.sink, clients=self.clients, release_timeout=RPC_DEADLINE,
            **kw,
        )  # fmt: skip

    def lease(self, role: str) -> LeaseState:
        status = asyncio.run(self.coordinator.describe())
        return LeaseState(status.leases[role])


@pytest.fixture
def step(job: Job) -> Iterator[Step]:
    job.reset()
    s = Step(job)
    try:
        yield s
    finally:
        s.close()
        job.track()


def reward_stage(job: Job, *extra: RewardSpec) -> RewardStage:
    judge = job.plugins.reward_adapter("genrm-judge")
    exact = job.plugins.reward_adapter("exact-match")
    return RewardStage([judge, (exact, 0.5), *extra], name="genrm", role="genrm")


def teacher_stage() -> DistillationStage:
    return DistillationStage("teacher", top_k=2)


class Stop(RewardStage):
    """The judge stage, then SIGSTOP of the genrm engine (so its offload hangs)."""

    def __init__(self, job: Job) -> None:
        base = reward_stage(job)
        super().__init__(list(base.adapters), name="genrm", role="genrm")
        self.job = job

    async def run(self, samples: Sequence[Sample], ctx: StageContext) -> StageReport:
        report = await super().run(samples, ctx)
        for pid in self.job.engine_pids("genrm"):
            os.kill(pid, signal.SIGSTOP)
        return report


def test_a_deferred_step_scores_distills_commits_and_leaves_every_role_sleeping(
    step: Step, tmp_path: Path
) -> None:
    trace = tmp_path / "run.trace.json"
    timeline = Timeline(trace_path=str(trace))

    async def go() -> Any:
        waiter = asyncio.ensure_future(step.coordinator.wait_committed(0, timeout=300))
        await step.coordinator.begin_batch(0)
        collector = await step.generate(0)
        stages = [reward_stage(step.job), teacher_stage()]
        result = await step.batch(0, collector.samples, stages, timeline=timeline).run()
        return collector, result, await waiter, await step.sink.get("train_0")

    collector, result, receipt, committed = asyncio.run(go())
    assert receipt == result.receipt and (receipt.partition, receipt.count) == ("train_0", 8)
    assert [s.id for s in committed] == [s.id for s in collector.samples]
    for s in committed:
        assert isinstance(s.reward, float) and math.isfinite(s.reward)
        # exact-match scores labelled samples only (its label_matcher); the judge every one.
        wanted = {"genrm-judge", "exact-match"} if s.label is not None else {"genrm-judge"}
        assert set(s.rewards) == wanted
        tokens = len(s.response_ids)
        assert tokens == 4 and len(s.fields["teacher_logprobs"]) == tokens
        assert [len(r) for r in s.fields["teacher_topk_ids"]] == [2] * tokens
        assert all(row[0] >= row[1] for row in s.fields["teacher_topk_logprobs"])
    judge = next(r for r in result.reports if r.stage == "genrm")
    assert judge.counts["genrm-judge.scored"] == 8
    assert 0 <= judge.counts["genrm-judge.parse_failures"] <= 8  # a micro model rarely judges
    # One teacher replica per group, both replicas used, one discovery fetch for 8 prefills.
    teacher = next(r for r in result.reports if r.stage == "teacher")
    engines = teacher.details["group_engines"]
    assert len(engines) == 4 and set(engines.values()) == {"math/replica-0", "math/replica-1"}
    assert step.fetches == {"genrm": 1, "teacher": 1}
    # Every role sleeps, as the coordinator and the managers see it.
    status = asyncio.run(step.coordinator.describe())
    assert set(status.leases.values()) == {"SLEEPING"} and status.failure is None
    for role in ("rollout", "genrm", "teacher"):
        assert set(step.job.states(role).values()) == {"SLEEPING"}, role
    # The timeline: every phase of the batch, in a trace Perfetto opens.
    events = {e["name"] for e in json.loads(trace.read_text())["traceEvents"] if e["ph"] == "X"}
    assert events >= {
        "rollout.offload", "rollout.ack", "genrm.onload", "genrm", "genrm.offload",
        "teacher.onload", "teacher", "teacher.offload", "validate", "write_back", "sink_put",
        "commit",
    }  # fmt: skip


def test_an_offload_timeout_blocks_the_lease_and_the_teacher_is_never_activated(
    step: Step,
) -> None:
    async def go() -> tuple[BaseException, BaseException]:
        waiter = asyncio.ensure_future(step.coordinator.wait_committed(0, timeout=300))
        await step.coordinator.begin_batch(0)
        collector = await step.generate(0, groups=2)
        batch = step.batch(0, collector.samples, [Stop(step.job), teacher_stage()])
        with pytest.raises(LeaseBlockedError) as blocked:
            await batch.run()
        with pytest.raises(BatchFailedError) as failed:
            await waiter
        return blocked.value, failed.value

    blocked, failed = asyncio.run(go())
    assert blocked.role == "genrm" and f"not confirmed within {RPC_DEADLINE:g}s" in blocked.reason
    assert "relax coordinator reset" in str(blocked)
    assert failed.batch_id == 0 and "deactivate genrm" in failed.cause
    status = asyncio.run(step.coordinator.describe())
    assert status.leases == {"rollout": "SLEEPING", "genrm": "BLOCKED", "teacher": "SLEEPING"}
    assert status.batch_state == "FAILED"
    assert set(step.job.states("teacher").values()) == {"SLEEPING"}  # never onloaded

    # The engine comes back and the manager's offload completes late: still BLOCKED.
    for pid in step.job.engine_pids("genrm"):
        os.kill(pid, signal.SIGCONT)
    wait_for(
        lambda: bool(asyncio.run(step.coordinator.describe()).late_replies),
        timeout=120,
        what="the late offload reply",
    )
    assert step.lease("genrm") is LeaseState.BLOCKED

    # Only the operator leaves BLOCKED, through the CLI, and only confirming the GPUs clean.
    import ray

    address = ray.get_runtime_context().gcs_address
    base = [sys.executable, "-m", "relax_core", "coordinator"]
    where = ["--address", address, "--job", step.name]
    refused = subprocess.run(
        [*base, "reset", *where, "--role", "genrm"], capture_output=True, text=True, timeout=120
    )
    assert refused.returncode == 2 and "--confirm-clean" in refused.stderr
    assert step.lease("genrm") is LeaseState.BLOCKED
    shown = subprocess.run(
        [*base, "status", *where], capture_output=True, text=True, timeout=120, check=True
    )
    assert "genrm" in shown.stdout and "BLOCKED" in shown.stdout and "late reply" in shown.stdout
    done = subprocess.run(
        [*base, "reset", *where, "--role", "genrm", "--confirm-clean"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, done.stderr
    assert step.lease("genrm") is LeaseState.SLEEPING


@pytest.mark.parametrize(
    ("adapter", "match"),
    [
        # A rule that needs a numeric label: samples without one make it raise, in its worker.
        (
            RewardSpec(name="numeric", fn=lambda response, label: float(label)),
            r"numeric: raised for sample .*TypeError: float\(\) argument",
        ),
        # A non-finite reward fails the stage naming the adapter and the sample.
        (
            RewardSpec(name="nan", fn=lambda response, label: math.nan),
            r"nan: returned nan for sample b0-g\d-s\d \(group b0-g\d\); a reward must be a "
            "finite number",
        ),
    ],
    ids=["scoring", "non-finite"],
)
def test_a_scoring_or_validation_failure_fails_the_batch_and_writes_nothing_back(
    step: Step, adapter: RewardSpec, match: str
) -> None:
    async def go() -> list[Sample]:
        waiter = asyncio.ensure_future(step.coordinator.wait_committed(0, timeout=300))
        await step.coordinator.begin_batch(0)
        collector = await step.generate(0, groups=2)
        stages = [reward_stage(step.job, adapter), teacher_stage()]
        with pytest.raises(ScoringError, match=match):
            await step.batch(0, collector.samples, stages).run()
        with pytest.raises(BatchFailedError):
            await waiter
        return collector.samples

    originals = asyncio.run(go())
    for s in originals:
        assert s.reward is None and s.rewards == {} and "teacher_logprobs" not in s.fields
    status = asyncio.run(step.coordinator.describe())
    assert status.batch_state == "FAILED" and set(status.leases.values()) == {"SLEEPING"}, (
        status.leases,
        status.blocked,
        status.late_replies,
    )
    assert asyncio.run(step.sink.partitions()) == {}


def test_a_sink_put_failure_does_not_commit(step: Step) -> None:
    async def go() -> None:
        waiter = asyncio.ensure_future(step.coordinator.wait_committed(0, timeout=300))
        await step.coordinator.begin_batch(0)
        collector = await step.generate(0, groups=2)
        step.sink.stop()  # the store actor dies before the put
        with pytest.raises(SinkError, match=r"train_0.*put failed"):
            await step.batch(0, collector.samples, [teacher_stage()]).run()
        with pytest.raises(BatchFailedError, match="SinkError"):
            await waiter

    asyncio.run(go())
    status = asyncio.run(step.coordinator.describe())
    assert status.batch_state == "FAILED" and status.committed == 0


def test_a_finalizer_failing_after_the_put_deletes_the_partition_and_does_not_commit(
    step: Step, tmp_path: Path
) -> None:
    def save(batch_id: int, samples: Sequence[Sample]) -> None:
        (tmp_path / "no-such-dir" / f"batch-{batch_id}.json").write_text(str(len(samples)))

    async def go() -> None:
        waiter = asyncio.ensure_future(step.coordinator.wait_committed(0, timeout=300))
        await step.coordinator.begin_batch(0)
        collector = await step.generate(0, groups=2)
        batch = step.batch(0, collector.samples, [teacher_stage()], finalizer=save)
        with pytest.raises(BatchFailedError, match=r"finalizer failed.*train_0' deleted"):
            await batch.run()
        with pytest.raises(BatchFailedError):
            await waiter

    asyncio.run(go())
    assert asyncio.run(step.sink.partitions()) == {}
    assert asyncio.run(step.coordinator.describe()).committed == 0


def test_a_producer_failure_after_begin_batch_releases_rollout_once_its_offload_is_confirmed(
    step: Step,
) -> None:
    async def go() -> BatchFailedError:
        await step.coordinator.begin_batch(0)
        try:
            async with InferenceClient(snapshot_provider=step.job.rollout_publisher.snapshot) as c:
                await c.generate({"input_ids": [10**9], "sampling_params": {"max_new_tokens": 2}})
        except Exception as exc:  # the engine refuses the token id: the producer fails
            return await abort_generation(step.coordinator, 0, step.rollout, exc)
        raise AssertionError("the out-of-vocabulary prompt was accepted")

    error = asyncio.run(go())
    assert "generation failed" in str(error) and "release unconfirmed" not in str(error)
    assert step.lease("rollout") is LeaseState.SLEEPING
    assert set(step.job.states("rollout").values()) == {"SLEEPING"}
    assert asyncio.run(step.coordinator.describe()).batch_state == "FAILED"


def test_a_producer_failure_with_an_unconfirmed_release_keeps_the_lease_blocked(
    step: Step,
) -> None:
    pids = step.job.engine_pids("rollout")

    async def go() -> BatchFailedError:
        await step.coordinator.begin_batch(0)
        for pid in pids:
            os.kill(pid, signal.SIGSTOP)  # the engine hangs: its offload cannot be confirmed
        try:
            return await abort_generation(
                step.coordinator, 0, step.rollout, RuntimeError("generation hung"), timeout=3.0
            )
        finally:
            for pid in pids:
                os.kill(pid, signal.SIGCONT)

    error = asyncio.run(go())  # returns once the manager's own offload has ended
    assert "release unconfirmed" in str(error) and "generation hung" in str(error)
    # The engine runs again and the manager's offload has ended (its outcome, SLEEPING or
    # FAILED, is the manager's): whatever it was, the lease stays BLOCKED.
    assert set(step.job.states("rollout").values()) <= {"SLEEPING", "FAILED"}
    assert step.lease("rollout") is LeaseState.BLOCKED


def test_a_student_restore_failure_releases_the_rollout_lease_in_finally(step: Step) -> None:
    async def go() -> None:
        await step.coordinator.begin_batch(0)
        collector = await step.generate(0, groups=2)
        samples = collector.samples
        for s in samples:
            s.weight_version = "stale"  # generated by weights rollout no longer has
        student = DistillationStage("rollout", student=True)
        with pytest.raises(LifecycleError, match="came back with weight version"):
            await step.batch(0, samples, [student]).run()

    asyncio.run(go())
    assert step.lease("rollout") is LeaseState.SLEEPING
    assert set(step.job.states("rollout").values()) == {"SLEEPING"}
    assert asyncio.run(step.coordinator.describe()).batch_state == "FAILED"


class KillRollout(RewardStage):
    """The judge stage (rollout is offloaded for it), then SIGKILL of rollout's engine while
    it sleeps: the student stage's restore (its onload) meets a dead engine."""

    def __init__(self, job: Job) -> None:
        base = reward_stage(job)
        super().__init__(list(base.adapters), name="genrm", role="genrm")
        self.job = job
        self.killed: list[int] = []

    async def run(self, samples: Sequence[Sample], ctx: StageContext) -> StageReport:
        report = await super().run(samples, ctx)
        assert set(self.job.states("rollout").values()) == {"SLEEPING"}
        self.killed = self.job.engine_pids("rollout")
        for pid in self.killed:
            os.kill(pid, signal.SIGKILL)
        return report


def test_a_student_restore_that_really_fails_names_the_replica_and_tries_the_release_in_finally(
    step: Step,
) -> None:
    killer = KillRollout(step.job)

    async def go() -> None:
        await step.coordinator.begin_batch(0)
        collector = await step.generate(0, groups=2)
        student = DistillationStage("rollout", student=True)
        with pytest.raises(LifecycleError) as info:
            await step.batch(0, collector.samples, [killer, student]).run()
        message = str(info.value)
        assert message.startswith("student restore of 'rollout': onload of model 'policy'"), message
        assert "policy/replica-0: failed FAILED (onload of policy/replica-0:" in message, message
        # The finally released rollout: an offload of the dead replica, which is no
        # confirmation (its memory is not known free), so the release is reported unconfirmed.
        notes = "\n".join(getattr(info.value, "__notes__", []))
        assert "then releasing the roles it used failed too" in notes, notes
        assert "rollout release unconfirmed" in notes, notes

    asyncio.run(go())
    assert killer.killed
    # A killed engine is gone once the kernel has torn it down (its memory first, which a loaded
    # machine takes its time over): within a deadline, not at once.
    wait_for(
        lambda: not any(support.pid_alive(p) for p in killer.killed),
        timeout=20,
        what=f"killed rollout engines {killer.killed} gone",
    )
    # Fail-stop: the lease is BLOCKED, never handed on, and the batch FAILED.
    assert step.lease("rollout") is LeaseState.BLOCKED
    assert asyncio.run(step.coordinator.describe()).batch_state == "FAILED"
    assert step.lease("genrm") is LeaseState.SLEEPING


def test_a_batch_cancelled_while_genrm_judges_aborts_its_requests_and_genrm_serves_again(
    step: Step,
) -> None:
    genrm = step.job.actors["genrm"]

    async def judge_at_length(response: str, label: str | None, *, context: Any) -> float:
        # Long enough that the cancellation finds it in the engine.
        await context.client("genrm").generate(
            {"input_ids": [5, 17, 42, 9], "sampling_params": {"max_new_tokens": 400,
             "ignore_eos": True}}
        )  # fmt: skip
        return 1.0

    slow = RewardSpec(name="slow-judge", fn=judge_at_length, mode="async", supports_deferred=True)

    async def in_flight() -> int:
        states = await genrm.admission_states.remote()
        return sum(int(s.get("inflight", 0)) for s in states.values())

    async def go() -> BaseException:
        waiter = asyncio.ensure_future(step.coordinator.wait_committed(0, timeout=300))
        await step.coordinator.begin_batch(0)
        collector = await step.generate(0, groups=2)
        stage = RewardStage([slow], name="genrm", role="genrm")
        batch = asyncio.ensure_future(step.batch(0, collector.samples, [stage]).run())
        deadline = asyncio.get_running_loop().time() + 60
        while await in_flight() == 0:
            assert asyncio.get_running_loop().time() < deadline, "no judge request in flight"
            await asyncio.sleep(0.02)
        batch.cancel()  # what Ctrl-C does to the step in flight
        with pytest.raises(asyncio.CancelledError):
            await batch
        with pytest.raises(BatchFailedError) as info:
            await waiter
        return info.value

    error = asyncio.run(go())
    assert "interrupted" in str(error)
    # Its requests aborted, genrm offloaded and confirmed: nothing BLOCKED, every role asleep.
    status = asyncio.run(step.coordinator.describe())
    assert status.blocked == {} and set(status.leases.values()) == {"SLEEPING"}, status
    assert set(step.job.states("genrm").values()) == {"SLEEPING"}
    assert asyncio.run(in_flight()) == 0

    # The engine was continued after its release: the next run's judge stage is served.
    step.job.rollout.onload().raise_for_failures()
    again = Step(step.job)
    try:

        async def next_batch() -> Any:
            await again.coordinator.begin_batch(0)
            collector = await again.generate(0, groups=2)
            return await again.batch(0, collector.samples, [reward_stage(step.job)]).run()

        result = asyncio.run(next_batch())
    finally:
        again.close()
    assert result.receipt.count == 4

"""DeferredBatch in one process: the order of a step, write-back only after validation, and
publication that settles once — with a real coordinator, a real in-process sink and stages that
write fields.

The manager handles here are in-process fakes that return per-replica results at once: these
tests are about the batch's sequencing, which real engines add nothing to (the same paths run
against real managers and hf engines in test_deferred_real.py).
"""

from __future__ import annotations

import asyncio
import json
import math
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import pytest

from relax_core.coordination import (
    REWARD_FIELDS,
    BatchState,
    DeferredBatch,
    DeferredCollector,
    LeaseState,
    LifecycleCoordinator,
    MemoryBatchSink,
    Sample,
    SampleField,
    StageContext,
    StageReport,
    Timeline,
    abort_generation,
)
from relax_core.errors import (
    BatchFailedError,
    CoordinationError,
    LifecycleError,
    ScoringError,
    SinkError,
)
from relax_core.manager import LifecycleResult, Outcome, ReplicaResult


class Handle:
    """A manager handle that records every call and confirms it (or not)."""

    def __init__(self, name: str, log: list[str], *, confirm: bool = True) -> None:
        self.name = name
        self.log = log
        self.confirm = confirm
        self.version: str | None = "v1"

    async def _do(self, op: str) -> LifecycleResult:
        self.log.append(f"{self.name}.{op}")
        state = ("READY" if op == "onload" else "SLEEPING") if self.confirm else "FAILED"
        outcome = Outcome.DONE if self.confirm else Outcome.FAILED
        return LifecycleResult(op, self.name, (ReplicaResult(f"{self.name}/0", outcome, state),))

    async def onload(self) -> LifecycleResult:
        return await self._do("onload")

    async def offload(self) -> LifecycleResult:
        return await self._do("offload")

    async def weight_version(self) -> str | None:
        return self.version


class AbortingHandle(Handle):
    """A handle that can also abort its requests in flight as it offloads; it records the
    batch's state at the coordinator when that is asked of it."""

    def __init__(self, name: str, log: list[str], coord: Any = None) -> None:
        super().__init__(name, log)
        self.coord = coord

    async def abort_and_offload(self) -> LifecycleResult:
        state = self.coord.batch_state(0) if self.coord is not None else None
        self.log.append(f"{self.name}.abort_and_offload (batch {state})")
        result = await self._do("offload")
        self.log.pop()
        return result


def _per_token(field: str) -> Any:
    def check(values: Any, sample: Sample) -> str | None:
        if len(values) != len(sample.response_ids):
            return f"{field} has {len(values)} entries"
        for i, v in enumerate(values):
            if not math.isfinite(v) or v > 0:
                return f"{field}[{i}] = {v!r} is not a finite log-prob <= 0"
        return None

    return check


#: The fields the test stages write (a teacher's and a student's are declared here as a
#: teacher plugin would: the batch knows no field but those its stages declare).
FIELDS = {
    "reward": REWARD_FIELDS,
    "distill": (SampleField("teacher_logprobs", _per_token("teacher_logprobs")),),
    "student": (SampleField("student_logprobs", _per_token("student_logprobs")),),
}


class Stage:
    """A stage that writes one field (``reward``, ``teacher_logprobs`` or
    ``student_logprobs``, by ``kind``) and records when it ran."""

    models: tuple[str, ...] = ()

    def __init__(
        self, name: str, kind: str, role: str | None, log: list[str], value: Any = -0.5
    ) -> None:
        self.name, self.kind, self.role, self.log, self.value = name, kind, role, log, value
        self.fields = FIELDS[kind]

    async def run(self, samples: Sequence[Sample], ctx: StageContext) -> StageReport:
        self.log.append(f"{self.name}.run")
        for s in samples:
            if self.kind == "reward":
                if isinstance(self.value, Exception):
                    raise self.value
                s.fields["reward"] = self.value
            elif self.kind == "distill":
                s.fields["teacher_logprobs"] = tuple([self.value] * len(s.response_ids))
            else:
                s.fields["student_logprobs"] = tuple([self.value] * len(s.response_ids))
        return StageReport(self.name, {"n": len(samples)})


def samples(groups: int = 2, n: int = 2, version: str = "v1") -> list[Sample]:
    return [
        Sample(f"g{g}-s{i}", f"g{g}", [1, 2, 3], [4, 5], weight_version=version)
        for g in range(groups)
        for i in range(n)
    ]


class Step:
    def __init__(
        self,
        *,
        rollout_confirms: bool = True,
        aborting: bool = False,
        teacher: Callable[[list[str]], Handle] | None = None,
    ) -> None:
        self.log: list[str] = []
        self.rollout = Handle("rollout", self.log, confirm=rollout_confirms)
        kind = AbortingHandle if aborting else Handle
        self.handles = {r: kind(r, self.log) for r in ("genrm", "teacher")}
        if teacher is not None:
            self.handles["teacher"] = teacher(self.log)
        self.coord = LifecycleCoordinator(
            slices={"rollout": "A", "genrm": "A", "teacher": "A"},
            managers={r: [h] for r, h in self.handles.items()},
            generation_role="rollout",
            operation_timeout=5,
        )
        for h in self.handles.values():
            if isinstance(h, AbortingHandle):
                h.coord = self.coord
        self.sink = MemoryBatchSink()

    def stages(self, **values: Any) -> list[Stage]:
        return [
            Stage("genrm", "reward", "genrm", self.log, values.get("genrm", 0.75)),
            Stage("teacher", "distill", "teacher", self.log, values.get("teacher", -0.5)),
        ]

    def batch(self, originals: list[Sample], stages: list[Any], **kw: Any) -> DeferredBatch:
        return DeferredBatch(
            0, originals, coordinator=self.coord, rollout=self.rollout, stages=stages,
            sink=self.sink, **kw,
        )  # fmt: skip


def run(coro: Any) -> Any:
    return asyncio.run(coro)


def test_a_step_runs_in_the_reference_order_and_commits_after_the_sink_write() -> None:
    step = Step()
    originals = samples()

    async def go() -> Any:
        waiter = asyncio.ensure_future(step.coord.wait_committed(0))
        await step.coord.begin_batch(0)
        result = await step.batch(originals, step.stages()).run()
        return result, await waiter

    result, receipt = run(go())
    assert step.log == [
        "rollout.offload", "genrm.onload", "genrm.run", "genrm.offload",
        "teacher.onload", "teacher.run", "teacher.offload",
    ]  # fmt: skip
    assert receipt == result.receipt and receipt.partition == "train_0" and receipt.count == 4
    assert all(s.reward == 0.75 and s.fields["teacher_logprobs"] == (-0.5, -0.5) for s in originals)
    assert step.coord.batch_state(0) is BatchState.COMMITTED
    assert set(step.coord.leases().values()) == {LeaseState.SLEEPING}
    assert set(result.phases) >= {"rollout.offload", "genrm.onload", "genrm", "validate",
                                  "write_back", "sink_put", "commit"}  # fmt: skip


def test_two_deferred_roles_in_a_row_do_not_bounce_rollout() -> None:
    step = Step()

    async def go() -> None:
        await step.coord.begin_batch(0)
        await step.batch(samples(), step.stages()).run()

    run(go())
    assert step.log.count("rollout.offload") == 1
    assert "rollout.onload" not in step.log


def test_a_scoring_failure_fails_the_batch_releases_the_role_and_writes_nothing_back() -> None:
    step = Step()
    originals = samples()

    async def go() -> Any:
        waiter = asyncio.ensure_future(step.coord.wait_committed(0))
        await step.coord.begin_batch(0)
        with pytest.raises(ScoringError, match="judge unreachable"):
            await step.batch(
                originals, step.stages(genrm=ScoringError("genrm", "judge unreachable"))
            ).run()
        with pytest.raises(BatchFailedError, match=r"batch 0 FAILED.*judge unreachable"):
            await waiter

    run(go())
    assert "genrm.offload" in step.log and "teacher.onload" not in step.log
    assert all(s.fields == {} for s in originals)
    assert step.sink.partitions() == {}
    assert set(step.coord.leases().values()) == {LeaseState.SLEEPING}


def test_a_failed_stage_fails_the_batch_first_so_its_role_is_released_by_aborting() -> None:
    step = Step(aborting=True)

    async def go() -> None:
        await step.coord.begin_batch(0)
        with pytest.raises(ScoringError, match="judge unreachable"):
            await step.batch(
                samples(), step.stages(genrm=ScoringError("genrm", "judge unreachable"))
            ).run()

    run(go())
    # Nothing the role's requests answer is used: they are aborted, not waited for.
    assert step.log == [
        "rollout.offload", "genrm.onload", "genrm.run", "genrm.abort_and_offload (batch FAILED)",
    ]  # fmt: skip
    assert set(step.coord.leases().values()) == {LeaseState.SLEEPING}


def test_a_role_that_judged_successfully_is_drained_not_aborted() -> None:
    step = Step(aborting=True)

    async def go() -> None:
        await step.coord.begin_batch(0)
        await step.batch(samples(), step.stages()).run()

    run(go())
    assert "genrm.offload" in step.log and "teacher.offload" in step.log
    assert not any("abort" in line for line in step.log)


def test_a_cancelled_stage_fails_the_batch_as_interrupted_and_aborts_its_role(
    tmp_path: Path,
) -> None:
    step = Step(aborting=True)
    trace = tmp_path / "run.trace.json"
    started = asyncio.Event()

    class Judging(Stage):
        async def run(self, samples: Sequence[Sample], ctx: StageContext) -> StageReport:
            started.set()
            await asyncio.Event().wait()  # a judge that answers only when cancelled
            raise AssertionError("not cancelled")

    async def go() -> BaseException:
        waiter = asyncio.ensure_future(step.coord.wait_committed(0))
        await step.coord.begin_batch(0)
        stages = [Judging("genrm", "reward", "genrm", step.log)]
        timeline = Timeline(trace_path=str(trace))
        task = asyncio.ensure_future(step.batch(samples(), stages, timeline=timeline).run())
        await started.wait()
        task.cancel()  # what Ctrl-C does to the step in flight
        with pytest.raises(asyncio.CancelledError):
            await task
        with pytest.raises(BatchFailedError) as info:
            await waiter
        return info.value

    error = run(go())
    assert "interrupted" in str(error)
    assert step.log[-1] == "genrm.abort_and_offload (batch FAILED)"
    assert set(step.coord.leases().values()) == {LeaseState.SLEEPING}
    events = {e["name"]: e for e in json.loads(trace.read_text())["traceEvents"] if e["ph"] == "X"}
    assert events["genrm"]["args"] == {"batch": 0, "interrupted": True}
    assert "failed" not in events["genrm.offload"]["args"]


def test_an_interrupted_activation_is_followed_by_the_role_s_deactivation() -> None:
    step = Step(aborting=True)
    onloading = asyncio.Event()
    genrm = step.handles["genrm"]

    async def slow_onload() -> LifecycleResult:
        onloading.set()
        await asyncio.sleep(0.2)
        return await genrm._do("onload")

    genrm.onload = slow_onload  # type: ignore[method-assign]

    async def go() -> None:
        await step.coord.begin_batch(0)
        task = asyncio.ensure_future(step.batch(samples(), step.stages()).run())
        await onloading.wait()
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task

    run(go())
    # The activation went on in the coordinator; the role came down again after it.
    assert step.log[-2:] == ["genrm.onload", "genrm.abort_and_offload (batch FAILED)"]
    assert set(step.coord.leases().values()) == {LeaseState.SLEEPING}


@pytest.mark.parametrize(
    ("values", "problem"),
    [
        ({"genrm": math.nan}, "reward = nan is not a finite number"),
        ({"teacher": 0.25}, r"teacher_logprobs\[0\] = 0.25 is not a finite log-prob <= 0"),
    ],
)
def test_a_validation_failure_fails_the_batch_and_writes_nothing_back(
    values: dict[str, Any], problem: str
) -> None:
    step = Step()
    originals = samples()

    async def go() -> None:
        await step.coord.begin_batch(0)
        with pytest.raises(ScoringError, match=problem) as info:
            await step.batch(originals, step.stages(**values)).run()
        assert info.value.stage == "validation" and "nothing was written back" in str(info.value)

    run(go())
    assert all(s.fields == {} for s in originals)
    assert step.coord.batch_state(0) is BatchState.FAILED and step.sink.partitions() == {}


def test_a_failed_sink_put_deletes_what_it_wrote_and_does_not_commit() -> None:
    step = Step()

    class HalfWritingSink(MemoryBatchSink):
        async def put(self, partition: str, s: Sequence[Any], *, is_last: bool) -> Any:
            await super().put(partition, s[:1], is_last=False)  # part of it landed
            raise OSError("connection reset by peer")

    step.sink = HalfWritingSink()

    async def go() -> None:
        await step.coord.begin_batch(0)
        with pytest.raises(SinkError, match=r"put failed.*connection reset.*train_0' deleted"):
            await step.batch(samples(), step.stages()).run()

    run(go())
    assert step.sink.partitions() == {}
    assert step.coord.batch_state(0) is BatchState.FAILED


def test_a_finalizer_failing_after_the_put_deletes_the_partition_and_does_not_commit(
    tmp_path: Path,
) -> None:
    step = Step()

    def dump(batch_id: int, s: Sequence[Sample]) -> None:
        (tmp_path / "missing" / f"{batch_id}.json").write_text(json.dumps(len(s)))

    async def go() -> None:
        await step.coord.begin_batch(0)
        with pytest.raises(BatchFailedError, match=r"finalizer failed.*No such file.*deleted"):
            await step.batch(samples(), step.stages(), finalizer=dump).run()

    run(go())
    assert step.sink.partitions() == {}
    assert step.coord.batch_state(0) is BatchState.FAILED


class PutGatedHandle(Handle):
    """A handle whose offload finishes only once the batch's sink put has begun (within a
    deadline), so a batch that released its roles before putting fails on it."""

    def __init__(self, name: str, log: list[str], put_began: asyncio.Event, confirm: bool) -> None:
        super().__init__(name, log)
        self.put_began, self.offload_confirms = put_began, confirm

    async def offload(self) -> LifecycleResult:
        self.log.append(f"{self.name}.offload begins")
        async with asyncio.timeout(5):
            await self.put_began.wait()
        self.confirm = self.offload_confirms
        return await self._do("offload")


class LoggingSink(MemoryBatchSink):
    def __init__(self, log: list[str], put_began: asyncio.Event) -> None:
        super().__init__()
        self.log, self.put_began = log, put_began

    async def put(self, partition: str, s: Sequence[Any], *, is_last: bool) -> Any:
        self.log.append("sink.put")
        self.put_began.set()
        return await super().put(partition, s, is_last=is_last)


def _put_gated_step(*, confirm: bool) -> Step:
    put_began = asyncio.Event()
    step = Step(teacher=lambda log: PutGatedHandle("teacher", log, put_began, confirm=confirm))
    step.sink = LoggingSink(step.log, put_began)
    return step


def test_the_last_role_sleeps_while_the_batch_is_validated_and_put_and_the_commit_waits() -> None:
    step = _put_gated_step(confirm=True)
    committed_at: list[int] = []

    async def go() -> None:
        async def watch() -> None:
            await step.coord.wait_committed(0)
            committed_at.append(len(step.log))

        waiter = asyncio.ensure_future(watch())
        await step.coord.begin_batch(0)
        await step.batch(samples(), step.stages()).run()
        await waiter

    run(go())
    # (With the coordinator in this process its offload begins after the put does; through a
    # Ray actor the call is sent first. Either way the offload ends only after the put began.)
    assert step.log[-4] == "teacher.run" and step.log[-1] == "teacher.offload"
    assert set(step.log[-3:-1]) == {"teacher.offload begins", "sink.put"}
    assert committed_at == [len(step.log)]  # after the offload was confirmed
    assert step.coord.batch_state(0) is BatchState.COMMITTED
    assert set(step.coord.leases().values()) == {LeaseState.SLEEPING}


def test_a_last_release_unconfirmed_after_the_put_deletes_the_partition_and_blocks_the_lease() -> (
    None
):
    step = _put_gated_step(confirm=False)
    originals = samples()

    async def go() -> None:
        await step.coord.begin_batch(0)
        with pytest.raises(Exception, match="teacher") as info:
            await step.batch(originals, step.stages()).run()
        assert "the batch was put, not committed; partition 'train_0' deleted" in "\n".join(
            getattr(info.value, "__notes__", [])
        )

    run(go())
    assert "sink.put" in step.log
    assert step.sink.partitions() == {}
    assert step.coord.batch_state(0) is BatchState.FAILED
    assert step.coord.lease("teacher") is LeaseState.BLOCKED


def test_an_unconfirmed_rollout_release_fails_the_batch_and_blocks_the_lease() -> None:
    step = Step(rollout_confirms=False)

    async def go() -> None:
        await step.coord.begin_batch(0)
        with pytest.raises(LifecycleError, match="release unconfirmed"):
            await step.batch(samples(), step.stages()).run()

    run(go())
    assert step.coord.lease("rollout") is LeaseState.BLOCKED
    assert "genrm.onload" not in step.log
    assert step.coord.status().batch_error is not None
    assert "release unconfirmed" in (step.coord.status().batch_error or "")


def test_a_producer_failure_releases_rollout_only_when_its_offload_is_confirmed() -> None:
    for confirms, lease in ((True, LeaseState.SLEEPING), (False, LeaseState.BLOCKED)):
        step = Step(rollout_confirms=confirms)

        async def go(step: Step = step) -> BatchFailedError:
            await step.coord.begin_batch(0)
            return await abort_generation(step.coord, 0, step.rollout, RuntimeError("OOM"))

        error = run(go())
        assert step.coord.lease("rollout") is lease
        assert ("release unconfirmed" in str(error)) is (not confirms)
        assert "generation failed: RuntimeError: OOM" in str(error)


def test_a_student_stage_restores_rollout_and_releases_it_in_finally_on_a_version_mismatch() -> (
    None
):
    step = Step()
    student = Stage("student", "student", "rollout", step.log)

    async def go() -> None:
        await step.coord.begin_batch(0)
        with pytest.raises(LifecycleError, match=r"weight version 'v2'.*generated with 'v1'"):
            step.rollout.version = "v2"
            await step.batch(samples(), [*step.stages(), student]).run()

    run(go())
    assert step.log[-2:] == ["rollout.onload", "rollout.offload"]
    assert "student.run" not in step.log
    assert step.coord.lease("rollout") is LeaseState.SLEEPING


def test_a_student_stage_scores_with_the_restored_policy() -> None:
    step = Step()
    originals = samples()
    student = Stage("student", "student", "rollout", step.log, -1.0)

    async def go() -> None:
        await step.coord.begin_batch(0)
        await step.batch(originals, [*step.stages(), student]).run()

    run(go())
    assert step.log[-4:] == ["teacher.offload", "rollout.onload", "student.run", "rollout.offload"]
    assert all(s.fields["student_logprobs"] == (-1.0, -1.0) for s in originals)


def test_stages_run_in_the_order_they_are_given() -> None:
    step = Step()

    async def go() -> None:
        await step.coord.begin_batch(0)
        await step.batch(samples(), list(reversed(step.stages()))).run()

    run(go())
    assert [line for line in step.log if line.endswith(".run")] == ["teacher.run", "genrm.run"]


def test_two_stages_of_one_name_and_a_field_declared_two_ways_are_refused() -> None:
    step = Step()
    with pytest.raises(ValueError, match="two stages are called 'genrm'"):
        step.batch(samples(), [*step.stages(), Stage("genrm", "reward", None, step.log)])
    other = Stage("other", "reward", None, step.log)
    other.fields = (SampleField("reward", None),)
    with pytest.raises(ValueError, match="stages 'genrm' and 'other' both write field 'reward'"):
        step.batch(samples(), [*step.stages(), other])


def test_two_stages_of_one_field_declaration_both_add_to_it() -> None:
    # Two reward stages (two judges of one role, each its own stage) share the reward fields.
    step = Step()
    originals = samples()

    class Adding(Stage):
        async def run(self, samples: Sequence[Sample], ctx: StageContext) -> StageReport:
            for s in samples:
                s.fields.setdefault("rewards", {})[self.name] = self.value
                s.fields["reward"] = (s.fields.get("reward") or 0.0) + self.value
            return StageReport(self.name)

    stages = [
        Adding("a", "reward", "genrm", step.log, 0.5),
        Adding("b", "reward", None, step.log, 2),
    ]

    async def go() -> None:
        await step.coord.begin_batch(0)
        await step.batch(originals, stages).run()

    run(go())
    assert all(s.reward == 2.5 and s.rewards == {"a": 0.5, "b": 2} for s in originals)


def test_the_collector_refuses_mixed_and_repeated_groups() -> None:
    c = DeferredCollector(3, max_samples=4)
    c.add(samples(1))
    with pytest.raises(ValueError, match="added twice"):
        c.add(samples(1))
    with pytest.raises(ValueError, match="holds sample"):
        c.add([Sample("x", "a", [1], [2]), Sample("y", "b", [1], [2])])
    with pytest.raises(ValueError, match="max_samples=4"):
        c.add([Sample(f"z{i}", "z", [1], [2]) for i in range(3)])
    assert c.groups == 1 and len(c.samples) == 2


def test_the_timeline_writes_a_chrome_trace_with_every_phase(tmp_path: Path) -> None:
    step = Step()
    trace = tmp_path / "run.trace.json"
    timeline = Timeline(trace_path=str(trace), run="test-run")

    async def go() -> None:
        await step.coord.begin_batch(0)
        await step.batch(samples(), step.stages(), timeline=timeline).run()

    run(go())
    doc = json.loads(trace.read_text())
    complete = [e for e in doc["traceEvents"] if e["ph"] == "X"]
    assert {e["name"] for e in complete} >= {
        "stage_copies", "rollout.offload", "rollout.ack", "genrm.onload", "genrm",
        "genrm.offload", "teacher.onload", "teacher", "teacher.offload", "validate",
        "write_back", "sink_put", "commit",
    }  # fmt: skip
    for e in complete:
        assert {"name", "ph", "ts", "dur", "pid", "tid"} <= set(e)
        assert isinstance(e["ts"], int) and e["dur"] >= 1 and e["args"]["batch"] == 0
    lanes = {e["args"]["name"] for e in doc["traceEvents"] if e["name"] == "thread_name"}
    assert {"batch", "leases", "genrm", "teacher"} <= lanes


def test_phase_durations_are_prometheus_histograms() -> None:
    from prometheus_client import CollectorRegistry, generate_latest

    registry = CollectorRegistry()
    step = Step()

    async def go() -> None:
        await step.coord.begin_batch(0)
        await step.batch(samples(), step.stages(), timeline=Timeline(registry=registry)).run()

    run(go())
    text = generate_latest(registry).decode()
    assert 'relax_deferred_phase_seconds_count{phase="genrm.onload"} 1.0' in text
    assert 'relax_deferred_phase_seconds_count{phase="sink_put"} 1.0' in text


def test_a_failed_batch_is_in_the_trace_with_its_failed_phase(tmp_path: Path) -> None:
    step = Step()
    trace = tmp_path / "run.trace.json"
    stages = step.stages(genrm=ScoringError("genrm", "judge unreachable"))

    async def go() -> None:
        await step.coord.begin_batch(0)
        with pytest.raises(ScoringError):
            await step.batch(samples(), stages, timeline=Timeline(trace_path=str(trace))).run()

    run(go())
    events = {e["name"]: e for e in json.loads(trace.read_text())["traceEvents"] if e["ph"] == "X"}
    assert events["genrm"]["args"] == {"batch": 0, "failed": True}
    assert "genrm.offload" in events and "commit" not in events


# -- a stage reshaping its batch (filters, more generation, stages run on demand) --------------


class Producer:
    """Generates new groups of two samples each (ids b0-pN-sI, indexes after the batch's),
    logging each call; the engines are not the point here."""

    def __init__(self, log: list[str], start: int = 2) -> None:
        self.log = log
        self.next = start

    async def generate(self, batch_id: int, **request: Any) -> list[list[Sample]]:
        prompts = request["prompts"]
        count = request["groups"] if prompts is None else len(prompts)
        self.log.append(f"producer.generate({count})")
        n = request["samples_per_prompt"] or 2
        out = []
        for _ in range(count):
            g = f"g{self.next}"
            self.next += 1
            out.append(
                [Sample(f"{g}-s{i}", g, [1, 2, 3], [4, 5], weight_version="v1") for i in range(n)]
            )
        return out


class Refill:
    """Drops the groups whose first sample's reward is below 1 and has the batch filled up
    again, its upstream stages scoring what it added (a filter with over-sampling)."""

    name, role, models, fields = "refill", None, (), ()

    async def run(self, samples: Sequence[Sample], ctx: StageContext) -> StageReport:
        low = {s.group_id for s in samples if (s.reward or 0) < 1}
        ctx.drop(low, "reward below 1")
        kept = len({s.group_id for s in samples}) - len(low)
        new = ctx.add(await ctx.generate(groups=ctx.target_groups - kept))
        for stage in ctx.upstream:
            await ctx.run_stage(stage, new)
        return StageReport(self.name, {"dropped_groups": len(low), "added": len(new)})


class Scores(Stage):
    """Rewards 0.5 for the batch's first groups, 1.0 for any generated later."""

    async def run(self, samples: Sequence[Sample], ctx: StageContext) -> StageReport:
        self.log.append(f"{self.name}.run({len(samples)})")
        for s in samples:
            s.fields["reward"] = 0.5 if s.group_id in ("g0", "g1") else 1.0
        return StageReport(self.name)


def test_a_filter_drops_groups_and_fills_the_batch_with_more_generation_under_the_leases() -> None:
    step = Step()
    originals = samples()
    producer = Producer(step.log)
    stages = [Scores("genrm", "reward", "genrm", step.log), Refill(),
              Stage("teacher", "distill", "teacher", step.log)]  # fmt: skip

    async def go() -> Any:
        await step.coord.begin_batch(0)
        batch = step.batch(originals, stages, producer=producer)
        return batch, await batch.run()

    batch, result = run(go())
    assert step.log == [
        "rollout.offload",
        "genrm.onload", "genrm.run(4)", "genrm.offload",
        # More generation: rollout's lease back, the policy onloaded, released again.
        "rollout.onload", "producer.generate(2)", "rollout.offload",
        # The stages before the filter score what it added, with their leases.
        "genrm.onload", "genrm.run(4)", "genrm.offload",
        "teacher.onload", "teacher.run", "teacher.offload",
    ]  # fmt: skip
    committed = run(step.sink.get("train_0"))
    assert sorted({s.group_id for s in committed}) == ["g2", "g3"]
    assert all(s.reward == 1.0 and "teacher_logprobs" in s.fields for s in committed)
    assert result.samples == 4 and result.generated_groups == 2
    assert [(d.group_id, d.stage, d.reason) for d in result.dropped] == [
        ("g0", "refill", "reward below 1"), ("g1", "refill", "reward below 1"),
    ]  # fmt: skip
    assert {s.id for s in batch.dropped_samples} == {"g0-s0", "g0-s1", "g1-s0", "g1-s1"}
    assert set(step.coord.leases().values()) == {LeaseState.SLEEPING}


def test_a_stage_asking_for_generation_without_a_producer_fails_the_batch_naming_itself() -> None:
    step = Step()
    stages = [Scores("genrm", "reward", "genrm", step.log), Refill()]

    async def go() -> None:
        await step.coord.begin_batch(0)
        with pytest.raises(CoordinationError, match="stage 'refill' asks for more generation"):
            await step.batch(samples(), stages).run()

    run(go())
    assert step.coord.batch_state(0) is BatchState.FAILED


def test_samples_a_stage_scores_outside_the_batch_never_join_it() -> None:
    # An evaluation: held-out groups generated, scored by a stage with its lease, reported.
    step = Step()
    judge = Stage("judge", "reward", "genrm", step.log, 0.25)

    class Evaluate:
        name, role, models, fields = "eval", None, (), ()

        async def run(self, samples: Sequence[Sample], ctx: StageContext) -> StageReport:
            held_out = await ctx.generate(prompts=["p"], samples_per_prompt=3)
            await ctx.run_stage(judge, held_out)
            return StageReport(self.name, {"reward_mean": held_out[0].reward or 0.0})

    async def go() -> Any:
        await step.coord.begin_batch(0)
        return await step.batch(
            samples(), [Evaluate(), *step.stages()], producer=Producer(step.log)
        ).run()

    result = run(go())
    assert result.reports[0].counts == {"reward_mean": 0.25}
    assert result.samples == 4 and result.generated_groups == 1
    assert {s.group_id for s in run(step.sink.get("train_0"))} == {"g0", "g1"}
    # Rollout is still awake from the step's generation: the held-out groups need no switch.
    assert step.log[:4] == ["producer.generate(1)", "rollout.offload", "genrm.onload", "judge.run"]


def test_a_stage_can_drop_only_groups_of_its_batch() -> None:
    step = Step()

    class Wrong:
        name, role, models, fields = "wrong", None, (), ()

        async def run(self, samples: Sequence[Sample], ctx: StageContext) -> StageReport:
            ctx.drop(["g9"], "no such group")
            return StageReport(self.name)

    async def go() -> None:
        await step.coord.begin_batch(0)
        with pytest.raises(ValueError, match=r"stage 'wrong' dropped group\(s\) \['g9'\]"):
            await step.batch(samples(), [Wrong()]).run()

    run(go())

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
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import pytest

from relax_core.coordination import (
    BatchState,
    DeferredBatch,
    DeferredCollector,
    LeaseState,
    LifecycleCoordinator,
    MemoryBatchSink,
    Sample,
    StageContext,
    StageReport,
    Timeline,
    abort_generation,
)
from relax_core.errors import BatchFailedError, LifecycleError, ScoringError, SinkError
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


class Stage:
    """A stage that writes one field and records when it ran."""

    def __init__(
        self, name: str, phase: str, role: str | None, log: list[str], value: Any = -0.5
    ) -> None:
        self.name, self.phase, self.role, self.log, self.value = name, phase, role, log, value
        self.top_k = 0
        fields = {"reward": "reward", "distill": "teacher_logprobs", "student": "student_logprobs"}
        self.writes = frozenset({fields[phase]})

    async def run(self, samples: Sequence[Sample], ctx: StageContext) -> StageReport:
        self.log.append(f"{self.name}.run")
        for s in samples:
            if self.phase == "reward":
                if isinstance(self.value, Exception):
                    raise self.value
                s.reward = self.value
            elif self.phase == "distill":
                s.teacher_logprobs = tuple([self.value] * len(s.response_ids))
            else:
                s.student_logprobs = tuple([self.value] * len(s.response_ids))
        return StageReport(self.name, {"n": len(samples)})


def samples(groups: int = 2, n: int = 2, version: str = "v1") -> list[Sample]:
    return [
        Sample(f"g{g}-s{i}", f"g{g}", [1, 2, 3], [4, 5], weight_version=version)
        for g in range(groups)
        for i in range(n)
    ]


class Step:
    def __init__(self, *, rollout_confirms: bool = True, aborting: bool = False) -> None:
        self.log: list[str] = []
        self.rollout = Handle("rollout", self.log, confirm=rollout_confirms)
        kind = AbortingHandle if aborting else Handle
        self.handles = {r: kind(r, self.log) for r in ("genrm", "teacher")}
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
    assert all(s.reward == 0.75 and s.teacher_logprobs == (-0.5, -0.5) for s in originals)
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
    assert all(s.reward is None and s.teacher_logprobs is None for s in originals)
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
    assert all(s.reward is None and s.teacher_logprobs is None for s in originals)
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
    assert all(s.student_logprobs == (-1.0, -1.0) for s in originals)


def test_stages_out_of_the_reference_order_are_refused() -> None:
    step = Step()
    with pytest.raises(ValueError, match="stages run in the order reward -> distill -> student"):
        step.batch(samples(), list(reversed(step.stages())))


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

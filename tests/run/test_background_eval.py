"""Background evaluation (``background = true`` on an ``eval`` stage, async steps): the step
commits and trains without waiting for its evaluation, whose result comes later as its own
object tagged with the weight version its samples were generated with; at the end of the run
the evaluations still pending are awaited up to a deadline, then cancelled and reported; a
failed one never fails a step; a layout where it would need a lease refuses it.

The real step driver, coordinator, deferred batch and sink, through :func:`relax_core.run.loop.
drive`, with the simulated engines of :mod:`relax_bench._steps_sim`. No timing is asserted:
the evaluation's scorer waits on an event that the test sets only once the trainer was asked
for the next step's batch (which it is only after that batch committed).
"""

from __future__ import annotations

import asyncio
import io
import json
import math
import os
import signal
from collections.abc import Sequence
from typing import Any

import attrs
import pytest
from relax_bench._steps_sim import SimJudge, SimRollout, SimTrainer, Times, coordinator, handle

from relax_core.config import loads_config
from relax_core.coordination import MemoryBatchSink, Sample, StageContext, StageReport
from relax_core.coordination.stages import RoleClients
from relax_core.errors import ConfigError
from relax_core.plugins import PluginManager
from relax_core.run.background import background_problems
from relax_core.run.config import RunConfig, parse_run_config
from relax_core.run.data import Prompt
from relax_core.run.driver import DriverSettings, StepDriver
from relax_core.run.loop import RunSummary, drive
from relax_core.run.progress import Printer
from relax_core.run.stages import EvalStage, stage_problems
from tests.support.sim_job import sim_ports

TIMES = Times(generate_s=0.02, score_s=0.02, train_s=0.02, push_s=0.0, groups=2)


class HeldOut:
    """A prompt source of numbered held-out prompts."""

    def __init__(self) -> None:
        self.taken = 0

    def take(self, n: int) -> list[Prompt]:
        self.taken += n
        return [Prompt(f"held-out {self.taken - n + i}", "") for i in range(n)]


class GatedScorer:
    """The evaluation's rewards: for step ``N`` it waits until ``release(N)`` (never: the
    evaluation is pending at the end of the run), then scores each sample 0.5; ``fail_at``: a
    step whose scoring raises. It keeps the held-out samples it saw, per step."""

    name, role, models, fields = "eval.rewards", None, (), ()

    def __init__(self, *, fail_at: int | None = None) -> None:
        self.gates: dict[int, asyncio.Event] = {}
        self.seen: dict[int, list[Sample]] = {}
        self.fail_at = fail_at

    def gate(self, step: int) -> asyncio.Event:
        return self.gates.setdefault(step, asyncio.Event())

    async def run(self, samples: Sequence[Sample], ctx: StageContext) -> StageReport:
        self.seen[ctx.batch_id] = list(samples)
        if ctx.batch_id == self.fail_at:
            raise RuntimeError(f"the held-out judge failed on step {ctx.batch_id}")
        # bounded, so a driver that waited for the evaluation in the step fails this test
        # (the evaluation then fails) rather than hanging it
        await asyncio.wait_for(self.gate(ctx.batch_id).wait(), 60)
        for s in samples:
            s.fields["reward"] = 0.5
        return StageReport(self.name, {"scored": len(samples)})


class Trainer(SimTrainer):
    """The simulated trainer; ``train(N)`` first tells the test that batch ``N`` committed
    (the trainer is only asked for a committed batch): the scorer's gate of step ``N - 1``
    opens there, so that evaluation can only end after the next step's commit.
    ``interrupt_at``: ``train`` of that step sends this process SIGINT (Ctrl-C) instead."""

    def __init__(
        self, *args: Any, scorer: GatedScorer, interrupt_at: int | None = None, **kwargs: Any
    ) -> None:
        super().__init__(*args, **kwargs)
        self.scorer = scorer
        self.interrupt_at = interrupt_at
        self.asked: list[int] = []
        #: step -> the steps whose evaluation had ended when train(step) was asked
        self.evaluated_by: dict[int, list[int]] = {}
        self.ended: list[int] = []

    async def train(self, batch_id: int) -> dict[str, Any]:
        self.asked.append(batch_id)
        self.evaluated_by[batch_id] = list(self.ended)
        if batch_id == self.interrupt_at:
            os.kill(os.getpid(), signal.SIGINT)
            await asyncio.sleep(60)
        if batch_id >= 1:
            self.scorer.gate(batch_id - 1).set()
        return await super().train(batch_id)


def _eval_stage(scorer: GatedScorer, *, every: int = 1) -> EvalStage:
    return EvalStage(
        "eval",
        source=HeldOut,
        scorer=scorer,  # type: ignore[arg-type]  # any stage scores; the reward stage's type
        every=every,
        prompts=2,
        background=True,
    )


def _drive(
    scorer: GatedScorer,
    *,
    steps: int = 3,
    every: int = 1,
    interrupt_at: int | None = None,
    timeout: float = 0.5,
) -> tuple[RunSummary, list[dict[str, Any]], Trainer]:
    rollout = SimRollout(TIMES)
    run = RunConfig(
        mode="async",
        prompts_per_step=TIMES.groups,
        samples_per_prompt=TIMES.samples_per_group,
        max_staleness=1,
        operation_timeout=30.0,
        request_timeout=timeout,  # the deadline of the evaluations pending at the end
    )
    ports = sim_ports(
        "background-eval",
        run,
        times=TIMES,
        rollout=rollout,
        stages=[SimJudge(TIMES), _eval_stage(scorer, every=every)],
        trainer=Trainer,
        scorer=scorer,
        interrupt_at=interrupt_at,
    )
    trainer = ports.trainer
    out, err = io.StringIO(), io.StringIO()
    printer = Printer(json_lines=True, out=out, err=err, tty=False)

    def ended(row: dict[str, Any]) -> None:
        trainer.ended.append(row["step"])
        printed(row)

    printed, printer.evaluation = printer.evaluation, ended  # type: ignore[method-assign]
    summary = asyncio.run(drive(ports, printer, steps=steps, initial_version="0"))
    printer.summary(summary.row())  # as relax run does, last
    rows = [json.loads(line) for line in out.getvalue().splitlines()]
    return summary, rows, trainer


def _versions(samples: Sequence[Sample]) -> list[str | None]:
    seen: dict[str | None, None] = {}
    for s in samples:
        for _, version in s.versions:
            seen.setdefault(version)
    return list(seen)


def test_a_step_commits_and_trains_before_its_background_evaluation_ends() -> None:
    scorer = GatedScorer()
    summary, rows, trainer = _drive(scorer, steps=3)
    assert summary.failure is None and [r["step"] for r in summary.committed] == [0, 1, 2]
    # train(1) was asked (batch 1 committed, batch 0 trained) before step 0's evaluation ended
    assert trainer.asked == [0, 1, 2] and trainer.evaluated_by[1] == []
    for row in summary.committed:  # in the step: only its start
        assert row["stages"]["eval"] == {"background": 1}
    evals = {r["step"]: r for r in rows if "eval" in r}
    assert sorted(evals) == [0, 1, 2]
    for step in (0, 1):  # each released by the next step's commit
        row = evals[step]
        assert row["eval"] == "eval" and row["status"] == "done" and row["error"] is None
        assert row["counts"]["samples"] == 2 * TIMES.samples_per_group
        assert row["counts"]["reward_mean"] == 0.5
        # tagged with the version its held-out samples were generated with
        versions = _versions(scorer.seen[step])
        assert row["weight_versions"] == versions and versions
        assert row["weight_version"] == (versions[0] if len(versions) == 1 else None)
        # rollout served the step's weights or newer ones: never a version from before
        assert all(v is not None and int(v) >= step for v in versions), versions
    # the last step's evaluation was never released: cancelled at the deadline, reported
    last = evals[2]
    assert last["status"] == "cancelled" and last["counts"] == {}
    assert last["weight_versions"] == _versions(scorer.seen[2])
    # the summary comes last and counts them
    assert rows[-1]["summary"] is True
    assert rows[-1]["evaluations"] == {"done": 2, "failed": 0, "cancelled": 1}
    assert all("eval" not in r for r in rows[rows.index(evals[2]) + 1 : -1])


def test_a_failed_background_evaluation_is_reported_and_fails_no_step() -> None:
    scorer = GatedScorer(fail_at=0)
    summary, rows, _ = _drive(scorer, steps=2, every=2)
    assert summary.failure is None and [r["step"] for r in summary.committed] == [0, 1]
    assert summary.committed[1]["stages"]["eval"] == {"skipped": 1}  # not one of every 2
    (row,) = [r for r in rows if "eval" in r]
    assert row["step"] == 0 and row["status"] == "failed"
    assert row["error"] == "RuntimeError: the held-out judge failed on step 0"
    assert rows[-1]["evaluations"] == {"done": 0, "failed": 1, "cancelled": 0}


def test_ctrl_c_cancels_the_pending_background_evaluations_and_reports_them() -> None:
    scorer = GatedScorer()
    summary, rows, _ = _drive(scorer, steps=3, interrupt_at=1, timeout=300.0)
    assert summary.interrupted
    assert [r["step"] for r in summary.committed] == [0]
    evals = sorted((r["step"], r["status"]) for r in rows if "eval" in r)
    # Ctrl-C came while batch 1 (committed) trained: the evaluations of steps 0 and 1 never
    # got their gates, and are cancelled at once (not after the 300 s deadline) and reported
    assert evals == [(0, "cancelled"), (1, "cancelled")]
    assert rows[-1]["summary"] is True
    assert rows[-1]["evaluations"] == {"done": 0, "failed": 0, "cancelled": 2}


def test_background_needs_async_steps() -> None:
    run = parse_run_config(
        loads_config(
            '[[run.stages]]\nstage = "reward"\nrewards = [{ adapter = "exact-match" }]\n'
            '[[run.stages]]\nstage = "eval"\ndataset = "arithmetic"\nbackground = true\n'
            'rewards = [{ adapter = "exact-match" }]\n'
        )
    )
    joined = "\n".join(map(str, stage_problems(run, PluginManager.create())))
    assert "run.stages[1].background: [background] a background evaluation runs beside" in joined
    assert 'set [run] mode = "async", or remove background' in joined


@pytest.mark.parametrize(
    ("defer", "residency", "why"),
    [
        (("genrm",), "planned", "in a defer layout (placement.defer_roles: genrm)"),
        ((), "exclusive", 'under placement.residency = "exclusive"'),
    ],
)
def test_a_layout_where_rollout_takes_turns_refuses_a_background_evaluation(
    defer: tuple[str, ...], residency: str, why: str
) -> None:
    run = parse_run_config(
        loads_config(
            '[run]\nmode = "async"\n[[run.stages]]\nstage = "eval"\ndataset = "arithmetic"\n'
            'background = true\nrewards = [{ adapter = "exact-match" }]\n'
        )
    )
    (problem,) = background_problems(run.stages, defer_roles=defer, residency=residency)
    assert problem.path == "run.stages[0].background" and why in problem.message
    assert "remove background" in problem.message
    assert background_problems(run.stages, defer_roles=(), residency="planned") == []


def test_the_driver_refuses_a_background_stage_that_would_need_a_lease() -> None:
    stage = _eval_stage(GatedScorer())
    common: dict[str, Any] = {
        "coordinator": coordinator(),
        "rollout": handle(),
        "stages": [stage],
        "sink": MemoryBatchSink(),
        "clients": RoleClients({}),
        "producer": SimRollout(TIMES).producer,
        "trainer": None,
        "generation_role": "policy",
    }
    with pytest.raises(ConfigError, match="the generation role takes turns on its GPUs"):
        StepDriver(DriverSettings(steps=1, prompts_per_step=1), switching=True, **common)
    StepDriver(DriverSettings(steps=1, prompts_per_step=1), **common)  # a split layout: fine


def test_an_evaluations_metrics_are_its_finite_counts_and_its_version() -> None:
    from relax_core.run.background import EvalResult

    result = EvalResult("eval", 3, "done", "4", ("4",), {"samples": 2, "reward_mean": math.nan},
                        None, 0.1)  # fmt: skip
    assert result.metrics() == {"eval/eval/samples": 2.0, "eval/eval/weight_version": 4.0}
    mixed = attrs.evolve(result, weight_version=None, weight_versions=("3", "4"))
    assert mixed.metrics() == {"eval/eval/samples": 2.0}
    assert mixed.row()["weight_versions"] == ["3", "4"] and mixed.row()["eval"] == "eval"

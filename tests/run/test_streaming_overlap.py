"""Streaming scoring overlaps generation (``stream_scoring``, async steps): a group is scored
while the step's later groups are still being generated, not after the whole step generated.

The real step driver, coordinator, deferred batch and sink (:func:`relax_core.run.loop.drive`)
with the simulated engines of :mod:`relax_bench._steps_sim`. No timing is asserted: the
generation of each step's last group waits until the judge has scored that step's first group,
which only a streaming step can do (a step that scored after generating would wait forever: the
wait is bounded, so it fails the step instead, as the control case shows).
"""

from __future__ import annotations

import asyncio
import io
from collections.abc import Sequence
from typing import Any

from relax_bench._steps_sim import SimJudge, SimRollout, Times

from relax_core.coordination import Sample, StageContext, StageReport
from relax_core.run.config import RunConfig
from relax_core.run.loop import RunSummary, drive
from relax_core.run.progress import Printer
from tests.support.sim_job import sim_ports

TIMES = Times(generate_s=0.02, score_s=0.02, train_s=0.02, push_s=0.0, groups=3)
LAST = TIMES.groups - 1


class WaitingRollout(SimRollout):
    """Generates a step's last group only once its first group was scored (bounded wait)."""

    def __init__(self, times: Times, *, wait_s: float) -> None:
        super().__init__(times)
        self.scored: dict[int, asyncio.Event] = {}
        self.wait_s = wait_s
        #: what happened, in order: ("generated" | "scored", step, group index)
        self.log: list[tuple[str, int, int]] = []

    def first_scored(self, batch_id: int) -> asyncio.Event:
        return self.scored.setdefault(batch_id, asyncio.Event())

    async def group(self, batch_id: int, index: int) -> list[Sample]:
        if index == LAST:
            await asyncio.wait_for(self.first_scored(batch_id).wait(), self.wait_s)
        out = await super().group(batch_id, index)
        self.log.append(("generated", batch_id, index))
        return out


class RecordingJudge(SimJudge):
    """The streaming judge, telling the rollout which groups it scored."""

    def __init__(self, times: Times, rollout: WaitingRollout) -> None:
        super().__init__(times)
        self.rollout = rollout

    async def run(self, samples: Sequence[Sample], ctx: StageContext) -> StageReport:
        report = await super().run(samples, ctx)
        for gid in sorted({s.group_id for s in samples}):
            index = int(gid.rsplit("-p", 1)[1])
            self.rollout.log.append(("scored", ctx.batch_id, index))
            if index == 0:
                self.rollout.first_scored(ctx.batch_id).set()
        return report


def _drive(*, stream: bool, wait_s: float) -> tuple[RunSummary, WaitingRollout]:
    rollout = WaitingRollout(TIMES, wait_s=wait_s)
    run = RunConfig(
        mode="async",
        prompts_per_step=TIMES.groups,
        samples_per_prompt=TIMES.samples_per_group,
        max_staleness=1,
        stream_scoring=stream,
        stream_concurrency=TIMES.groups,
        max_failed_steps=0,  # the control case ends at its first failed step
        operation_timeout=30.0,
    )
    ports = sim_ports(
        "streaming-overlap",
        run,
        times=TIMES,
        rollout=rollout,
        stages=[RecordingJudge(TIMES, rollout)],
    )
    printer = Printer(json_lines=True, out=io.StringIO(), err=io.StringIO(), tty=False)
    summary = asyncio.run(drive(ports, printer, steps=2, initial_version="0"))
    return summary, rollout


def _before(log: list[Any], first: tuple[str, int, int], then: tuple[str, int, int]) -> bool:
    return first in log and then in log and log.index(first) < log.index(then)


def test_a_streamed_group_is_scored_while_its_step_still_generates() -> None:
    summary, rollout = _drive(stream=True, wait_s=30.0)
    assert summary.failure is None, summary.failure
    assert [r["step"] for r in summary.committed] == [0, 1]
    for step in (0, 1):
        # the first group scored before the last one was generated: the two overlapped
        assert _before(rollout.log, ("scored", step, 0), ("generated", step, LAST)), rollout.log
    for row in summary.committed:
        assert row["async"]["streamed_stages"] == ["judge"]


def test_without_streaming_the_same_step_scores_only_after_generating() -> None:
    # The control: scoring waits for the whole step's generation, so the last group's wait
    # for a scored first group runs out and the step fails; nothing is committed for it.
    summary, rollout = _drive(stream=False, wait_s=1.0)
    assert summary.failure is not None and summary.failure.step == 0, summary.row()
    assert summary.committed == []
    assert not [e for e in rollout.log if e[0] == "scored"], rollout.log

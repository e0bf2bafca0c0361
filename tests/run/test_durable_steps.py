"""Durable steps on the simulated job (the real coordinator, deferred batch, sink and driver;
engines of fixed per-phase times): an idempotent stage request that fails for a transport
reason is sent again, counted in the step's row, with its role rebuilt in between; a 4xx is
never sent again; a failed generation is never sent again (its step fails and the run goes past
it, up to ``max_failed_steps``); a batch whose stages dropped every group is never committed
nor trained (``on_empty_batch``)."""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from typing import Any

import pytest
from relax_bench._steps_sim import SimJudge, SimRollout

from relax_core.coordination import Sample, StageContext, StageReport
from relax_core.coordination.retries import Recovery, retrying
from relax_core.errors import UpstreamStatusError, UpstreamUnreachableError
from tests.run.test_one_driver import TIMES, _run


class FlakyJudge(SimJudge):
    """The judge, whose first ``failures`` requests of each sample of step ``at`` find their
    engine gone (nothing sent); every request goes through ``ctx.retrying``."""

    def __init__(self, *, at: int, failures: int, retries: int = 2) -> None:
        super().__init__(TIMES)
        self.at, self.failures, self.retries = at, failures, retries
        self.sent: dict[str, int] = {}

    async def run(self, samples: Sequence[Sample], ctx: StageContext) -> StageReport:
        async def judge(sample: Sample) -> None:
            async def send() -> float:
                self.sent[sample.id] = self.sent.get(sample.id, 0) + 1
                if ctx.batch_id == self.at and self.sent[sample.id] <= self.failures:
                    raise UpstreamUnreachableError(502, f"engine of {sample.id} is gone")
                return 1.0

            value = await ctx.retrying(send, stage=self.name, role=self.role, retries=self.retries)
            sample.fields["rewards"] = {"judge": value}
            sample.fields["reward"] = value

        await asyncio.gather(*(judge(s) for s in samples))
        return StageReport(self.name, {"scored": len(samples)})


class DropAll(SimJudge):
    """A judge that scores, then drops every group of step ``at`` (a filter whose rewards
    never vary)."""

    def __init__(self, at: int) -> None:
        super().__init__(TIMES)
        self.at = at

    async def run(self, samples: Sequence[Sample], ctx: StageContext) -> StageReport:
        report = await super().run(samples, ctx)
        if ctx.batch_id == self.at:
            ctx.drop({s.group_id for s in samples}, "rewards do not vary")
        return report


@pytest.mark.parametrize("mode", ["sync", "async"])
def test_a_stage_request_failing_for_a_transport_reason_is_sent_again_and_counted(
    mode: str,
) -> None:
    judge = FlakyJudge(at=1, failures=2)
    summary, _, _ = _run(mode, defer=False, judge=judge)
    assert summary.failure is None and [r["step"] for r in summary.committed] == [0, 1, 2]
    rows = {r["step"]: r for r in summary.committed}
    samples = TIMES.groups * TIMES.samples_per_group
    assert rows[1]["retries"] == {"judge": 2 * samples}
    assert rows[0]["retries"] == {} and rows[2]["retries"] == {}
    assert summary.row()["retries"] == {"judge": 2 * samples}
    assert all(judge.sent[i] == 3 for i in judge.sent if i.startswith("b1-"))


def test_a_stage_request_failing_past_its_retries_fails_the_step_and_the_run_goes_on() -> None:
    judge = FlakyJudge(at=1, failures=3)  # one more than its two retries
    summary, generated, _ = _run("sync", defer=True, judge=judge, max_failed_steps=3)
    assert summary.failure is None
    assert [r["step"] for r in summary.committed] == [0, 2]
    row = summary.row()
    assert row["failed_steps"] == [1] and row["skipped_steps"] == []
    (failed,) = summary.went_past
    assert failed.went_on and not failed.skipped and "sent 3 times (2 retries)" in failed.error
    # every sample of step 1 sent three times: two retries each
    assert failed.row()["retries"] == {"judge": 2 * TIMES.groups * TIMES.samples_per_group}
    assert sorted(failed.sample_ids) == sorted(i for i in generated if i.startswith("b1-"))
    # the trainer took two optimizer steps; the versions rollout served say so
    assert summary.weight_versions == ["0", "1", "3"]


@pytest.mark.parametrize("mode", ["sync", "async"])
def test_a_rollout_whose_offload_loses_its_weights_is_given_the_trainers_before_it_generates(
    mode: str,
) -> None:
    # No CPU backup: every offload loses rollout's weights. After step 1 fails, no new version
    # is trained, yet step 2 generates on the trainer's weights, pushed again after its onload.
    judge = FlakyJudge(at=1, failures=3)
    rollout = SimRollout(TIMES, discards=True)
    summary, _, _ = _run(mode, defer=True, judge=judge, rollout=rollout, max_failed_steps=3)
    assert summary.failure is None and [r["step"] for r in summary.committed] == [0, 2]
    assert summary.row()["failed_steps"] == [1]
    assert {s.weight_version for s in rollout.generated if s.id.startswith("b2-")} == {"1"}
    if mode == "async":
        return  # (whether a push lands between onload and generation there is a race)
    # The same run with the driver not told: step 2 finds no weights and fails.
    judge = FlakyJudge(at=1, failures=3)
    rollout = SimRollout(TIMES, discards=True)
    summary, _, _ = _run(
        mode, defer=True, judge=judge, rollout=rollout, max_failed_steps=3, discards=False
    )
    assert [r["step"] for r in summary.committed] == [0]
    assert [f.step for f in summary.went_past] == [1, 2]
    assert "lost at the offload" in summary.went_past[1].error


def test_the_step_after_max_failed_steps_failures_ends_the_run() -> None:
    rollout = SimRollout(TIMES, fail_at={1: 0, 2: 0})
    summary, _, _ = _run("sync", defer=False, steps=4, rollout=rollout, max_failed_steps=1)
    assert [f.step for f in summary.went_past] == [1]
    assert summary.failure is not None and summary.failure.step == 2
    assert summary.row()["failed_steps"] == [1, 2]
    assert [r["step"] for r in summary.committed] == [0]


@pytest.mark.parametrize("defer", [False, True], ids=["split", "defer"])
def test_a_failed_generation_is_never_sent_again(defer: bool) -> None:
    """A group whose generation failed may have run on its engine: it is not sent again; its
    step fails (nothing committed) and the run goes on with new groups."""
    rollout = SimRollout(TIMES, fail_at={1: 0})
    summary, generated, _ = _run("async", defer=defer, rollout=rollout, max_failed_steps=3)
    assert [r["step"] for r in summary.committed] == [0, 2]
    assert [f.step for f in summary.went_past] == [1]
    assert all(r["retries"] == {} for r in summary.committed)
    assert len(generated) == len(set(generated))  # no sample generated twice


@pytest.mark.parametrize("mode", ["sync", "async"])
def test_an_all_dropped_batch_is_skipped_never_committed_nor_trained(mode: str) -> None:
    summary, generated, _ = _run(mode, defer=True, judge=DropAll(at=1))
    assert summary.failure is None
    assert [r["step"] for r in summary.committed] == [0, 2]
    row = summary.row()
    assert row["skipped_steps"] == [1] and row["failed_steps"] == []
    (skipped,) = summary.went_past
    assert skipped.skipped and skipped.kind == "EmptyBatchError"
    assert "dropped every group" in skipped.error and "rewards do not vary" in skipped.error
    assert skipped.row()["failed"] is False and skipped.row()["skipped"] is True
    assert sorted(skipped.sample_ids) == sorted(i for i in generated if i.startswith("b1-"))
    assert summary.weight_versions == ["0", "1", "3"]


def test_an_all_dropped_batch_fails_its_step_with_on_empty_batch_fail() -> None:
    summary, _, _ = _run("sync", defer=True, judge=DropAll(at=1), on_empty_batch="fail")
    assert summary.failure is not None and summary.failure.kind == "EmptyBatchError"
    assert summary.failure.step == 1 and not summary.went_past
    assert [r["step"] for r in summary.committed] == [0]


def _send(outcomes: list[BaseException | str]) -> tuple[Any, list[int]]:
    calls: list[int] = []

    async def send() -> str:
        calls.append(1)
        outcome = outcomes[len(calls) - 1]
        if isinstance(outcome, BaseException):
            raise outcome
        return outcome

    return send, calls


def test_a_4xx_is_never_sent_again_and_a_5xx_is_until_its_retries_run_out() -> None:
    recovery = Recovery()
    bad = UpstreamStatusError(400, "bad request", body=b"{}", url="http://e")
    send, calls = _send([bad, "never"])
    with pytest.raises(UpstreamStatusError):
        asyncio.run(retrying(send, batch_id=0, stage="s", role="r", retries=2, recovery=recovery))
    assert len(calls) == 1 and recovery.of(0) == {"retries": {}, "rebuilt": {}}
    busy = UpstreamStatusError(500, "engine error", body=b"{}", url="http://e")
    send, calls = _send([busy, busy, busy])
    with pytest.raises(UpstreamStatusError) as info:
        asyncio.run(retrying(send, batch_id=3, stage="s", role="r", retries=2, recovery=recovery))
    assert len(calls) == 3 and recovery.of(3)["retries"] == {"s": 2}
    assert "sent 3 times (2 retries)" in str(info.value.__notes__)
    send, calls = _send([ValueError("not json"), "never"])
    with pytest.raises(ValueError):
        asyncio.run(retrying(send, batch_id=4, stage="s", role="r", retries=2, recovery=None))
    assert len(calls) == 1


def test_concurrent_failures_of_one_role_wait_for_one_rebuild() -> None:
    rebuilds: list[str] = []

    async def recover(role: str) -> dict[str, list[str]]:
        rebuilds.append(role)
        await asyncio.sleep(0.01)
        return {"rebuilt": ["judge.m"], "failed": []}

    recovery = Recovery(recover)

    async def go() -> list[str]:
        gone = UpstreamUnreachableError(502, "gone")
        sends = [_send([gone, "ok"])[0] for _ in range(5)]
        return await asyncio.gather(
            *(
                retrying(s, batch_id=2, stage="judge", role="judge", retries=1, recovery=recovery)
                for s in sends
            )
        )

    assert asyncio.run(go()) == ["ok"] * 5
    assert rebuilds == ["judge"]
    assert recovery.of(2) == {"retries": {"judge": 5}, "rebuilt": {"judge": 1}}

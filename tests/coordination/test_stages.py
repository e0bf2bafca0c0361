"""The reward stage over registered adapters (sync ones in Ray workers), and the sinks' rules."""

from __future__ import annotations

import asyncio
import math
import os
from typing import Any

import pytest

from relax_core.coordination import (
    REWARD_FIELDS,
    MemoryBatchSink,
    RayBatchSink,
    RewardContext,
    RewardResult,
    RewardStage,
    RoleClients,
    Sample,
    StageContext,
    validate_samples,
)
from relax_core.coordination.retries import Recovery
from relax_core.errors import ScoringError, SinkError, UpstreamUnreachableError
from relax_core.records import RewardSpec

CTX = StageContext(7, RoleClients({}))


def samples() -> list[Sample]:
    return [
        Sample("a", "g0", [1], [2], prompt="2+2?", response="4", label="4",
               metadata={"route_key": "math", "lang": "en"}),
        Sample("b", "g0", [1], [2], prompt="2+2?", response="5", label="4",
               metadata={"route_key": "math", "lang": "fr"}),
        Sample("c", "g1", [1], [2], prompt="hi", response="hello", label=None),
    ]  # fmt: skip


@pytest.mark.ray
def test_sync_adapters_run_in_ray_workers_on_the_samples_their_label_matcher_accepts(
    ray_local: Any,
) -> None:
    where = RewardSpec(
        name="where", fn=lambda response, label: float(os.getpid()), label_matcher=bool
    )
    exact = RewardSpec(name="exact", fn=lambda response, label: float(response == label))
    batch = samples()
    report = asyncio.run(RewardStage([where, (exact, 2.0)], sync_tasks=2).run(batch, CTX))
    pids = {s.rewards["where"] for s in batch[:2]}
    assert os.getpid() not in pids and all(p > 0 for p in pids)
    assert "where" not in batch[2].rewards  # no label: the matcher declined it
    assert [s.rewards["exact"] for s in batch] == [1.0, 0.0, 0.0]
    assert batch[0].reward == batch[0].rewards["where"] + 2.0
    assert batch[2].reward == 0.0
    assert report.counts["where.scored"] == 2 and report.counts["exact.scored"] == 3


@pytest.mark.ray
def test_pass_metadata_hands_the_sample_metadata_to_the_adapter(ray_local: Any) -> None:
    lang = RewardSpec(
        name="lang",
        fn=lambda response, label, metadata: 1.0 if metadata["lang"] == "en" else 0.0,
        pass_metadata=True,
        label_matcher=lambda label: label is not None,
    )
    batch = samples()
    asyncio.run(RewardStage([lang]).run(batch, CTX))
    assert [s.reward for s in batch] == [1.0, 0.0, None]
    problems = validate_samples(batch, REWARD_FIELDS)
    assert problems == [
        "sample c (group g1): reward is missing (no reward adapter matched its label)"
    ]


@pytest.mark.ray
def test_a_sync_adapter_that_raises_names_the_adapter_and_the_sample(ray_local: Any) -> None:
    strict = RewardSpec(name="strict", fn=lambda response, label: float(label))
    with pytest.raises(ScoringError, match=r"strict: raised for sample c \(group g1\): TypeError"):
        asyncio.run(RewardStage([strict]).run(samples(), CTX))


def test_async_adapters_get_the_context_and_may_report_parse_failures() -> None:
    seen: list[tuple[str, str | None, int]] = []

    async def judge(response: str, label: str | None, *, context: RewardContext) -> Any:
        seen.append((context.prompt, context.route_key, context.batch_id))
        await asyncio.sleep(0)
        if label is None:
            return RewardResult(0.0, parse_failed=True)
        return 1.0 if response == label else 0.0

    batch = samples()
    spec = RewardSpec(name="judge", fn=judge, mode="async", supports_deferred=True)
    report = asyncio.run(RewardStage([spec]).run(batch, CTX))
    assert [s.reward for s in batch] == [1.0, 0.0, 0.0]
    assert report.counts == {"judge.scored": 3, "judge.parse_failures": 1}
    assert sorted(seen) == [("2+2?", "math", 7), ("2+2?", "math", 7), ("hi", None, 7)]


def test_an_adapter_returning_something_else_than_a_number_fails_the_stage() -> None:
    async def wrong(response: str, label: str | None, *, context: RewardContext) -> Any:
        return "yes"

    spec = RewardSpec(name="wrong", fn=wrong, mode="async")
    with pytest.raises(ScoringError, match="wrong: returned 'yes' for sample a"):
        asyncio.run(RewardStage([spec]).run(samples(), CTX))


@pytest.mark.parametrize("value", [math.nan, math.inf, RewardResult(-math.inf)])
def test_a_non_finite_reward_fails_the_stage_naming_the_adapter_and_the_sample(value: Any) -> None:
    async def broken(response: str, label: str | None, *, context: RewardContext) -> Any:
        return value if context.sample.id == "b" else 1.0

    async def good(response: str, label: str | None, *, context: RewardContext) -> Any:
        return 1.0

    spec = RewardSpec(name="broken", fn=broken, mode="async")
    good_spec = RewardSpec(name="good", fn=good, mode="async")
    with pytest.raises(
        ScoringError, match=r"broken: returned -?(nan|inf) for sample b \(group g0\)"
    ):
        asyncio.run(RewardStage([spec, good_spec]).run(samples(), CTX))


def test_validation_names_the_adapter_whose_value_made_the_reward_non_finite() -> None:
    s = samples()[0]
    s.fields["rewards"] = {"exact-match": 1.0, "judge": math.nan}
    s.fields["reward"] = math.nan
    assert validate_samples([s], REWARD_FIELDS) == [
        "sample a (group g0): rewards['judge'] = nan is not a finite number (adapter 'judge')"
    ]


def test_each_adapter_of_a_stage_may_be_kept_under_a_key_of_its_own() -> None:
    # Two judges' verdicts by the same adapter, one per key: both kept, both weighed.
    batch = samples()
    async_half = RewardSpec(name="ahalf", fn=_async_half, mode="async")
    asyncio.run(RewardStage([(async_half, 1.0, "a"), (async_half, 2.0, "b")]).run(batch, CTX))
    assert all(s.rewards == {"a": 0.5, "b": 0.5} and s.reward == 1.5 for s in batch)


async def _async_half(response: str, label: str | None, *, context: RewardContext) -> float:
    return 0.5


def test_an_async_adapter_gets_its_stage_s_role_and_its_one_model() -> None:
    seen: list[tuple[str | None, str | None]] = []

    async def where(response: str, label: str | None, *, context: RewardContext) -> float:
        seen.append((context.role, context.model))
        return 0.0

    spec = RewardSpec(name="where", fn=where, mode="async")
    asyncio.run(RewardStage([spec], role="genrm", models=["judge-b"]).run(samples()[:1], CTX))
    asyncio.run(RewardStage([spec], role="genrm").run(samples()[:1], CTX))
    assert seen == [("genrm", "judge-b"), ("genrm", None)]


def test_reward_stage_refuses_bad_adapter_lists() -> None:
    spec = RewardSpec(name="x", fn=lambda response, label: 0.0)
    with pytest.raises(ValueError, match="keys repeat"):
        RewardStage([spec, spec])
    with pytest.raises(ValueError, match="at least one"):
        RewardStage([])
    with pytest.raises(ValueError, match="weight of 'x' is inf"):
        RewardStage([(spec, float("inf"))])


def test_the_memory_sink_closes_a_partition_once_and_serves_only_closed_ones() -> None:
    sink = MemoryBatchSink()

    async def go() -> None:
        first = await sink.put("train_1", samples()[:2], is_last=False)
        assert (first.count, first.is_last) == (2, False)
        with pytest.raises(SinkError, match="still open"):
            await sink.get("train_1")
        last = await sink.put("train_1", samples()[2:], is_last=True)
        assert (last.partition, last.count, last.is_last) == ("train_1", 3, True)
        assert [s.id for s in await sink.get("train_1")] == ["a", "b", "c"]
        with pytest.raises(SinkError, match="already closed"):
            await sink.put("train_1", samples(), is_last=True)
        assert await sink.delete("train_1") and not await sink.delete("train_1")
        with pytest.raises(SinkError, match="no such partition"):
            await sink.get("train_1")

    asyncio.run(go())


@pytest.mark.ray
def test_the_ray_sink_keeps_partitions_in_its_actor_and_reports_a_dead_store(
    ray_local: Any,
) -> None:
    sink = RayBatchSink.start(name="test-batch-store", namespace="relax-test")

    async def go() -> None:
        receipt = await sink.put("train_0", samples(), is_last=True)
        assert receipt.count == 3
        other = RayBatchSink.connect("test-batch-store", namespace="relax-test")
        got = await other.get("train_0")
        assert [s.id for s in got] == ["a", "b", "c"] and got[0].metadata["lang"] == "en"
        with pytest.raises(SinkError, match="already closed"):
            await other.put("train_0", samples(), is_last=True)
        sink.stop()
        with pytest.raises(SinkError, match="store actor is unreachable"):
            await other.get("train_0")

    asyncio.run(go())


class _Reader:
    """A reader in another process (the trainer's place)."""

    async def ids(self, sink: RayBatchSink, partition: str) -> list[str]:
        return [s.id for s in await sink.get(partition)]


@pytest.mark.ray
def test_the_ray_sink_actor_holds_one_reference_per_put_and_a_reader_elsewhere_gets_samples(
    ray_local: Any,
) -> None:
    import ray

    sink = RayBatchSink.start()
    reader = ray.remote(_Reader).options(num_cpus=0).remote()

    async def go() -> None:
        first = await sink.put("train_0", samples()[:2], is_last=False)
        last = await sink.put("train_0", samples()[2:], is_last=True)
        assert (first.count, last.count, last.is_last) == (2, 3, True)
        assert await sink.partitions() == {"train_0": 3}
        # What the actor holds: one reference per put, never the samples it would unpickle.
        held = await sink.actor.get.remote("train_0")
        assert len(held) == 2 and all(isinstance(r, ray.ObjectRef) for r in held)
        assert await reader.ids.remote(sink, "train_0") == ["a", "b", "c"]
        assert await sink.delete("train_0") and await sink.partitions() == {}

    try:
        asyncio.run(go())
    finally:
        sink.stop()


def _judge_stage(recover_seconds: float, answer_seconds: float) -> tuple[RewardStage, Recovery]:
    """A reward stage (deadline 1 s) whose async adapter finds its engine gone once, then
    answers after ``answer_seconds``; rebuilding the role takes ``recover_seconds``."""
    calls: dict[str, int] = {}

    async def judge(response: str, label: Any, *, context: RewardContext) -> float:
        calls[context.sample.id] = calls.get(context.sample.id, 0) + 1
        if calls[context.sample.id] == 1:
            raise UpstreamUnreachableError(502, "the judge's engine is gone")
        await asyncio.sleep(answer_seconds)
        return 1.0

    async def recover(role: str) -> dict[str, list[str]]:
        await asyncio.sleep(recover_seconds)  # the engine restarting
        return {"rebuilt": [f"{role}.m/replica-0"], "failed": []}

    spec = RewardSpec(name="judge", fn=judge, mode="async")
    recovery = Recovery(recover)
    return RewardStage([spec], role="genrm", timeout=1.0, retries=1), recovery


def test_a_rebuild_waited_for_does_not_count_against_the_reward_stages_deadline() -> None:
    stage, recovery = _judge_stage(recover_seconds=2.5, answer_seconds=0.0)
    batch = samples()
    ctx = StageContext(4, RoleClients({}, recovery=recovery))
    asyncio.run(stage.run(batch, ctx))
    assert [s.rewards["judge"] for s in batch] == [1.0, 1.0, 1.0]
    assert recovery.of(4) == {"retries": {"rewards": 3}, "rebuilt": {"genrm": 1}}
    # Control: the same stage whose retried answers themselves take longer than the deadline.
    stage, recovery = _judge_stage(recover_seconds=0.0, answer_seconds=2.5)
    ctx = StageContext(5, RoleClients({}, recovery=recovery))
    with pytest.raises(ScoringError, match="did not score 3 samples within 1s"):
        asyncio.run(stage.run(samples(), ctx))


def test_a_failing_adapter_cancels_the_other_adapters_pass_before_the_stage_raises() -> None:
    # A slow judge still waiting for its engine when another adapter fails must not keep
    # sending requests after the stage (and its batch) failed.
    outcome: dict[str, str] = {}

    async def slow(response: str, label: Any, *, context: RewardContext) -> float:
        try:
            await asyncio.Event().wait()  # the engine's answer, never coming
        except asyncio.CancelledError:
            outcome[context.sample.id] = "cancelled"
            raise
        return 1.0

    async def failing(response: str, label: Any, *, context: RewardContext) -> float:
        await asyncio.sleep(0.01)
        raise ValueError("no verdict")

    stage = RewardStage(
        [
            RewardSpec(name="slow", fn=slow, mode="async"),
            RewardSpec(name="bad", fn=failing, mode="async"),
        ],
        retries=0,
    )

    async def go() -> None:
        with pytest.raises(ScoringError, match="bad: raised for sample"):
            await stage.run(samples(), CTX)
        assert outcome == dict.fromkeys("abc", "cancelled")  # before the stage's error arrived

    asyncio.run(go())

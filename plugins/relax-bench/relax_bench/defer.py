"""``relax bench defer``: the coordinator's and the deferred batch's own time per batch.

Three roles share one defer slice (a policy generating, a judge and a teacher deferred); a batch is
64 groups x 8 samples (prompt 64 tokens, response 32). Manager handles answer at once and the
stages only write precomputed fields (a reward per sample, a teacher log-prob per response
token), so what is measured is the machinery: begin_batch, capturing the groups, staging
copies, the rollout release and acknowledgment, activate/deactivate of both deferred roles
through the coordinator (operation dedupe, leases), validation of every field, write-back, the
sink put, commit and the woken waiter, with the timeline recording every phase.

The *no-op floor*, measured in the same run, is the same stage bodies, handle calls and sink
put called directly, without coordinator, staging, validation or timeline. ``overhead_ms`` is
the median batch time minus the median floor; the target is <= 30 ms.
"""

from __future__ import annotations

import asyncio
import math
import statistics
import time
from collections.abc import Sequence
from typing import Any

from relax_core import (
    REWARD_FIELDS,
    DeferredBatch,
    DeferredCollector,
    LifecycleCoordinator,
    LifecycleResult,
    MemoryBatchSink,
    Outcome,
    ReplicaResult,
    Sample,
    SampleField,
    Stage,
    StageContext,
    StageReport,
    Timeline,
    partition_name,
)

GROUPS = 64
SAMPLES_PER_GROUP = 8
PROMPT_TOKENS = 64
RESPONSE_TOKENS = 32
TARGET_MS = 30.0


class _Handle:
    """A manager of 4 replicas that confirms every call at once."""

    def __init__(self, name: str) -> None:
        self.name = name
        self._results = {
            op: LifecycleResult(
                op,
                name,
                tuple(ReplicaResult(f"{name}/replica-{i}", Outcome.DONE, state) for i in range(4)),
            )
            for op, state in (("onload", "READY"), ("offload", "SLEEPING"))
        }

    async def onload(self) -> LifecycleResult:
        return self._results["onload"]

    async def offload(self) -> LifecycleResult:
        return self._results["offload"]


class _RewardStage:
    name, role, models = "judge", "judge", ()
    fields = REWARD_FIELDS

    async def run(self, samples: Sequence[Sample], ctx: StageContext | None) -> StageReport:
        for s in samples:
            s.fields["rewards"] = {"judge": 1.0}
            s.fields["reward"] = 1.0
        return StageReport(self.name)


def _per_token_logprobs(value: object, sample: Sample) -> str | None:
    # The check a teacher's log-probs get (relax-teacher's): one finite log-prob <= 0 per
    # response token, its fast path.
    if not isinstance(value, tuple) or len(value) != len(sample.response_ids):
        return "teacher_logprobs: not one per response token"
    if value and not (max(value) <= 0 and math.isfinite(math.fsum(value))):
        return "teacher_logprobs: not finite log-probs <= 0"
    return None


class _TeacherStage:
    name, role, models = "distill", "distill", ()
    fields = (SampleField("teacher_logprobs", _per_token_logprobs),)
    _lps = tuple(-0.5 for _ in range(RESPONSE_TOKENS))

    async def run(self, samples: Sequence[Sample], ctx: StageContext | None) -> StageReport:
        for s in samples:
            s.fields["teacher_logprobs"] = self._lps
        return StageReport(self.name)


def _samples(batch: int) -> list[list[Sample]]:
    prompt = tuple(range(PROMPT_TOKENS))
    response = tuple(range(1000, 1000 + RESPONSE_TOKENS))
    lps = tuple(-0.1 for _ in range(RESPONSE_TOKENS))
    return [
        [
            Sample(
                f"b{batch}-g{g}-s{i}",
                f"b{batch}-g{g}",
                prompt,
                response,
                rollout_logprobs=lps,
                metadata={"route_key": "math"},
                weight_version="1",
            )
            for i in range(SAMPLES_PER_GROUP)
        ]
        for g in range(GROUPS)
    ]


async def _measure(repeats: int) -> dict[str, list[float]]:
    from prometheus_client import CollectorRegistry

    policy, judge, distill = _Handle("policy"), _Handle("judge"), _Handle("distill")
    coordinator = LifecycleCoordinator(
        slices={"policy": "actor:0-7", "judge": "actor:0-7", "distill": "actor:0-7"},
        managers={"judge": [judge], "distill": [distill]},
        generation_role="policy",
    )
    sink = MemoryBatchSink()
    timeline = Timeline(registry=CollectorRegistry())
    reward, prefill = _RewardStage(), _TeacherStage()
    stages: list[Stage] = [reward, prefill]
    batches: list[float] = []
    floors: list[float] = []
    warmup = max(2, repeats // 10)
    for n in range(repeats + warmup):
        groups = _samples(n)
        # The floor: the same stage bodies, handle calls and put, nothing around them.
        flat = [s.staged_copy() for g in groups for s in g]
        begin = time.perf_counter()
        await policy.offload()
        await judge.onload()
        await reward.run(flat, None)
        await judge.offload()
        await distill.onload()
        await prefill.run(flat, None)
        await distill.offload()
        await sink.put(f"floor_{n}", flat, is_last=True)
        floor = time.perf_counter() - begin
        await sink.delete(f"floor_{n}")

        begin = time.perf_counter()
        waiter = asyncio.ensure_future(coordinator.wait_committed(n))
        await coordinator.begin_batch(n)
        collector = DeferredCollector(n)
        for group in groups:
            collector.add(group)
        batch = DeferredBatch(
            n, collector.samples, coordinator=coordinator, rollout=policy, stages=stages,
            sink=sink, timeline=timeline,
        )  # fmt: skip
        result = await batch.run()
        await waiter
        took = time.perf_counter() - begin
        if result.samples != GROUPS * SAMPLES_PER_GROUP:
            raise RuntimeError(f"batch {n} committed {result.samples} samples")
        await sink.delete(partition_name(n))
        if n >= warmup:
            batches.append(took)
            floors.append(floor)
    return {"batch": batches, "floor": floors}


def run(*, quick: bool = False) -> dict[str, Any]:
    """Measure ``repeats`` batches (after a warm-up); return the medians and the verdict."""
    repeats = 10 if quick else 60
    times = asyncio.run(_measure(repeats))
    ms = {k: [v * 1000 for v in vs] for k, vs in times.items()}
    batch = statistics.median(ms["batch"])
    floor = statistics.median(ms["floor"])
    overhead = batch - floor
    return {
        "roles": 3,
        "groups": GROUPS,
        "samples_per_group": SAMPLES_PER_GROUP,
        "samples": GROUPS * SAMPLES_PER_GROUP,
        "response_tokens": RESPONSE_TOKENS,
        "repeats": repeats,
        "batch_ms": round(batch, 3),
        "batch_ms_p90": round(statistics.quantiles(ms["batch"], n=10)[-1], 3),
        "noop_floor_ms": round(floor, 3),
        "overhead_ms": round(overhead, 3),
        "overhead_per_sample_us": round(overhead * 1000 / (GROUPS * SAMPLES_PER_GROUP), 2),
        "target_ms": TARGET_MS,
        "ratio_overhead_to_target": round(overhead / TARGET_MS, 3),
        "within_target": overhead <= TARGET_MS,
    }


def format_result(result: dict[str, Any]) -> str:
    """A short human-readable report."""
    verdict = "within" if result["within_target"] else "OVER"
    return (
        f"deferred batch, {result['roles']} roles, {result['groups']} groups x "
        f"{result['samples_per_group']} samples, no-op stages (median of {result['repeats']}):\n"
        f"  batch {result['batch_ms']:.2f} ms (p90 {result['batch_ms_p90']:.2f}), no-op floor "
        f"{result['noop_floor_ms']:.2f} ms\n"
        f"  overhead {result['overhead_ms']:.2f} ms = {result['ratio_overhead_to_target']:.0%} of "
        f"the {result['target_ms']:g} ms target ({verdict}); "
        f"{result['overhead_per_sample_us']:.1f} us per sample"
    )

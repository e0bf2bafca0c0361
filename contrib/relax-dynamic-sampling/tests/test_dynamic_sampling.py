"""The dynamic-sampling stage: groups whose rewards do not vary are dropped, the batch is filled
by over-sampling (the stages before it scoring what was added), bounded, with the counts
reported — on a real deferred batch under a real coordinator (``relax_core.testing.run_stages``:
the managers are in-process stand-ins; the relax run test below has real engines).
"""

from __future__ import annotations

import asyncio
from typing import Any

import pytest
from relax_dynamic_sampling import BEYOND, NO_VARIANCE, DynamicSampling

from relax_core import (
    REWARD_FIELDS,
    EmptyBatchError,
    PluginManager,
    Sample,
    ScoringError,
    StageReport,
)
from relax_core.testing import run_stages


def group(g: str, n: int = 4) -> list[Sample]:
    return [Sample(f"{g}-s{i}", g, [1, 2], [3, 4]) for i in range(n)]


class Varied:
    """A reward stage: groups named ``v*`` get rewards that vary (0, 1, 0, 1), others 0.5."""

    name, role, models = "rewards", None, ()

    def __init__(self) -> None:
        self.fields = REWARD_FIELDS
        self.seen: list[int] = []

    async def run(self, samples: Any, ctx: Any) -> StageReport:
        self.seen.append(len(samples))
        for s in samples:
            varies = s.group_id.startswith("v")
            s.fields["reward"] = float(int(s.id[-1]) % 2) if varies else 0.5
        return StageReport(self.name)


class Producer:
    """Hands out groups named by a script: ``next`` yields ``v``-groups and ``f``-groups."""

    def __init__(self, script: str) -> None:
        self.script = iter(script)
        self.calls: list[int] = []

    async def generate(self, batch_id: int, **request: Any) -> list[list[Sample]]:
        self.calls.append(request["groups"])
        return [
            group(f"{next(self.script)}{len(self.calls)}-{i}") for i in range(request["groups"])
        ]


def test_flat_groups_are_dropped_and_the_batch_is_filled_by_over_sampling() -> None:
    rewards, producer = Varied(), Producer("fvvv")
    stage = DynamicSampling("dapo", oversample=1.0)
    samples = [*group("v0"), *group("f0"), *group("f1"), *group("v1")]
    result, committed, log = asyncio.run(
        run_stages(samples, [rewards, stage], producer=producer, target_groups=4)
    )
    # Round 1 generates the 2 missing groups (f, v): one more missing; round 2 generates 1 (v).
    assert producer.calls == [2, 1]
    assert rewards.seen == [16, 8, 4]  # the batch, then what each round added
    assert sorted({s.group_id for s in committed}) == ["v0", "v1", "v1-1", "v2-0"]
    (report,) = [r for r in result.reports if r.stage == "dapo"]
    assert report.counts == {
        "kept_groups": 4, "dropped_groups": 3, "trimmed_groups": 0, "generated_groups": 3,
        "rounds": 2,
    }  # fmt: skip
    assert {d.group_id: d.reason for d in result.dropped} == {
        "f0": NO_VARIANCE, "f1": NO_VARIANCE, "f1-0": NO_VARIANCE,
    }  # fmt: skip
    # The reward stage needs no lease, so rollout stays awake from the step's generation through
    # both rounds, and is released once, before the commit.
    assert log == ["generation.offload"]


def test_over_sampling_past_the_batch_size_drops_the_last_groups_beyond_it() -> None:
    stage = DynamicSampling("dapo", oversample=3.0)
    samples = [*group("v0"), *group("f0")]
    result, committed, _ = asyncio.run(
        run_stages(samples, [Varied(), stage], producer=Producer("vvv"), target_groups=2)
    )
    assert sorted({s.group_id for s in committed}) == ["v0", "v1-0"]
    assert [(d.group_id, d.reason) for d in result.dropped][-2:] == [
        ("v1-1", BEYOND), ("v1-2", BEYOND),
    ]  # fmt: skip
    assert result.reports[-1].counts["trimmed_groups"] == 2


def test_a_batch_still_short_after_max_rounds_fails_saying_what_to_change() -> None:
    stage = DynamicSampling("dapo", max_rounds=2)
    with pytest.raises(ScoringError, match=r"1 of 2 groups have rewards that vary after 2"):
        asyncio.run(
            run_stages(
                [*group("v0"), *group("f0")],
                [Varied(), stage],
                producer=Producer("ff"),
                target_groups=2,
            )
        )


def test_a_batch_with_no_group_left_after_max_rounds_is_empty_never_committed() -> None:
    """Every group flat, still after the rounds: the stage leaves the batch empty and the
    batch refuses to commit it (the step's ``on_empty_batch`` skips or fails it)."""
    stage = DynamicSampling("dapo", max_rounds=1)
    with pytest.raises(EmptyBatchError, match="dropped every group"):
        asyncio.run(
            run_stages(
                [*group("f0"), *group("f1")],
                [Varied(), stage],
                producer=Producer("ff"),
                target_groups=2,
            )
        )


def test_it_refuses_to_run_before_the_reward_is_written() -> None:
    with pytest.raises(ScoringError, match="has no 'reward' to filter on"):
        asyncio.run(run_stages(group("v0"), [DynamicSampling("dapo")]))


def test_the_plugin_is_found_through_its_entry_point_and_checks_its_table() -> None:
    from relax_core import build_stages, loads_config, parse_run_config, stage_problems

    pm = PluginManager.create()
    assert pm.registered("stages")["dynamic-sampling"].distribution == "relax-dynamic-sampling"
    run = parse_run_config(
        loads_config(
            '[[run.stages]]\nstage = "reward"\nrewards = [{ adapter = "exact-match" }]\n'
            '[[run.stages]]\nstage = "dynamic-sampling"\noversample = 0.5\nmax_round = 2\n'
        )
    )
    problems = {(p.path, p.rule) for p in stage_problems(run, pm)}
    assert problems == {
        ("run.stages[1].oversample", "range"),
        ("run.stages[1].max_round", "unknown-key"),
    }
    ok = parse_run_config(
        loads_config(
            '[[run.stages]]\nstage = "reward"\nrewards = [{ adapter = "exact-match" }]\n'
            '[[run.stages]]\nstage = "dynamic-sampling"\nname = "dapo"\nmax_rounds = 5\n'
        )
    )
    stage = build_stages(ok, pm)[1]
    assert isinstance(stage, DynamicSampling)
    assert (stage.name, stage.max_rounds, stage.oversample) == ("dapo", 5, 1.0)

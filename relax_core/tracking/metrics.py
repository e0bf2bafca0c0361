"""What a tracker hears of a committed step: its metrics (flat names to finite numbers, listed in
docs/run.md; a value the step lacks is left out) and the rows of the samples it shows."""

from __future__ import annotations

import math
import statistics
from collections.abc import Mapping, Sequence
from typing import Any

from relax_core.coordination.sample import Sample

#: The ``Sample.metadata`` key under which a rollout reports its own numbers per sample (name ->
#: number: a multi-turn rollout's ``turns``, ``tool_calls``, ``environment_seconds`` …); the
#: step's ``rollout`` object aggregates them (:func:`rollout_metrics`).
ROLLOUT_METRICS = "rollout_metrics"


def _number(value: Any) -> float | None:
    if isinstance(value, bool) or not isinstance(value, int | float):
        return None
    value = float(value)
    return value if math.isfinite(value) else None


#: The metrics that are one key of the step's row each: ``(metric, key)``.
_TOP_LEVEL = (
    ("reward/mean", "reward_mean"), ("reward/std", "reward_std"), ("teacher/kl", "teacher_kl"),
    ("teacher/logprob_mean", "teacher_logprob_mean"), ("time/step", "seconds"),
    *((k, k) for k in ("samples", "groups", "tokens", "parse_failures", "switches")),
    ("generated_groups", "generated_groups"),
)  # fmt: skip


def step_metrics(row: Mapping[str, Any]) -> dict[str, float]:
    """The metrics of a committed step's JSON object (``relax run --json``'s step row)."""
    out: dict[str, float] = {}

    def put(name: str, value: Any) -> None:
        if (number := _number(value)) is not None:
            out[name] = number

    for name, key in _TOP_LEVEL:
        put(name, row.get(key))
    samples = row.get("samples")
    if isinstance(samples, int) and samples > 0:
        put("response_length/mean", row.get("tokens", 0) / samples)
    dropped = row.get("dropped") or {}
    put("dropped/groups", dropped.get("groups"))
    put("dropped/samples", dropped.get("samples"))
    for prefix, key in (("reward", "reward_by_key"), ("time", "phases"), ("train", "train")):
        for name, value in (row.get(key) or {}).items():
            put(f"{prefix}/{name}", value)
    for stage, counts in (row.get("stages") or {}).items():
        for key, value in counts.items():
            put(f"stage/{stage}/{key}", value)
    a = row.get("async") or {}
    for k, n in (a.get("staleness") or {}).items():
        put(f"async/staleness/{k}", n)
    put("async/partial_samples", a.get("partial_samples"))
    for name, stats in (row.get("trajectories") or {}).items():
        for key, value in stats.items():
            put(f"trajectories/{name}/{key}", value)
    return out


def rollout_metrics(samples: Sequence[Sample]) -> dict[str, dict[str, float]]:
    """The step's ``rollout`` object: per sample number, its ``mean``, ``max`` and ``total``
    over the samples that have it: ``policy_tokens`` and ``environment_tokens`` (response
    tokens with loss mask 1 and 0), then each finite number in ``metadata[ROLLOUT_METRICS]``."""
    values: dict[str, list[float]] = {"policy_tokens": [], "environment_tokens": []}
    for s in samples:
        policy = sum(s.loss_mask) if s.loss_mask else len(s.response_ids)
        values["policy_tokens"].append(float(policy))
        values["environment_tokens"].append(float(len(s.response_ids) - policy))
        reported = s.metadata.get(ROLLOUT_METRICS)
        if not isinstance(reported, Mapping):
            continue
        for name, value in reported.items():
            if (number := _number(value)) is not None:
                values.setdefault(str(name), []).append(number)
    return {
        name: {"mean": statistics.fmean(v), "max": max(v), "total": math.fsum(v)}
        for name, v in values.items()
        if v
    }


def reward_by_key(samples: Sequence[Sample]) -> dict[str, float]:
    """Each reward adapter's mean over the samples it scored, by its key."""
    values: dict[str, list[float]] = {}
    for s in samples:
        for key, value in s.rewards.items():
            if (number := _number(value)) is not None:
                values.setdefault(key, []).append(number)
    return {key: statistics.fmean(v) for key, v in sorted(values.items())}


def _teacher_kl(sample: Sample) -> float | None:
    """The sample's KL estimate to the teacher on its own tokens: the mean over its response of
    the policy's log-prob minus the teacher's (``None`` without the teacher's log-probs)."""
    teacher = sample.fields.get("teacher_logprobs")
    policy = sample.rollout_logprobs
    if not isinstance(teacher, list | tuple) or not teacher or len(teacher) != len(policy):
        return None
    diffs = [p - t for p, t in zip(policy, teacher, strict=True) if _number(t) is not None]
    return statistics.fmean(diffs) if diffs else None


def sample_rows(samples: Sequence[Sample], count: int) -> list[dict[str, Any]]:
    """``count`` of a step's samples as rows to inspect, taken a group at a time (the first
    sample of each group, then the second, …) so a few rows show several prompts."""
    groups: dict[str, list[Sample]] = {}
    for s in samples:
        groups.setdefault(s.group_id, []).append(s)
    chosen: list[Sample] = []
    depth = 0
    while len(chosen) < min(count, len(samples)):
        for members in groups.values():
            if depth < len(members) and len(chosen) < count:
                chosen.append(members[depth])
        depth += 1
    return [
        {
            "id": s.id,
            "group_id": s.group_id,
            "prompt": s.prompt,
            "response": s.response,
            "label": s.label,
            "reward": _number(s.reward),
            "rewards": {k: _number(v) for k, v in s.rewards.items()},
            "teacher_kl": _teacher_kl(s),
            "response_tokens": len(s.response_ids),
        }
        for s in chosen
    ]

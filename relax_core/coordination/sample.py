"""The Sample record: one generated response, the unit a deferred batch scores and commits.

Generation fills the inputs (prompt and response ids and text, rollout log-probs, group id,
label, metadata, weight version); the deferred stages fill the scored fields (reward(s),
teacher log-probs and top-k, student log-probs). Token sequences are tuples, so a staged copy
(:meth:`Sample.staged_copy`) shares them and costs a few microseconds; only the dicts are copied.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import attrs

__all__ = ["SCORED_FIELDS", "Sample"]

#: The fields deferred stages write; only these are copied back to the original samples.
SCORED_FIELDS: tuple[str, ...] = (
    "reward",
    "rewards",
    "teacher_logprobs",
    "teacher_topk_ids",
    "teacher_topk_logprobs",
    "student_logprobs",
)


def _ints(value: Any) -> tuple[int, ...]:
    return value if type(value) is tuple else tuple(int(v) for v in value)


def _floats(value: Any) -> tuple[float, ...]:
    return value if type(value) is tuple else tuple(float(v) for v in value)


# Assignment runs no converter: stages assign tuples, and validation checks what they wrote
# (an on_setattr pipeline would cost more than the rest of a batch's bookkeeping).
@attrs.define(eq=False, on_setattr=attrs.setters.NO_OP)
class Sample:
    """One response of one prompt; samples of one prompt share ``group_id``.

    ``metadata`` is free-form; ``metadata["route_key"]`` picks the model of a role that routes by
    key (a teacher per data source). ``rewards`` holds each reward adapter's value by name and
    ``reward`` their weighted sum. ``teacher_topk_*`` are ``[response tokens][k]``.
    """

    id: str
    group_id: str
    prompt_ids: tuple[int, ...] = attrs.field(converter=_ints)
    response_ids: tuple[int, ...] = attrs.field(converter=_ints)
    prompt: str = ""
    response: str = ""
    label: str | None = None
    rollout_logprobs: tuple[float, ...] = attrs.field(default=(), converter=_floats)
    metadata: dict[str, Any] = attrs.field(factory=dict)
    weight_version: str | None = None
    reward: float | None = None
    rewards: dict[str, float] = attrs.field(factory=dict)
    teacher_logprobs: tuple[float, ...] | None = None
    teacher_topk_ids: tuple[tuple[int, ...], ...] | None = None
    teacher_topk_logprobs: tuple[tuple[float, ...], ...] | None = None
    student_logprobs: tuple[float, ...] | None = None

    @property
    def route_key(self) -> str | None:
        """``metadata["route_key"]`` when it is a string."""
        key = self.metadata.get("route_key")
        return key if isinstance(key, str) else None

    def staged_copy(self) -> Sample:
        """A copy for CPU staging: stages write into it, never into the original."""
        copy = object.__new__(Sample)
        for name in _FIELDS:
            setattr(copy, name, getattr(self, name))
        copy.metadata = dict(self.metadata)
        copy.rewards = dict(self.rewards)
        return copy

    def clear_scored(self, fields: frozenset[str]) -> None:
        """Empty the scored ``fields`` (a staged copy starts with no scores of its stages)."""
        for name in fields:
            setattr(self, name, {} if name == "rewards" else None)

    def write_back(self, staged: Sample) -> None:
        """Copy the scored fields of ``staged`` (its staged copy) into this sample."""
        for name in SCORED_FIELDS:
            value = getattr(staged, name)
            setattr(self, name, dict(value) if isinstance(value, Mapping) else value)


_FIELDS: tuple[str, ...] = tuple(f.name for f in attrs.fields(Sample))

"""The Sample record: one generated response, the unit a step's stages score and a batch commits.
What stages write goes into :attr:`Sample.fields`; a staged copy shares the token tuples."""

from __future__ import annotations

from collections.abc import Collection, Mapping
from typing import Any, cast

import attrs


def _ints(value: Any) -> tuple[int, ...]:
    return value if type(value) is tuple else tuple(int(v) for v in value)


def _floats(value: Any) -> tuple[float, ...]:
    return value if type(value) is tuple else tuple(float(v) for v in value)


def _boundaries(value: Any) -> tuple[tuple[int, str], ...]:
    if type(value) is tuple and all(type(b) is tuple for b in value):
        return value
    return tuple((int(i), str(v)) for i, v in value)


# Assignment runs no converter: stages write fields, and validation checks what they wrote
# (an on_setattr pipeline would cost more than the rest of a batch's bookkeeping).
@attrs.define(eq=False, on_setattr=attrs.setters.NO_OP)
class Sample:
    """One response of one prompt; samples of one prompt share ``group_id``.

    ``weight_version``: the version of its last token; ``weight_versions``: ``(first token
    index, version)`` boundaries when weights changed mid-generation (:attr:`versions` reads
    both). ``metadata`` is free-form; ``fields``: what the step's stages wrote."""

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
    weight_versions: tuple[tuple[int, str], ...] = attrs.field(default=(), converter=_boundaries)
    #: One 0/1 per ``response_ids`` token (0: an environment's token, never trained on);
    #: empty: every response token is the policy's.
    loss_mask: tuple[int, ...] = attrs.field(default=(), converter=_ints)
    fields: dict[str, Any] = attrs.field(factory=dict)

    @property
    def route_key(self) -> str | None:
        """``metadata["route_key"]`` when it is a string."""
        key = self.metadata.get("route_key")
        return key if isinstance(key, str) else None

    @property
    def reward(self) -> float | None:
        """``fields["reward"]`` (``None`` before a reward stage ran)."""
        return cast("float | None", self.fields.get("reward"))

    @property
    def rewards(self) -> Mapping[str, float]:
        """``fields["rewards"]``: each reward adapter's value, by its key (read-only)."""
        return cast("Mapping[str, float]", self.fields.get("rewards") or {})

    @property
    def versions(self) -> tuple[tuple[int, str | None], ...]:
        """The response's version segments, ``(first token index, version)`` in order."""
        return self.weight_versions or ((0, self.weight_version),)

    def trained(self) -> tuple[bool, ...]:
        """Whether each response token is trained on (:attr:`loss_mask`; empty: all)."""
        if not self.loss_mask:
            return (True,) * len(self.response_ids)
        return tuple(bool(m) for m in self.loss_mask)

    def staged_copy(self, cleared: Collection[str] = ()) -> Sample:
        """A copy for CPU staging, without the fields named in ``cleared``."""
        copy = object.__new__(Sample)
        for name in _SHARED:
            setattr(copy, name, getattr(self, name))
        copy.metadata = dict(self.metadata)
        fields = self.fields
        copy.fields = (
            {k: _copied(v) for k, v in fields.items() if k not in cleared} if fields else {}
        )
        return copy

    def write_back(self, staged: Sample, names: Collection[str]) -> None:
        """Copy the fields ``names`` of ``staged`` (its staged copy) into this sample."""
        for name in names:
            if name in staged.fields:
                self.fields[name] = _copied(staged.fields[name])
            else:
                self.fields.pop(name, None)


def _copied(value: Any) -> Any:
    # A stage's table (rewards by key) is copied; values are immutable otherwise (tuples).
    return dict(value) if isinstance(value, dict) else value


#: The fields a staged copy shares with its original (the dicts are copied).
_SHARED: tuple[str, ...] = tuple(
    f.name for f in attrs.fields(Sample) if f.name not in ("metadata", "fields")
)

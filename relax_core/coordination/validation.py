"""Validation of a staged batch's fields before anything is written back: each declared
:class:`~relax_core.coordination.stages.SampleField` on every sample."""

from __future__ import annotations

from collections.abc import Iterable, Sequence

from relax_core.coordination.sample import Sample
from relax_core.coordination.stages import SampleField
from relax_core.errors import ScoringError

__all__ = ["check_samples", "validate_samples"]

_SHOWN = 5


def validate_samples(samples: Iterable[Sample], fields: Iterable[SampleField]) -> list[str]:
    """Every problem of ``fields`` over ``samples``, as ``sample <id> (group <g>): <problem>``;
    empty when all are valid."""
    specs = tuple(fields)
    problems = []
    for s in samples:
        values = s.fields
        for spec in specs:
            if spec.name not in values:
                problem = f"{spec.name} {spec.missing}" if spec.required else None
            else:
                problem = spec.check(values[spec.name], s) if spec.check is not None else None
            if problem:
                problems.append(f"sample {s.id} (group {s.group_id}): {problem}")
    return problems


def check_samples(samples: Sequence[Sample], fields: Iterable[SampleField]) -> None:
    """Raise :class:`~relax_core.errors.ScoringError` (stage ``validation``) listing the first
    problems and their count; return when every field is valid."""
    problems = validate_samples(samples, fields)
    if problems:
        more = f" (and {len(problems) - _SHOWN} more)" if len(problems) > _SHOWN else ""
        raise ScoringError(
            "validation",
            f"{len(problems)} problem(s) in {len(samples)} staged samples; nothing was written "
            f"back: " + "; ".join(problems[:_SHOWN]) + more,
        )

"""The defer preflight: what a deferred batch cannot stage (partial rollout, several rollout
groups), refused before anything starts."""

from __future__ import annotations

from collections.abc import Iterable, Mapping

import attrs

from relax_core.errors import ConfigProblem, ConfigValidationError


def _strs(value: Iterable[str]) -> tuple[str, ...]:
    return tuple(value)


@attrs.frozen
class DeferredWorkload:
    """What a defer run will do, as far as the preflight needs to know; a field's key path is
    ``{where}.<field>`` unless ``paths`` names another."""

    defer_roles: tuple[str, ...] = attrs.field(converter=_strs)
    generation_models: tuple[str, ...] = attrs.field(default=(), converter=_strs)
    partial_rollout: bool = False
    where: str = "run"
    paths: Mapping[str, str] = attrs.field(factory=dict)

    def path(self, field: str) -> str:
        """The key path of ``field``."""
        return self.paths.get(field, f"{self.where}.{field}")


def deferred_workload_problems(workload: DeferredWorkload) -> list[ConfigProblem]:
    """Every reason ``workload`` cannot run deferred, each with its key path. Pure (a stage
    checks its own adapters)."""
    w = workload
    out: list[ConfigProblem] = []

    def refuse(field: str, rule: str, message: str) -> None:
        out.append(ConfigProblem(w.path(field), rule, message))

    if not w.defer_roles:
        refuse("defer_roles", "defer", "no role is deferred; this is not a deferred workload")
    if w.partial_rollout:
        refuse(
            "partial_rollout",
            "defer-unstageable",
            "partial rollout carries groups over between steps, but a deferred batch stages "
            "closed groups only; turn it off for a defer layout",
        )
    if len(w.generation_models) > 1:
        refuse(
            "generation_models",
            "defer-unstageable",
            f"{len(w.generation_models)} rollout groups ({', '.join(w.generation_models)}); a "
            "deferred batch has one generation group: keep one rollout model",
        )
    return out


def validate_deferred_workload(workload: DeferredWorkload) -> None:
    """Raise every problem of ``workload`` at once.

    :raises ConfigValidationError: listing each problem with its key path."""
    if problems := deferred_workload_problems(workload):
        raise ConfigValidationError(problems)

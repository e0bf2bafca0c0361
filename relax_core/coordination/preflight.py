"""The defer preflight: what a deferred batch cannot stage, refused before anything starts.

A deferred batch is a *closed* batch: every group is generated, then the shared GPUs go to the
step's stages one role at a time, then the batch is committed. What the reference refused for
want of a stage adapter is now a stage (``docs/run.md``): a filter with over-sampling (a stage
may drop groups and have more generated, rollout's lease taken back for it), evaluation data (an
``eval`` stage), several genrm models (one reward stage per model, each its own lease). A reward
adapter without ``supports_deferred`` is refused by the reward stage that lists it. What is
still refused, with its key path:

- partial rollout (groups carried over between steps),
- several rollout groups (one generation role, one model).

:class:`DeferredWorkload` describes the run (``relax run`` fills it from its config; each field
names its key path); :func:`deferred_workload_problems` lists every problem,
:func:`validate_deferred_workload` raises them all at once.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

import attrs

from relax_core.config import ConfigProblem
from relax_core.errors import ConfigValidationError

__all__ = ["DeferredWorkload", "deferred_workload_problems", "validate_deferred_workload"]


def _strs(value: Iterable[str]) -> tuple[str, ...]:
    return tuple(value)


@attrs.frozen
class DeferredWorkload:
    """What a defer run will do, as far as the preflight needs to know.

    :param defer_roles: the roles in deferred phases (``placement.defer_roles``).
    :param generation_models: the generation role's models (more than one is several rollout
        groups).
    :param partial_rollout: groups carried over between steps (no stage for it yet).
    :param where: the config table the run's keys live in (key paths ``{where}.<field>``).
    :param paths: field name -> key path, where a field lives elsewhere.
    """

    defer_roles: tuple[str, ...] = attrs.field(converter=_strs)
    generation_models: tuple[str, ...] = attrs.field(default=(), converter=_strs)
    partial_rollout: bool = False
    where: str = "run"
    paths: Mapping[str, str] = attrs.field(factory=dict)

    def path(self, field: str) -> str:
        """The key path of ``field``."""
        return self.paths.get(field, f"{self.where}.{field}")


def deferred_workload_problems(
    workload: DeferredWorkload, plugin_manager: Any = None
) -> list[ConfigProblem]:
    """Every reason ``workload`` cannot run deferred, each with its key path; empty when it
    can. Pure: starts nothing. (``plugin_manager`` is not read: a stage checks its own
    adapters.)"""
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


def validate_deferred_workload(workload: DeferredWorkload, plugin_manager: Any = None) -> None:
    """Raise every problem of ``workload`` at once.

    :raises ConfigValidationError: listing each problem with its key path.
    """
    problems = deferred_workload_problems(workload, plugin_manager)
    if problems:
        raise ConfigValidationError(problems)

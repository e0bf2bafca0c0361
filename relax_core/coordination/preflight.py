"""The defer preflight: what a deferred batch cannot stage, refused before anything starts.

A deferred batch is a *closed* batch: every group is generated, then the shared GPUs go to the
scoring roles one at a time, then the batch is committed. Workloads that need something else
have no stage adapter yet and are refused with their key path (the reference's list):

- partial rollout (groups carried over between steps),
- dynamic batch sizes (the batch is not closed when scoring starts),
- custom filter hooks (they would drop or rewrite samples after staging),
- evaluation data in a defer run (evaluation would need its own leases),
- several models in one deferred reward stage (one judge per stage),
- several rollout groups (one generation role, one model),
- a reward adapter that is not registered, or does not declare ``supports_deferred``.

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
    :param reward_adapters: reward adapter names of the deferred reward stage, in config order.
    :param reward_role: the role the reward stage's model-backed adapters call (a genrm role),
        and ``reward_models`` its models.
    :param partial_rollout, dynamic_batch, eval_data: run features with no stage adapter.
    :param filter_hooks: custom sample-filter hooks configured for the run.
    :param where: the config table the run's keys live in (key paths ``{where}.<field>``).
    :param paths: field name -> key path, where a field lives elsewhere.
    """

    defer_roles: tuple[str, ...] = attrs.field(converter=_strs)
    generation_models: tuple[str, ...] = attrs.field(default=(), converter=_strs)
    reward_adapters: tuple[str, ...] = attrs.field(default=(), converter=_strs)
    reward_role: str | None = None
    reward_models: tuple[str, ...] = attrs.field(default=(), converter=_strs)
    partial_rollout: bool = False
    dynamic_batch: bool = False
    filter_hooks: tuple[str, ...] = attrs.field(default=(), converter=_strs)
    eval_data: bool = False
    where: str = "run"
    paths: Mapping[str, str] = attrs.field(factory=dict)

    def path(self, field: str) -> str:
        """The key path of ``field``."""
        return self.paths.get(field, f"{self.where}.{field}")


def deferred_workload_problems(
    workload: DeferredWorkload, plugin_manager: Any
) -> list[ConfigProblem]:
    """Every reason ``workload`` cannot run deferred, each with its key path; empty when it
    can. Pure: starts nothing."""
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
    if w.dynamic_batch:
        refuse(
            "dynamic_batch",
            "defer-unstageable",
            "a dynamic batch size is not closed when scoring starts; use a fixed batch size in "
            "a defer layout",
        )
    if w.filter_hooks:
        refuse(
            "filter_hooks",
            "defer-unstageable",
            f"custom filter hooks {list(w.filter_hooks)} would drop or rewrite samples after "
            "staging; deferred scoring has no stage for them (remove them, or use split)",
        )
    if w.eval_data:
        refuse(
            "eval_data",
            "defer-unstageable",
            "evaluation data in a defer run needs leases of its own; evaluate in a separate "
            "run, or use a split layout",
        )
    if len(w.generation_models) > 1:
        refuse(
            "generation_models",
            "defer-unstageable",
            f"{len(w.generation_models)} rollout groups ({', '.join(w.generation_models)}); a "
            "deferred batch has one generation group: keep one rollout model",
        )
    if w.reward_role is not None and w.reward_role in w.defer_roles and len(w.reward_models) > 1:
        refuse(
            "reward_models",
            "defer-unstageable",
            f"the deferred reward stage would call {len(w.reward_models)} {w.reward_role} models "
            f"({', '.join(w.reward_models)}); one deferred stage serves one model: keep one",
        )
    registered = plugin_manager.registered("reward_adapters")
    for i, name in enumerate(w.reward_adapters):
        path = f"{w.path('reward_adapters')}[{i}]"
        entry = registered.get(name)
        if entry is None:
            out.append(
                ConfigProblem(
                    path,
                    "plugin",
                    f"no reward adapter {name!r} is registered (registered: "
                    f"{', '.join(sorted(registered)) or 'none'}); install its plugin",
                )
            )
        elif not entry.record.supports_deferred:
            out.append(
                ConfigProblem(
                    path,
                    "defer-adapter",
                    f"reward adapter {name!r} (from {entry.distribution}) does not declare "
                    "supports_deferred, so it cannot score a staged batch in a deferred phase; "
                    "use an adapter that does, or a split layout",
                )
            )
    return out


def validate_deferred_workload(workload: DeferredWorkload, plugin_manager: Any) -> None:
    """Raise every problem of ``workload`` at once.

    :raises ConfigValidationError: listing each problem with its key path.
    """
    problems = deferred_workload_problems(workload, plugin_manager)
    if problems:
        raise ConfigValidationError(problems)

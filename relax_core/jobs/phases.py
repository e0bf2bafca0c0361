"""The order a job's models start in, one phase at a time: each phase of deferred roles starts
and is put to sleep before the next, then every other role starts awake."""

from __future__ import annotations

import threading
from collections.abc import Callable, Sequence
from typing import Any

from relax_core.config import JobConfig
from relax_core.errors import LifecycleError
from relax_core.jobs.models import ModelHandle
from relax_core.manager import LifecycleResult

#: ``on_done(handle, result_or_error)`` of :func:`start_models`.
OnDone = Callable[[ModelHandle, "LifecycleResult | BaseException"], None]


def deferred_roles(config: JobConfig) -> list[str]:
    """The configured roles of ``placement.defer_roles``, in its order."""
    names = {r.name for r in config.roles}
    return [r for r in config.placement.defer_roles if r in names]


def start_order(config: JobConfig, plan: Any) -> list[tuple[tuple[str, ...], bool]]:
    """The order a job starts its roles in: ``(roles, sleep_after)`` steps, each deferred
    phase on its own (in the plan's run order), then every other role. Pure."""
    deferred = deferred_roles(config)
    rank = {phase: i for i, phase in enumerate(plan.phases)}

    def phase_of(role: str) -> int:
        found = [rank.get(p.phase, len(rank)) for p in plan.placements if p.role == role]
        return min(found, default=len(rank))

    steps: list[tuple[tuple[str, ...], bool]] = []
    for role in sorted(deferred, key=phase_of):
        if steps and phase_of(steps[-1][0][0]) == phase_of(role):
            steps[-1] = ((*steps[-1][0], role), True)
        else:
            steps.append(((role,), True))
    awake = tuple(r.name for r in config.roles if r.name not in deferred)
    if awake:
        steps.append((awake, False))
    return steps


def start_models(
    models: Sequence[ModelHandle],
    *,
    on_done: OnDone | None = None,
    on_interrupt: Callable[[], None] | None = None,
    logs: str | None = None,
) -> dict[str, LifecycleResult]:
    """Start every model at once (one thread each); ``key`` -> its result. ``on_done(model,
    result_or_error)`` hears each; at Ctrl-C ``on_interrupt()``, then every start ends. Blocking.
    :raises LifecycleError: a model did not start, naming each (and ``logs``), after all ended."""
    outcomes: dict[str, LifecycleResult | BaseException] = {}
    lock = threading.Lock()

    def one(model: ModelHandle) -> None:
        outcome: LifecycleResult | BaseException
        try:
            outcome = model.start()
        except Exception as exc:  # reported below with every other model's
            outcome = exc
        with lock:
            outcomes[model.key] = outcome
        if on_done is not None:
            on_done(model, outcome)

    starters = [
        threading.Thread(target=one, args=(m,), daemon=True, name=f"start-{m.key}") for m in models
    ]
    for t in starters:
        t.start()
    try:
        for t in starters:
            t.join()
    except KeyboardInterrupt:
        if on_interrupt is not None:
            on_interrupt()
        for t in starters:
            t.join()
        raise
    problems = []
    for key, outcome in outcomes.items():
        if isinstance(outcome, BaseException):
            problems.append(f"{key}: {type(outcome).__name__}: {outcome}")
        elif not outcome.ok:
            problems += [f"{key} {failed.engine_id}: {failed.error}" for failed in outcome.failed]
    if problems:
        raise LifecycleError(
            "engines did not become READY:\n  "
            + "\n  ".join(problems)
            + (f"\nsee the engine logs in {logs}" if logs else "\nsee the engine logs")
        )
    return {k: o for k, o in outcomes.items() if isinstance(o, LifecycleResult)}


def put_to_sleep(model: ModelHandle) -> LifecycleResult:
    """Put a started deferred model to sleep (its default tags).
    :raises LifecycleError: a replica did not confirm SLEEPING."""
    result = model.offload()
    if wrong := {e: s for e, s in result.states.items() if s != "SLEEPING"}:
        errors = "; ".join(str(r.error) for r in result.failed)
        raise LifecycleError(
            f"{model.key} could not be put to sleep after its start ({wrong}"
            + (f"; {errors}" if errors else "")
            + "); it shares GPUs with later phases, so nothing more is started"
        )
    return result

"""What of a job ``relax serve`` and ``relax run`` cannot run, found before anything starts:
:func:`check_job`, each problem ``key.path: [rule] message``. Pure."""

from __future__ import annotations

from typing import Any

from relax_core.config import ConfigReader, JobConfig, ModelConfig
from relax_core.errors import ConfigError, ConfigProblem
from relax_core.jobs.managers import backend_options, router_record
from relax_core.jobs.phases import deferred_roles
from relax_core.plugins import PluginManager


def check_job(config: JobConfig, plugin_manager: PluginManager) -> list[str]:
    """Every reason ``config`` cannot be served (placement violations and servability), each
    as ``key.path: [rule] message``; empty when it can. Pure: starts nothing."""
    from relax_core.placement import preflight

    result = preflight(config, plugin_manager)
    problems = [str(v) for v in result.violations] if result.plan is None else []
    if result.plan is not None:
        problems += [str(p) for p in serve_phase_problems(config, result.plan)]
    return problems + [str(p) for p in servable_problems(config, plugin_manager)]


def servable_problems(config: JobConfig, plugin_manager: PluginManager) -> list[ConfigProblem]:
    """What of ``config`` ``relax serve`` cannot run beyond the placement planner's checks:
    the engine backend and its device, the ``engine`` table against the backend's options
    record, and the route mode (router plugin, policy, STATIC models, router keys)."""
    problems: list[ConfigProblem] = []
    roles = plugin_manager.registered("roles")
    backends = plugin_manager.registered("engine_backends")
    for role in config.roles:
        if role.name not in roles:
            continue  # the planner's unknown-role violation
        spec = roles[role.name].record
        for model in role.models:
            if model.external:
                pass  # no engine is started: the backend is not used
            elif model.backend not in backends:
                problems.append(
                    ConfigProblem(
                        f"{model.path}.backend",
                        "plugin",
                        f"no engine backend {model.backend!r} is registered (registered: "
                        f"{', '.join(sorted(backends)) or 'none'}); install its plugin",
                    )
                )
            else:
                backend = backends[model.backend].record
                if model.device not in backend.devices:
                    problems.append(
                        ConfigProblem(
                            f"{model.path}.device",
                            "device",
                            f"engine backend {model.backend!r} runs on "
                            f"{', '.join(sorted(backend.devices))}, not {model.device!r}",
                        )
                    )
                reader = ConfigReader()
                backend_options(model, backend, reader)
                problems += reader.problems
            problems += _route_problems(model, spec, plugin_manager)
    return problems


def _route_problems(model: ModelConfig, role: Any, pm: PluginManager) -> list[ConfigProblem]:
    route_mode = model.route_mode or role.default_route_mode
    if route_mode == "DIRECT":
        router = model.router
        no_router = (
            'a DIRECT model has no router; drop this key or set route_mode = "SGLANG_ROUTER"'
        )
        given = (
            ("router", router.name, no_router),
            ("router_policy", router.policy, no_router),
            ("router_allow_dropped_fields", router.allow_dropped_fields, no_router),
            ("router_args", router.args, no_router),
            (
                "pd_prefill_engines",
                model.engine.pd_prefill_engines is not None,
                "prefill/decode workers are reachable only through a router; set "
                'route_mode = "SGLANG_ROUTER"',
            ),
        )
        return [
            ConfigProblem(f"{model.path}.{key}", "route-mode", why)
            for key, value, why in given
            if value
        ]
    try:
        router_record(model, role, pm)
    except ConfigError as exc:
        return [ConfigProblem(exc.path, "router", exc.message)]
    return []


def serve_phase_problems(config: JobConfig, plan: Any) -> list[ConfigProblem]:
    """The phases of ``plan`` that ``relax serve`` cannot keep apart, by key path: two roles
    not deferred, in different phases on overlapping bundles. Pure."""
    from relax_core.placement.plan import PHASE_RESIDENT

    deferred = set(deferred_roles(config))
    awake = [
        p
        for p in plan.placements
        if p.pool is not None and p.phase != PHASE_RESIDENT and p.role not in deferred
    ]
    problems = []
    for i, a in enumerate(awake):
        for b in awake[i + 1 :]:
            if (
                a.phase != b.phase
                and a.pool == b.pool
                and (a.bundle_start or 0) < b.bundle_end
                and (b.bundle_start or 0) < a.bundle_end
            ):
                problems.append(
                    ConfigProblem(
                        f"{b.path}",
                        "serve-phases",
                        f"{b.key} (phase {b.phase!r}) and {a.key} (phase {a.phase!r}) share "
                        f"bundles {max(a.bundle_start or 0, b.bundle_start or 0)}-"
                        f"{min(a.bundle_end, b.bundle_end) - 1} of pool {a.pool!r}, and neither "
                        "role is deferred: relax serve keeps only deferred roles asleep, so both "
                        "would be resident at once. List one in placement.defer_roles, or give "
                        "it bundles of its own",
                    )
                )
    return problems

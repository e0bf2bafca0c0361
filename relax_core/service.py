"""The role service: one per inference role, the same shape for rollout, genrm and teacher.

A :class:`RoleService` holds ``dict[model_id, InferenceManager]`` and one
:class:`~relax_core.registry.RegistryPublisher`; every manager publishes its model's schema-2
view into that publisher, so :meth:`RoleService.snapshot` is the role's one aggregated snapshot
(what the role gateway serves and routes by). :func:`build_role_service` builds one from a job
config's role and the bound placement; :func:`servable_problems` says, before anything starts,
what of a job ``relax serve`` cannot run. :meth:`RoleService.start_monitor` health-checks every
replica periodically (a dead engine's replica is FAILED, so no longer routed to, and rebuilt).
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Mapping
from typing import Any

from relax_core.config import ConfigProblem, JobConfig, ModelConfig, RoleConfig
from relax_core.engine_spec import InferenceEngineSpec
from relax_core.errors import ConfigError, LifecycleError, RelaxError
from relax_core.manager import (
    HealthReport,
    InferenceManager,
    ManagerTimeouts,
    ModelLaunch,
    ReplicaPlacement,
)
from relax_core.plugins import PluginManager
from relax_core.registry import RegistryPublisher
from relax_core.schema import RoleSnapshot, RoutingSpec

__all__ = ["RoleService", "build_role_service", "routing_spec", "servable_problems"]

#: ``on_report(model_id, report_or_error)`` of :meth:`RoleService.start_monitor`.
MonitorCallback = Callable[[str, "HealthReport | BaseException"], None]


def routing_spec(role: RoleConfig) -> RoutingSpec:
    """The role's routing rules from its config: default model, route keys, aliases, policy."""
    return RoutingSpec(
        default_model=role.default_model or role.models[0].name,
        route_key_map={key: m.name for m in role.models for key in m.route_keys},
        aliases={alias: m.name for m in role.models for alias in m.aliases},
        policy=role.policy or "round_robin",
    )


class RoleService:
    """The managers of one role's models and the role's registry.

    Thread-safe: :meth:`snapshot` may be called from gateway threads while managers start.
    """

    def __init__(self, role: str, routing: RoutingSpec, *, weight_sources: Any = None) -> None:
        self.role = role
        self.publisher = RegistryPublisher(role, routing, weight_sources=weight_sources)
        self.managers: dict[str, InferenceManager] = {}
        self.model_paths: dict[str, str] = {}
        self._monitor: threading.Thread | None = None
        self._monitor_stop = threading.Event()

    def add(
        self, model_id: str, manager: InferenceManager, *, model_path: str | None = None
    ) -> None:
        """Add a model's manager (built with ``publisher=self.publisher``)."""
        if model_id in self.managers:
            raise ValueError(f"role {self.role!r} already has a model {model_id!r}")
        self.managers[model_id] = manager
        if model_path is not None:
            self.model_paths[model_id] = model_path

    def snapshot(self) -> RoleSnapshot:
        """The role's schema-2 snapshot, aggregated over every model."""
        return self.publisher.snapshot()

    def start(self, *, on_done: Callable[[str, Any], None] | None = None) -> dict[str, Any]:
        """Start every model's engines in parallel; return each model's ``LifecycleResult``.

        ``on_done(model_id, result_or_error)`` is called as each model finishes.

        :raises LifecycleError: some replica did not become READY (naming each), after every
            model has finished starting.
        """
        results: dict[str, Any] = {}
        lock = threading.Lock()

        def one(model_id: str, manager: InferenceManager) -> None:
            try:
                outcome: Any = manager.start()
            except Exception as exc:
                outcome = exc
            with lock:
                results[model_id] = outcome
            if on_done is not None:
                on_done(model_id, outcome)

        threads = [
            threading.Thread(target=one, args=item, name=f"start-{self.role}-{item[0]}")
            for item in self.managers.items()
        ]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        problems = []
        for model_id, outcome in results.items():
            if isinstance(outcome, BaseException):
                problems.append(f"{self.role}.{model_id}: {type(outcome).__name__}: {outcome}")
            elif not outcome.ok:
                for failed in outcome.failed:
                    problems.append(f"{self.role}.{model_id} {failed.engine_id}: {failed.error}")
        if problems:
            raise LifecycleError(
                "engines did not become READY:\n  "
                + "\n  ".join(problems)
                + "\nsee the engine logs; `relax serve` shuts everything down"
            )
        return results

    def engine_pids(self) -> dict[str, list[int]]:
        """Every live engine process id the managers know of, by engine id."""
        out: dict[str, list[int]] = {}
        for manager in self.managers.values():
            for engine_id, pids in manager.engine_pids().items():
                out[engine_id] = [p for p in pids if p]
        return out

    # -- health monitor --------------------------------------------------------------------

    def start_monitor(
        self, interval: float, *, recover: bool = True, on_report: MonitorCallback | None = None
    ) -> None:
        """Health-check every model every ``interval`` seconds, in a daemon thread.

        Each round calls ``manager.health_check(recover=recover)`` model by model: a replica
        whose engine died or stopped answering is marked FAILED (published without a URL, so
        gateways stop routing to it) and, with ``recover``, cleaned and rebuilt.
        ``on_report(model_id, report_or_error)`` is called for every round that found a
        problem, and for every error of a round (a fenced model raises
        ``InferenceRecoveryRequired``: an operator must confirm the cleanup). Idempotent.

        :raises ValueError: ``interval`` is not a positive number of seconds.
        """
        if not interval > 0:
            raise ValueError(f"interval={interval!r}: give a positive number of seconds")
        if self._monitor is not None and self._monitor.is_alive():
            return
        self._monitor_stop.clear()
        self._monitor = threading.Thread(
            target=self._watch,
            args=(interval, recover, on_report),
            name=f"health-{self.role}",
            daemon=True,
        )
        self._monitor.start()

    def stop_monitor(self, timeout: float = 60.0) -> None:
        """Stop the health monitor; wait up to ``timeout`` for a check in progress. Idempotent."""
        self._monitor_stop.set()
        if self._monitor is not None:
            self._monitor.join(timeout)
            self._monitor = None

    def _watch(self, interval: float, recover: bool, on_report: MonitorCallback | None) -> None:
        while not self._monitor_stop.wait(interval):
            for model_id, manager in list(self.managers.items()):
                if self._monitor_stop.is_set():
                    return
                outcome: HealthReport | BaseException
                try:
                    outcome = manager.health_check(recover=recover)
                except Exception as exc:  # reported, not swallowed: the monitor must go on
                    outcome = exc
                failed = isinstance(outcome, BaseException) or not all(
                    r.healthy for r in outcome.replicas
                )
                if failed and on_report is not None and not self._monitor_stop.is_set():
                    on_report(model_id, outcome)

    def shutdown(self) -> list[str]:
        """Stop the monitor, shut every manager down (all are tried); return the problems,
        empty when clean."""
        self.stop_monitor()
        problems = []
        for model_id, manager in self.managers.items():
            try:
                manager.shutdown()
            except RelaxError as exc:
                problems.append(f"{self.role}.{model_id}: {exc}")
        return problems


def servable_problems(config: JobConfig, plugin_manager: PluginManager) -> list[ConfigProblem]:
    """What of ``config`` ``relax serve`` cannot run, found before anything starts.

    The placement planner checks budgets and weight sources; this checks the rest a role
    service needs: the role is registered, the engine backend is registered and runs on the
    model's device, and the route mode is one ``relax serve`` can route (``DIRECT``; an
    ``SGLANG_ROUTER`` model needs the router plugin).
    """
    problems: list[ConfigProblem] = []
    roles = plugin_manager.registered("roles")
    backends = plugin_manager.registered("engine_backends")
    for role in config.roles:
        if role.name not in roles:
            problems.append(
                ConfigProblem(
                    f"roles.{role.name}",
                    "plugin",
                    f"no plugin registers the role {role.name!r} (registered: "
                    f"{', '.join(sorted(roles)) or 'none'}); install its plugin",
                )
            )
            continue
        spec = roles[role.name].record
        for model in role.models:
            if model.backend not in backends:
                problems.append(
                    ConfigProblem(
                        f"{model.path}.backend",
                        "plugin",
                        f"no engine backend {model.backend!r} is registered (registered: "
                        f"{', '.join(sorted(backends)) or 'none'}); install its plugin",
                    )
                )
            elif model.device not in backends[model.backend].record.devices:
                problems.append(
                    ConfigProblem(
                        f"{model.path}.device",
                        "device",
                        f"engine backend {model.backend!r} runs on "
                        f"{', '.join(sorted(backends[model.backend].record.devices))}, "
                        f"not {model.device!r}",
                    )
                )
            route_mode = model.route_mode or spec.default_route_mode
            if route_mode != "DIRECT":
                problems.append(
                    ConfigProblem(
                        f"{model.path}.route_mode",
                        "route-mode",
                        f"{route_mode} (the {role.name} role's default when not set) needs the "
                        'SGLang router plugin, which is not installed; set route_mode = "DIRECT" '
                        "to route this model like the static roles (its weight source stays "
                        "as configured)",
                    )
                )
    return problems


def build_role_service(
    role: RoleConfig,
    *,
    plugin_manager: PluginManager,
    placements: Mapping[str, ReplicaPlacement],
    timeouts: ManagerTimeouts | None = None,
    log_dir: str | None = None,
) -> RoleService:
    """The role service of ``role``: one manager per model on ``placements[model]``.

    :raises ConfigError: a model asks for something ``relax serve`` cannot run yet (an
        ``SGLANG_ROUTER`` model without a router plugin), naming its key path.
    """
    spec = plugin_manager.role(role.name)
    service = RoleService(
        role.name, routing_spec(role), weight_sources=plugin_manager.registered("weight_sources")
    )
    for model in role.models:
        route_mode = model.route_mode or spec.default_route_mode
        if route_mode != "DIRECT":
            raise ConfigError(
                f"{model.path}.route_mode",
                f"{route_mode} needs the SGLang router plugin, which is not installed; set "
                'route_mode = "DIRECT" to route this model like the static roles (its weight '
                "source stays as configured)",
            )
        source = plugin_manager.weight_source(model.weight_source or spec.default_weight_source)
        try:
            engine_spec = InferenceEngineSpec.for_role(
                spec, source, weights_cpu_backup=bool(model.weights_cpu_backup)
            )
        except ValueError as exc:
            raise ConfigError(f"{model.path}.weight_source", str(exc)) from None
        manager = InferenceManager(
            model.name,
            spec=engine_spec,
            backend=plugin_manager.engine_backend(model.backend),
            launch=_launch(model, log_dir, placements[model.name].nodes_per_replica),
            placement=placements[model.name],
            publisher=service.publisher,
            route_mode="DIRECT",
            timeouts=timeouts,
        )
        service.add(model.name, manager, model_path=model.model_path)
    return service


def _launch(model: ModelConfig, log_dir: str | None, nodes: int) -> ModelLaunch:
    return ModelLaunch(
        model_path=model.model_path,
        nodes_per_replica=nodes,
        served_model_name=model.served_model_name or model.name,
        tp=model.tp,
        pp=model.pp,
        device=model.device,
        dtype=model.dtype,
        seed=model.seed,
        log_dir=log_dir,
        extra_args=model.extra_args,  # type: ignore[arg-type]  # attrs converter=tuple
        env=dict(model.env),
    )

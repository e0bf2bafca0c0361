"""The role service: one per inference role, the same shape for every role.

A :class:`RoleService` holds ``dict[model_id, InferenceManager]`` and one
:class:`~relax_core.discovery.publisher.RegistryPublisher`; every manager publishes its model's
schema-2 view into that publisher, so :meth:`RoleService.snapshot` is the role's one aggregated
snapshot (what the role gateway serves and routes by). A model routed ``SGLANG_ROUTER`` also has
a router (a plugin's :class:`~relax_core.records.RouterBackend`) in front of its heads: the
service starts it before the engines, its manager keeps its membership, its URL is the model's
published ``router_url``, and the service stops it after the engines.

:func:`build_role_service` builds one from a job config's role and the bound placement;
:func:`servable_problems` says, before anything starts, what of a job ``relax serve`` cannot
run. :meth:`RoleService.start_monitor` health-checks every replica periodically (a dead engine's
replica is FAILED, so no longer routed to, and rebuilt).
"""

from __future__ import annotations

import contextlib
import signal
import sys
import threading
import time
from collections.abc import Callable, Collection, Iterator, Mapping
from typing import Any, TextIO

from relax_core._threads import each_in_thread
from relax_core.config import ConfigProblem, JobConfig, ModelConfig, RoleConfig
from relax_core.discovery.publisher import RegistryPublisher
from relax_core.discovery.schema import RoleSnapshot, RoutingSpec
from relax_core.discovery.server import RegistryServer
from relax_core.discovery.status import render_snapshot
from relax_core.engine.spec import InferenceEngineSpec
from relax_core.errors import ConfigError, LifecycleError, RelaxError, SnapshotError
from relax_core.gateway.handler import GatewayOptions
from relax_core.gateway.serving import RunningGateway, start_actor_gateway, start_thread_gateway
from relax_core.manager import (
    HealthReport,
    InferenceManager,
    ManagerTimeouts,
    ModelLaunch,
    ReplicaPlacement,
    UnconfirmedWorker,
)
from relax_core.manager.external import ExternalEngines
from relax_core.plugins import PluginManager
from relax_core.records import RouterBackend, RouterLaunchSpec, RouterProcess

__all__ = [
    "RoleService",
    "ServedJob",
    "ShutdownSignals",
    "bind_pools",
    "build_role_service",
    "check_job",
    "describe_job",
    "engine_launch_specs",
    "manager_arguments",
    "ray_session",
    "replica_placements",
    "router_launch_spec",
    "router_record",
    "routing_spec",
    "servable_problems",
    "serve_job",
    "serve_phase_problems",
    "start_order",
]

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

    ``weight_sources`` and ``static_roles`` go to the role's :class:`RegistryPublisher`.
    Thread-safe: :meth:`snapshot` may be called from gateway threads while managers start.
    """

    def __init__(
        self,
        role: str,
        routing: RoutingSpec,
        *,
        weight_sources: Any = None,
        static_roles: Collection[str] | None = None,
    ) -> None:
        self.role = role
        self.publisher = RegistryPublisher(
            role, routing, weight_sources=weight_sources, static_roles=static_roles
        )
        self.managers: dict[str, InferenceManager | ExternalEngines] = {}
        #: model id -> the router in front of its heads (SGLANG_ROUTER models)
        self.routers: dict[str, RouterProcess] = {}
        self.model_paths: dict[str, str] = {}
        self.router_timeout = 60.0
        self._monitor: threading.Thread | None = None
        self._monitor_stop = threading.Event()

    def add(
        self,
        model_id: str,
        manager: InferenceManager | ExternalEngines,
        *,
        model_path: str | None = None,
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

        Every router is made ready first (it serves, speaks its worker API, keeps every request
        field), so engines start only behind a router that works; afterwards every router must
        have taken its model's READY heads.

        :raises ConfigError: a router drops a request field the roles send (nothing started).
        :raises LifecycleError: a router did not start, or some replica did not become READY
            (naming each), after every model has finished starting.
        """
        self._ready_routers()
        results: dict[str, Any] = {}
        lock = threading.Lock()

        def one(model_id: str, manager: InferenceManager | ExternalEngines) -> None:
            try:
                outcome: Any = manager.start()
            except Exception as exc:
                outcome = exc
            with lock:
                results[model_id] = outcome
            if on_done is not None:
                on_done(model_id, outcome)

        each_in_thread(one, self.managers.items(), name=f"start-{self.role}")
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
        for model_id, router in self.routers.items():
            trouble = router.check()
            if trouble:
                raise LifecycleError(
                    f"the router of {self.role}.{model_id} ({router.url}) did not take the "
                    "model's heads:\n  " + "\n  ".join(trouble)
                )
        return results

    def _ready_routers(self) -> None:
        """Wait for every router at once; raise the first failure once all have finished."""
        errors: dict[str, BaseException] = {}

        def one(model_id: str, router: RouterProcess) -> None:
            try:
                router.wait_ready(self.router_timeout)
            except BaseException as exc:  # re-raised below, after every router has finished
                errors[model_id] = exc

        each_in_thread(one, self.routers.items(), name=f"router-{self.role}")
        for _model_id, exc in sorted(errors.items()):
            raise exc

    def router_pids(self) -> dict[str, list[int]]:
        """``<model>/router`` -> the process ids of each model's router."""
        return {f"{model_id}/router": r.pids() for model_id, r in self.routers.items()}

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

        Each round calls ``manager.health_check(recover=recover)`` for every model at once: a
        replica whose engine died, or stopped answering for the model's ``unhealthy_after``
        rounds in a row, is marked FAILED (published without a URL, so gateways stop routing
        to it, and removed from its router) and, with ``recover``, cleaned and rebuilt; then
        every router's ``check()`` (a router that exited is restarted and its heads registered
        again).
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
            # Every model at once: one model's slow probes (bounded by its health deadline)
            # must not delay the others' round.
            each_in_thread(
                self._check_one,
                [(m, manager, recover, on_report) for m, manager in list(self.managers.items())],
                name=f"health-{self.role}",
                daemon=True,
            )
            for model_id, router in list(self.routers.items()):
                if self._monitor_stop.is_set():
                    return
                trouble = router.check()  # restarts a dead router, retries registrations
                if trouble and on_report is not None:
                    on_report(
                        model_id, LifecycleError(f"router {router.url}: " + "; ".join(trouble))
                    )

    def _check_one(
        self, model_id: str, manager: Any, recover: bool, on_report: MonitorCallback | None
    ) -> None:
        if self._monitor_stop.is_set():
            return
        outcome: HealthReport | BaseException
        try:
            outcome = manager.health_check(recover=recover)
        except Exception as exc:  # reported, not swallowed: the monitor must go on
            outcome = exc
        failed = isinstance(outcome, BaseException) or not all(r.healthy for r in outcome.replicas)
        if failed and on_report is not None and not self._monitor_stop.is_set():
            on_report(model_id, outcome)

    def unconfirmed_workers(self) -> list[UnconfirmedWorker]:
        """Every worker of every model whose cleanup is not confirmed (fenced or pending):
        their placement groups must not be released."""
        return [
            w
            for manager in self.managers.values()
            # External engines have no workers of ours.
            for w in getattr(manager, "unconfirmed_workers", list)()
        ]

    def shutdown(self) -> list[str]:
        """Stop the monitor, shut every manager down (all are tried); return the problems,
        empty when clean. A fenced worker's or an unconfirmed shutdown's error is one of them;
        :meth:`unconfirmed_workers` says which workers, on which placement groups."""
        self.stop_monitor()
        problems = []
        for model_id, manager in self.managers.items():
            try:
                manager.shutdown()
            except RelaxError as exc:
                problems.append(f"{self.role}.{model_id}: {exc}")
        # After the engines: each manager's shutdown took its heads out of the router first.
        self.stop_routers()
        return problems

    def stop_routers(self, timeout: float = 3.0) -> None:
        """Stop every router (idempotent). They are stopped last, when no traffic is left, so
        a short grace is enough (smg would otherwise linger for its drain settle time)."""
        for router in self.routers.values():
            router.terminate(timeout)


def servable_problems(config: JobConfig, plugin_manager: PluginManager) -> list[ConfigProblem]:
    """What of ``config`` ``relax serve`` cannot run, found before anything starts.

    The placement planner checks that every role is registered, budgets and weight sources;
    this checks the rest a role service needs: the engine backend is registered and runs on the
    model's device, and the route mode can be served: an ``SGLANG_ROUTER`` model needs an
    installed router plugin (its policy one the router supports; never a STATIC model);
    router and prefill/decode keys need ``SGLANG_ROUTER``.
    """
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
            problems += _route_problems(model, spec, plugin_manager)
    return problems


def _route_problems(model: ModelConfig, role: Any, pm: PluginManager) -> list[ConfigProblem]:
    route_mode = model.route_mode or role.default_route_mode
    if route_mode == "DIRECT":
        out = []
        for key in ("router", "router_policy", "router_allow_dropped_fields", "router_args"):
            if getattr(model, key):
                out.append(
                    ConfigProblem(
                        f"{model.path}.{key}",
                        "route-mode",
                        "a DIRECT model has no router; drop this key or set route_mode = "
                        '"SGLANG_ROUTER"',
                    )
                )
        if model.pd_prefill_engines is not None:
            out.append(
                ConfigProblem(
                    f"{model.path}.pd_prefill_engines",
                    "route-mode",
                    "prefill/decode workers are reachable only through a router; set "
                    'route_mode = "SGLANG_ROUTER"',
                )
            )
        return out
    try:
        router_record(model, role, pm)
    except ConfigError as exc:
        return [ConfigProblem(exc.path, "router", exc.message)]
    return []


def router_record(model: ModelConfig, role: Any, pm: PluginManager) -> RouterBackend:
    """The router an ``SGLANG_ROUTER`` model uses: its ``router`` key, else the one installed
    router registered as the default (or the only installed one).

    :raises ConfigError: naming the key: no router plugin installed, an unknown or
        uninstalled router, a policy it lacks, a STATIC model, PD on a router without it.
    """
    where = model.path
    routers = pm.registered("routers")
    installed = {name: r.record for name, r in routers.items() if r.record.version is not None}
    mode_why = (
        f"route_mode {model.route_mode}"
        if model.route_mode
        else f"route_mode SGLANG_ROUTER (the {role.name} role's default)"
    )
    if not routers:
        raise ConfigError(
            f"{where}.route_mode",
            f"{mode_why} needs a router plugin, and none is installed; pip install relax-sglang "
            '(sglang-router and smg), or set route_mode = "DIRECT" to route this model like the '
            "static roles",
        )
    if model.router is not None:
        if model.router not in routers:
            raise ConfigError(
                f"{where}.router",
                f"no router {model.router!r} is registered (registered: "
                f"{', '.join(sorted(routers))}); install its plugin",
            )
        record: RouterBackend = routers[model.router].record
        if record.version is None:
            raise ConfigError(
                f"{where}.router",
                f"router {model.router!r} (plugin {routers[model.router].distribution}) is not "
                "installed; install it, or choose one of: "
                f"{', '.join(sorted(installed)) or 'none'}",
            )
    else:
        defaults = [r for r in installed.values() if r.default]
        choice = defaults if len(defaults) == 1 else list(installed.values())
        if len(choice) != 1:
            raise ConfigError(
                f"{where}.router",
                f"{mode_why} needs a router: name one (installed: "
                f"{', '.join(sorted(installed)) or 'none'})",
            )
        record = choice[0]
    policy = model.router_policy or record.default_policy
    if policy not in record.policies:
        raise ConfigError(
            f"{where}.router_policy",
            f"router {record.name!r} has no policy {policy!r}; it supports "
            f"{', '.join(sorted(record.policies))}",
        )
    source = pm.weight_source(model.weight_source or role.default_weight_source)
    if not source.update_paths:
        raise ConfigError(
            f"{where}.route_mode",
            f"a {source.name} model's engines are static and never registered with a router; "
            'set route_mode = "DIRECT"',
        )
    if model.pd_prefill_engines is not None and not record.pd:
        raise ConfigError(
            f"{where}.pd_prefill_engines",
            f"router {record.name!r} cannot route prefill/decode workers",
        )
    return record


def router_launch_spec(
    model: ModelConfig, record: RouterBackend, log_dir: str | None
) -> RouterLaunchSpec:
    """What ``record.launch`` gets for ``model``'s router (its log under ``log_dir``)."""
    log_path = None
    if log_dir:
        log_path = f"{log_dir}/{model.role}_{model.name}-router.log"
    return RouterLaunchSpec(
        router_id=model.path,
        policy=model.router_policy or record.default_policy,
        served_model_name=model.served_model_name or model.name,
        model_path=model.model_path or None,
        pd=model.pd_prefill_engines is not None,
        allow_dropped_fields=model.router_allow_dropped_fields,
        extra_args=model.router_args,
        log_path=log_path,
    )


def _start_router(model: ModelConfig, record: RouterBackend, log_dir: str | None) -> RouterProcess:
    return record.launch(router_launch_spec(model, record, log_dir))


class _EnginesHidden:
    """A publisher for a prefill/decode model: the model is published (state, router URL),
    its engines never are (PD workers are reachable only through the router)."""

    def __init__(self, publisher: RegistryPublisher) -> None:
        self._publisher = publisher

    def set_model(self, model_id: str, **fields: Any) -> None:
        self._publisher.set_model(model_id, **fields)

    def set_engine(self, model_id: str, engine_id: str, **fields: Any) -> None:
        """Publishes nothing: see the class docstring."""

    def remove_engine(self, model_id: str, engine_id: str) -> None:
        """Nothing was published: see the class docstring."""


def build_role_service(
    role: RoleConfig,
    *,
    plugin_manager: PluginManager,
    placements: Mapping[str, ReplicaPlacement],
    timeouts: ManagerTimeouts | None = None,
    log_dir: str | None = None,
) -> RoleService:
    """The role service of ``role``: one manager per model on ``placements[model]``.

    An ``SGLANG_ROUTER`` model's router is launched here (its process starts; it is made
    ready by :meth:`RoleService.start`), so its URL can be given to the manager.

    :raises ConfigError: a model asks for something ``relax serve`` cannot run (no usable
        router, a bad weight source), naming its key path; routers launched so far are
        stopped.
    """
    spec = plugin_manager.role(role.name)
    service = RoleService(
        role.name,
        routing_spec(role),
        weight_sources=plugin_manager.registered("weight_sources"),
        # The publisher re-checks what the role's record says about its weights.
        static_roles=(role.name,) if spec.static_weights else (),
    )
    try:
        for model in role.models:
            manager = _manager(
                model,
                plugin_manager,
                service,
                placement=placements[model.name],
                timeouts=timeouts,
                log_dir=log_dir,
            )
            service.add(model.name, manager, model_path=model.model_path or None)
    except BaseException:
        service.stop_routers()
        raise
    return service


def _manager(
    model: ModelConfig,
    pm: PluginManager,
    service: RoleService | None,
    *,
    placement: ReplicaPlacement,
    timeouts: ManagerTimeouts | None,
    log_dir: str | None,
) -> InferenceManager | ExternalEngines:
    """The manager of one model (:class:`ExternalEngines` for one served by external
    engines); given a ``service``, it publishes there and an ``SGLANG_ROUTER`` model's router
    is launched (without one, for dry runs, it is not)."""
    spec = pm.role(model.role)
    route_mode = model.route_mode or spec.default_route_mode
    # Built (and so checked) before a router starts.
    arguments = (
        None
        if model.external
        else manager_arguments(model, pm, placement=placement, timeouts=timeouts, log_dir=log_dir)
    )
    engine_spec = _engine_spec(model, pm) if arguments is None else arguments["spec"]
    router: RouterProcess | None = None
    publisher: Any = service.publisher if service is not None else None
    if route_mode != "DIRECT" and service is not None:
        router = _start_router(model, router_record(model, spec, pm), log_dir)
        service.routers[model.name] = router
        if model.pd_prefill_engines is not None:
            publisher = _EnginesHidden(service.publisher)
    if arguments is None:
        return ExternalEngines(
            model.name,
            urls=model.external_urls,
            spec=engine_spec,
            served_model_name=model.served_model_name or model.name,
            publisher=publisher,
            route_mode=route_mode,
            router_url=router.url if router is not None else None,
            router=router,
        )
    return InferenceManager(
        model.name,
        **arguments,
        publisher=publisher,
        router_url=router.url if router is not None else None,
        router=router,
    )


def _engine_spec(model: ModelConfig, pm: PluginManager) -> InferenceEngineSpec:
    spec = pm.role(model.role)
    source = pm.weight_source(model.weight_source or spec.default_weight_source)
    try:
        return InferenceEngineSpec.for_role(
            spec, source, weights_cpu_backup=bool(model.weights_cpu_backup)
        )
    except ValueError as exc:
        raise ConfigError(f"{model.path}.weight_source", str(exc)) from None


def manager_arguments(
    model: ModelConfig,
    pm: PluginManager,
    *,
    placement: ReplicaPlacement,
    timeouts: ManagerTimeouts | None = None,
    log_dir: str | None = None,
) -> dict[str, Any]:
    """The :class:`~relax_core.manager.InferenceManager` arguments of ``model`` (``spec``,
    ``backend``, ``launch``, ``placement``, ``route_mode``, ``timeouts``,
    ``unhealthy_after``) — what ``relax serve`` builds its managers from, and ``relax run``
    its manager actors; add ``publisher`` and, for a router, the router. Pure: starts nothing.

    :raises ConfigError: the weight source does not suit the role, naming the key.
    """
    spec = pm.role(model.role)
    return {
        "spec": _engine_spec(model, pm),
        "backend": pm.engine_backend(model.backend),
        "launch": _launch(
            model, log_dir, placement.nodes_per_replica, spec.deterministic_inference
        ),
        "placement": placement,
        "route_mode": model.route_mode or spec.default_route_mode,
        "timeouts": timeouts,
        "unhealthy_after": model.unhealthy_after,
    }


def engine_launch_specs(
    config: JobConfig, plugin_manager: PluginManager, *, dist_init_addr: str = "192.0.2.1:29500"
) -> dict[str, dict[str, list[Any]]]:
    """Model key path -> engine id -> the ``EngineLaunchSpec`` of each worker (head first):
    what ``relax serve`` would ask each engine backend to launch. Pure: starts nothing (no
    Ray, no router, no engine); for checks of the command lines a backend builds.

    A multi-node replica's workers join ``dist_init_addr`` (at start: the head worker's own).

    :raises PlacementError: the placement plan is invalid.
    :raises ConfigError: a model cannot be served.
    """
    from relax_core.placement import plan_inference_placement

    plan = plan_inference_placement(config, plugin_manager)
    out: dict[str, dict[str, list[Any]]] = {}
    for model in config.models():
        if model.external:
            continue
        # A CPU model's placement lists no bundles: one worker per replica.
        nodes = len(plan.model_placement(model.role, model.name).workers[0]) or 1
        manager = _manager(
            model,
            plugin_manager,
            None,
            placement=ReplicaPlacement.unplaced(model.num_engines, nodes),
            timeouts=None,
            log_dir=None,
        )
        assert isinstance(manager, InferenceManager)  # external models were skipped
        out[model.path] = manager.launch_specs(dist_init_addr=dist_init_addr)
    return out


def _launch(
    model: ModelConfig, log_dir: str | None, nodes: int, deterministic: bool
) -> ModelLaunch:
    options: dict[str, Any] = {
        "dp": model.dp,
        "dp_attention": model.dp_attention,
        "kv_cache_dtype": model.kv_cache_dtype,
        "deterministic_inference": (
            deterministic
            if model.deterministic_inference is None
            else model.deterministic_inference
        ),
    }
    for key in (
        "mem_fraction_static",
        "context_length",
        "max_running_requests",
        "pd_prefill_engines",
    ):
        if getattr(model, key) is not None:
            options[key] = getattr(model, key)
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
        options=options,
    )


# -- the job runner behind `relax serve` ---------------------------------------------------


class ServedJob:
    """What :func:`serve_job` brought up: role services, gateways and their URLs."""

    def __init__(self) -> None:
        self.services: dict[str, RoleService] = {}
        self.gateways: dict[str, RunningGateway] = {}
        self.bound: list[Any] = []
        self.registry: RegistryServer | None = None
        #: The placement plan the job was bound from.
        self.plan: Any = None
        #: Every engine pid seen (checked gone after shutdown).
        self.engine_pids: set[int] = set()
        #: Every router pid seen (checked gone after shutdown).
        self.router_pids: set[int] = set()
        #: The placement groups teardown kept (name -> why), because a worker on them may
        #: still hold its GPUs.
        self.kept_groups: dict[str, str] = {}

    @property
    def urls(self) -> dict[str, str]:
        """Role → gateway base URL (requests go to ``{url}/{role}/…``)."""
        return {role: gw.url for role, gw in self.gateways.items()}

    def pids(self) -> dict[str, list[int]]:
        """Engine id → engine process ids, over every role (recorded in :attr:`engine_pids`)."""
        out: dict[str, list[int]] = {}
        for service in self.services.values():
            engines = service.engine_pids()
            routers = service.router_pids()
            self.engine_pids.update(p for pids in engines.values() for p in pids)
            self.router_pids.update(p for pids in routers.values() for p in pids)
            out.update(engines)
            out.update(routers)
        return out

    def status(self) -> str:
        """A status table of every role, with engine pids."""
        pids = self.pids()
        return "\n".join(render_snapshot(s.snapshot(), pids=pids) for s in self.services.values())


def check_job(config: JobConfig, plugin_manager: PluginManager) -> list[str]:
    """Every reason ``config`` cannot be served (placement violations and servability), each
    as ``key.path: [rule] message``; empty when it can. Pure: starts nothing."""
    from relax_core.placement import preflight

    result = preflight(config, plugin_manager)
    problems = [str(v) for v in result.violations] if result.plan is None else []
    if result.plan is not None:
        problems += [str(p) for p in serve_phase_problems(config, result.plan)]
    return problems + [str(p) for p in servable_problems(config, plugin_manager)]


# -- phases: deferred roles start, then sleep; relax serve never wakes them -----------------


def _deferred(config: JobConfig) -> list[str]:
    names = {r.name for r in config.roles}
    return [r for r in config.placement.defer_roles if r in names]


def serve_phase_problems(config: JobConfig, plan: Any) -> list[ConfigProblem]:
    """The phases of ``plan`` that ``relax serve`` cannot keep apart, by key path.

    ``relax serve`` keeps every deferred role (``placement.defer_roles``) asleep after its
    start and every other role awake, so two roles that are not deferred, placed in different
    phases on overlapping bundles, would be resident at once: refused. Pure.
    """
    from relax_core.placement.plan import PHASE_RESIDENT

    deferred = set(_deferred(config))
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


def start_order(config: JobConfig, plan: Any) -> list[tuple[tuple[str, ...], bool]]:
    """The order ``relax serve`` starts roles in: ``(roles, sleep_after)`` steps.

    Each phase of deferred roles (in the plan's run order) starts on its own and is put to
    SLEEPING before the next one starts — phases sharing GPUs are never loaded together —, then
    every other role starts, awake. Without deferred roles: one step, everything at once.
    """
    deferred = _deferred(config)
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


def _placements(
    config: JobConfig, pm: PluginManager, job: ServedJob, *, detach_groups: bool = False
) -> dict[str, dict[str, ReplicaPlacement]]:
    """Plan, create and bind placement groups; each model's ReplicaPlacement by role.

    ``detach_groups``: create them detached, so a group whose engines are not confirmed gone at
    teardown outlives this process (on a cluster that outlives it); the teardown removes the
    others.
    """
    from relax_core.placement import plan_inference_placement

    job.plan = plan_inference_placement(config, pm)
    bound = bind_pools(job.plan, out=job.bound, detach=detach_groups)
    return replica_placements(config, job.plan, bound)


def bind_pools(plan: Any, *, out: list[Any] | None = None, detach: bool = False) -> dict[str, Any]:
    """Create and bind the placement group of every pool of ``plan`` (``relax-<pool>``);
    pool name -> ``BoundPool``. Each bound pool is appended to ``out`` as soon as it exists,
    so a caller can release what was made when a later one fails. ``detach``: the groups are
    detached (they outlive this process on a cluster that outlives it).

    :raises PlacementError: a pool's binding is invalid (its own group is removed).
    """
    from relax_core.placement import bind_placement_group

    bound = {}
    for pool in sorted({p.pool for p in plan.placements if p.pool is not None}):
        bound[pool] = bind_placement_group(
            plan, pool, name=f"relax-{pool}", lifetime="detached" if detach else None
        )
        if out is not None:
            out.append(bound[pool])
    return bound


def replica_placements(
    config: JobConfig, plan: Any, bound: Mapping[str, Any]
) -> dict[str, dict[str, ReplicaPlacement]]:
    """Role -> model -> the :class:`~relax_core.manager.ReplicaPlacement` of each model on the
    bound pools (a CPU model's: unplaced). Pure."""
    out: dict[str, dict[str, ReplicaPlacement]] = {}
    for role in config.roles:
        for model in role.models:
            mp = plan.model_placement(role.name, model.name)
            if mp.pool is None:
                placement = ReplicaPlacement.unplaced(model.num_engines)
            else:
                placement = ReplicaPlacement.from_bound(
                    bound[mp.pool],
                    role.name,
                    model.name,
                    ray_gpu_fraction=float(mp.ray_gpu_fraction) or 1.0,
                )
            out.setdefault(role.name, {})[model.name] = placement
    return out


def describe_job(config: JobConfig, pm: PluginManager) -> list[str]:
    """One line per model: backend, device, engines, weight source, route mode, gateway mode."""
    lines = []
    for role in config.roles:
        spec = pm.role(role.name)
        for m in role.models:
            size = f"{m.num_engines} engine{'s' if m.num_engines != 1 else ''}"
            if m.device != "cpu":
                size += f" x {m.gpus_per_engine} GPU"
            where = "Ray actor" if role.gateway.in_ray_actor else "thread"
            route = m.route_mode or spec.default_route_mode
            if route != "DIRECT":
                try:
                    record = router_record(m, spec, pm)
                    route += f" ({record.name}, {m.router_policy or record.default_policy})"
                except ConfigError as exc:
                    route += f" (no usable router: {exc.message})"
            what = f"{m.backend} on {m.engine_device}"
            if m.engine_device != m.device:
                what += f" (placed as {m.device})"
            if m.external:
                what = "external engines"
            lines.append(
                f"  {role.name}.{m.name}: {what}, {size}, weights "
                f"{m.weight_source or spec.default_weight_source}, route {route}, gateway in "
                f"a {where}"
            )
    return lines


def _report(role: str, model_id: str, result: Any, out: TextIO, began: float) -> None:
    at = f"[{time.monotonic() - began:5.1f}s]"
    if getattr(result, "ok", False):
        print(f"  {at} {role}.{model_id}: READY", file=out, flush=True)
    elif isinstance(result, BaseException):
        print(f"  {at} {role}.{model_id}: FAILED: {result}", file=out, flush=True)
    else:
        errors = "; ".join(f"{r.engine_id}: {r.error}" for r in result.failed)
        print(f"  {at} {role}.{model_id}: FAILED: {errors}", file=out, flush=True)


def _progress(
    job: ServedJob, config: JobConfig, out: TextIO, stop: threading.Event, began: float
) -> None:
    last = ""
    while True:
        parts = []
        for role in config.roles:
            try:
                models = job.services[role.name].snapshot().models
            except SnapshotError:
                models = {}  # no model has published yet
            for model in role.models:
                view = models.get(model.name)
                ready = sum(1 for e in view.engines if e.state.value == "READY") if view else 0
                state = view.state.value if view else "STARTING"
                parts.append(f"{role.name}.{model.name} {state} {ready}/{model.num_engines}")
        line = ", ".join(parts)
        if line != last:
            print(f"  [{time.monotonic() - began:5.1f}s] {line}", file=out, flush=True)
            last = line
        if stop.wait(1.0):
            return


def _health_event(role: str, out: TextIO) -> Callable[[str, Any], None]:
    def report(model_id: str, outcome: Any) -> None:
        stamp = time.strftime("%H:%M:%S")
        if isinstance(outcome, BaseException):
            print(f"{stamp} health {role}.{model_id}: {outcome}", file=out, flush=True)
            return
        for r in outcome.replicas:
            if not r.healthy:
                print(
                    f"{stamp} health {r.engine_id} ({role}): {'; '.join(r.problems)} → "
                    f"{r.action}, now {r.state}",
                    file=out,
                    flush=True,
                )

    return report


@contextlib.contextmanager
def serve_job(
    config: JobConfig,
    *,
    plugin_manager: PluginManager | None = None,
    token: str | None = None,
    out: TextIO = sys.stdout,
    log_dir: str | None = None,
    health_interval: float = 10.0,
    before_teardown: Callable[[], None] | None = None,
    detach_groups: bool = False,
) -> Iterator[ServedJob]:
    """Bring ``config``'s inference side up on the connected Ray; tear it all down on exit.

    ``health_interval``: seconds between health checks of every replica (0: no monitor).
    ``before_teardown`` is called first thing when the block ends (e.g. to hold signals).
    ``detach_groups``: create the placement groups detached (on a cluster that outlives this
    process), so the ones teardown must keep survive it.

    Teardown keeps every fence: a placement group with a worker whose cleanup is not confirmed
    (its actor died without confirmed cleanup of its engine, or its shutdown was not
    confirmed) is never released; the problems raised name it, the workers on it and what an
    operator must check (:attr:`ServedJob.kept_groups`).

    :raises PlacementError: the plan or the binding is invalid (nothing was started).
    :raises LifecycleError: engines did not become READY (everything started is shut down).
    """
    pm = plugin_manager or PluginManager.create()
    job = ServedJob()
    if log_dir is not None:
        import os

        os.makedirs(log_dir, exist_ok=True)
    hold = before_teardown or (lambda: None)
    failed = False
    try:
        placements = _placements(config, pm, job, detach_groups=detach_groups)
        for role in config.roles:
            job.services[role.name] = build_role_service(
                role, plugin_manager=pm, placements=placements[role.name], log_dir=log_dir
            )
        _start_engines(job, config, out, hold)
        job.pids()
        if health_interval > 0:
            for name, service in job.services.items():
                service.start_monitor(health_interval, on_report=_health_event(name, out))
        _start_gateways(job, config, pm, token)
        yield job
    except KeyboardInterrupt:
        raise  # an asked-for stop: a shutdown that leaves problems still raises below
    except BaseException:
        failed = True
        raise
    finally:
        hold()
        problems = _teardown(job, out)
        if problems:
            message = "shutdown left problems:\n  " + "\n  ".join(problems)
            if not failed:
                raise LifecycleError(message)
            print(message, file=out, flush=True)


def _start_engines(
    job: ServedJob, config: JobConfig, out: TextIO, hold: Callable[[], None]
) -> None:
    began = time.monotonic()
    stop = threading.Event()
    ticker = threading.Thread(
        target=_progress, args=(job, config, out, stop, began), daemon=True, name="progress"
    )
    ticker.start()
    steps = start_order(config, job.plan) if job.plan is not None else []
    if not steps:
        steps = [(tuple(job.services), False)]
    try:
        for roles, sleep in steps:
            if len(steps) > 1:
                names = ", ".join(f"{r}.{m}" for r in roles for m in job.services[r].managers)
                what = "deferred, put to sleep once started" if sleep else "awake"
                print(
                    f"  [{time.monotonic() - began:5.1f}s] starting {names} ({what})",
                    file=out,
                    flush=True,
                )
            _start_services([job.services[r] for r in roles], out, hold, began)
            if sleep:
                for role in roles:
                    _put_to_sleep(job.services[role], out, began)
    finally:
        stop.set()
        ticker.join()


def _start_services(
    services: list[RoleService], out: TextIO, hold: Callable[[], None], began: float
) -> None:
    errors: list[BaseException] = []

    def start(service: RoleService) -> None:
        try:
            service.start(
                on_done=lambda model_id, result: _report(service.role, model_id, result, out, began)
            )
        except BaseException as exc:
            errors.append(exc)

    starters = [
        threading.Thread(target=start, args=(s,), daemon=True, name=f"start-{s.role}")
        for s in services
    ]
    for t in starters:
        t.start()
    try:
        for t in starters:
            t.join()
    except KeyboardInterrupt:
        # A manager's shutdown() waits for its start() (one lock): let the starts finish.
        hold()
        print(
            "  interrupted: waiting for the engines being started, then shutting down …",
            file=out,
            flush=True,
        )
        for t in starters:
            t.join()
        raise
    if errors:
        raise errors[0]


def _put_to_sleep(service: RoleService, out: TextIO, began: float) -> None:
    """Offload every tag of a deferred role's models; each replica must confirm SLEEPING."""
    for model_id, manager in service.managers.items():
        result = manager.offload()
        wrong = {e: s for e, s in result.states.items() if s != "SLEEPING"}
        if wrong:
            raise LifecycleError(
                f"{service.role}.{model_id} could not be put to sleep after its start "
                f"({wrong}; {'; '.join(str(r.error) for r in result.failed)}); it shares GPUs "
                "with later phases, so nothing more is started"
            )
        print(
            f"  [{time.monotonic() - began:5.1f}s] {service.role}.{model_id}: SLEEPING "
            "(deferred: engine memory released, weights kept on the CPU; relax serve does not "
            "wake it, and its gateway answers 503 saying so)",
            file=out,
            flush=True,
        )


#: Why a deferred role's model sleeps under ``relax serve``, and what to do.
_SLEEPING_NOTE = (
    "relax serve started its role as deferred (placement.defer_roles) and keeps it asleep; "
    "only a coordinator (relax run) wakes a deferred role, for its phase. To serve it from "
    "relax serve, leave the role out of placement.defer_roles and give it GPUs of its own"
)


def _start_gateways(
    job: ServedJob, config: JobConfig, pm: PluginManager, token: str | None
) -> None:
    if any(role.gateway.in_ray_actor for role in config.roles):
        job.registry = RegistryServer(
            {name: service.snapshot for name, service in job.services.items()}
        ).start()
    for role in config.roles:
        service = job.services[role.name]
        # The same options whichever way the gateway runs. A deferred role sleeps for good
        # under relax serve: its gateway must not promise a wake-up.
        note = _SLEEPING_NOTE if role.name in _deferred(config) else None
        options = GatewayOptions(model_paths=service.model_paths, token=token, sleeping_note=note)
        host, port = role.gateway.host, role.gateway.port
        if role.gateway.in_ray_actor:
            assert job.registry is not None
            url = f"{job.registry.url}/{role.name}"
            gateway = start_actor_gateway(role.name, url, host=host, port=port, options=options)
        else:
            gateway = start_thread_gateway(
                role.name,
                service.snapshot,
                plugin_manager=pm,
                host=host,
                port=port,
                options=options,
            )
        job.gateways[role.name] = gateway


def _teardown(job: ServedJob, out: TextIO) -> list[str]:
    """Gateways, then engines and managers, then placement groups; return what was left."""
    problems: list[str] = []
    with contextlib.suppress(RelaxError):
        job.pids()
    for role, gw in job.gateways.items():
        try:
            gw.stop()
        except Exception as exc:
            problems.append(f"{role} gateway ({gw.mode}): {type(exc).__name__}: {exc}")
    if job.registry is not None:
        job.registry.stop()
    if job.gateways:
        print(f"  gateways stopped ({len(job.gateways)})", file=out, flush=True)
    for service in job.services.values():
        problems += service.shutdown()
    unconfirmed = [w for service in job.services.values() for w in service.unconfirmed_workers()]
    problems += _still_running(job.engine_pids, job.router_pids)
    if job.services:
        print(f"  engines stopped ({len(job.engine_pids)} processes)", file=out, flush=True)
    if job.router_pids:
        print(f"  routers stopped ({len(job.router_pids)})", file=out, flush=True)
    released = release_pools(job.bound, unconfirmed, kept=job.kept_groups, problems=problems)
    if job.bound:
        kept = f", {len(job.kept_groups)} kept" if job.kept_groups else ""
        print(f"  placement groups removed ({released}){kept}", file=out, flush=True)
    return problems


def release_pools(
    bound: list[Any],
    unconfirmed: list[UnconfirmedWorker],
    *,
    kept: dict[str, str],
    problems: list[str],
) -> int:
    """Release every bound pool but those an ``unconfirmed`` worker sits on (its engine may
    still hold the GPUs): each kept one goes into ``kept`` (name -> why) and ``problems``
    (what an operator checks), as does a release that failed. Returns the groups released."""
    from relax_core.placement import release_bound_pool

    released = 0
    for pool in bound:
        on_it = [w for w in unconfirmed if w.placement_group_id == _group_hex(pool)]
        if on_it:
            name = f"relax-{pool.pool}"
            kept[name] = "; ".join(w.describe() for w in on_it)
            problems.append(_kept_message(name, pool, on_it))
            continue
        try:
            released += release_bound_pool(pool)
        except RelaxError as exc:
            problems.append(str(exc))
    return released


def _group_hex(bound: Any) -> str | None:
    group = bound.placement_group
    return group.id.hex() if group is not None else None


def _kept_message(name: str, bound: Any, workers: list[Any]) -> str:
    """What an operator reads about a placement group teardown kept."""
    pids = sorted({w.engine_pid for w in workers if w.engine_pid is not None})
    nodes = sorted({w.node_ip for w in workers if w.node_ip})
    check = f"engine process(es) {pids}" if pids else "the engine processes"
    return (
        f"placement group {name!r} (pool {bound.pool!r}, id {_group_hex(bound)}) was KEPT, not "
        f"released: {'; '.join(w.describe() for w in workers)}. Its GPUs may still be held by a "
        f"stray engine. Check on node(s) {', '.join(nodes) or '(unknown)'} that {check} and "
        "their process groups are gone and the GPUs are free (nvidia-smi); then remove the "
        f"group (ray.util.remove_placement_group(ray.util.get_placement_group({name!r}))), or "
        "stop the Ray cluster. A local Ray that `relax serve` started stops with it, which "
        "releases the group anyway: check before starting the next job on that machine"
    )


def _pid_alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            state = f.read().rsplit(b")", 1)[1].split()[0]
    except (OSError, IndexError):
        import os

        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return False
        except PermissionError:
            return True
        return not sys.platform.startswith("linux")
    return state not in (b"Z", b"X")


def _still_running(engine_pids: set[int], router_pids: set[int]) -> list[str]:
    """Wait up to 15 s for these processes to end; a problem line for each kind still alive."""
    left = _wait_gone(engine_pids | router_pids, timeout=15.0)
    problems = []
    if left & engine_pids:
        problems.append(f"engine processes still running: {sorted(left & engine_pids)}")
    if left & router_pids:
        problems.append(f"router processes still running: {sorted(left & router_pids)}")
    return problems


def _wait_gone(pids: set[int], timeout: float) -> set[int]:
    deadline = time.monotonic() + timeout
    left = {p for p in pids if _pid_alive(p)}
    while left and time.monotonic() < deadline:
        time.sleep(0.1)
        left = {p for p in left if _pid_alive(p)}
    return left


@contextlib.contextmanager
def ray_session(address: str | None, config: JobConfig, out: TextIO = sys.stdout) -> Iterator[str]:
    """Connect to ``address``, or start a new local Ray declaring the config's GPUs (never
    an existing local cluster); yield a description; stop the Ray this call started."""
    import logging

    loaded = sys.modules.get("ray")
    connected = loaded is not None and loaded.is_initialized()
    gpus = config.cluster.total_gpus
    # Said before Ray is imported: its import and start are a newcomer's first 10-15 s.
    if not connected:
        doing = (
            f"connecting to the Ray cluster at {address}"
            if address
            else f"starting a new local Ray ({gpus} GPU{'s' if gpus != 1 else ''} declared)"
        )
        print(f"  {doing} …", file=out, flush=True)
    import ray

    started = not connected
    if connected:
        what = "the Ray this process is connected to"
    elif address:
        ray.init(address=address, log_to_driver=False, logging_level=logging.WARNING)
        what = f"the Ray cluster at {address}"
    else:
        from relax_core.net import keep_local_ray_on_loopback

        keep_local_ray_on_loopback()
        ray.init(
            address="local",
            num_gpus=gpus,
            include_dashboard=False,
            log_to_driver=False,
            logging_level=logging.WARNING,
        )
        what = f"a new local Ray ({gpus} GPUs declared)"
    try:
        yield what
    finally:
        if started:
            ray.shutdown()
            if not address:
                print("  local Ray stopped", file=out, flush=True)


class ShutdownSignals:
    """Ctrl-C and SIGTERM interrupt serving (KeyboardInterrupt); during shutdown they are
    held, because an interrupted shutdown would leave engines running."""

    def __init__(self, out: TextIO, *, command: str = "relax serve") -> None:
        self.out = out
        self.command = command
        self.holding = False

    def install(self) -> None:
        signal.signal(signal.SIGINT, self._handle)
        signal.signal(signal.SIGTERM, self._handle)

    def hold(self) -> None:
        self.holding = True

    def _handle(self, signum: int, frame: Any) -> None:
        if self.holding:
            print(f"{self.command}: still shutting down, please wait …", file=self.out, flush=True)
            return
        raise KeyboardInterrupt

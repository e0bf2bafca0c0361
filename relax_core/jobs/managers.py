"""Building a job's managers from its config, in this process (:func:`build_role_service`) or in
Ray actors (:func:`start_model_actor`), from the same :func:`manager_arguments`."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Required, TypedDict, Unpack

import attrs

from relax_core._proxy import actor_error_line
from relax_core.config import ConfigReader, JobConfig, ModelConfig, RoleConfig
from relax_core.discovery.publisher import RegistryPublisher
from relax_core.discovery.schema import RoutingSpec
from relax_core.engine.spec import InferenceEngineSpec
from relax_core.errors import ConfigError, LifecycleError
from relax_core.jobs.roles import RoleService
from relax_core.manager import InferenceManager, ManagerTimeouts, ModelLaunch, ReplicaPlacement
from relax_core.manager.actor import ManagerActor, manager_actor_name, start_manager_actor
from relax_core.manager.external import ExternalEngines
from relax_core.plugins import PluginManager
from relax_core.records import EngineBackend, RouterBackend, RouterLaunchSpec, RouterProcess


def routing_spec(role: RoleConfig) -> RoutingSpec:
    """The role's routing rules from its config: default model, route keys, aliases, policy."""
    return RoutingSpec(
        default_model=role.default_model or role.models[0].name,
        route_key_map={key: m.name for m in role.models for key in m.route_keys},
        aliases={alias: m.name for m in role.models for alias in m.aliases},
        policy=role.policy or "round_robin",
    )


def router_record(model: ModelConfig, role: Any, pm: PluginManager) -> RouterBackend:
    """The router an ``SGLANG_ROUTER`` model uses: its ``router`` key, else the installed
    default (or only) one. :raises ConfigError: naming the key."""
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
    name = model.router.name
    if name is not None:
        if name not in routers:
            raise ConfigError(
                f"{where}.router",
                f"no router {name!r} is registered (registered: "
                f"{', '.join(sorted(routers))}); install its plugin",
            )
        record: RouterBackend = routers[name].record
        if record.version is None:
            raise ConfigError(
                f"{where}.router",
                f"router {name!r} (plugin {routers[name].distribution}) is not "
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
    policy = model.router.policy or record.default_policy
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
    if model.engine.pd_prefill_engines is not None and not record.pd:
        raise ConfigError(
            f"{where}.pd_prefill_engines",
            f"router {record.name!r} cannot route prefill/decode workers",
        )
    return record


def router_launch_spec(
    model: ModelConfig, record: RouterBackend, log_dir: str | None
) -> RouterLaunchSpec:
    """What ``record.launch`` gets for ``model``'s router (its log under ``log_dir``)."""
    log_path = f"{log_dir}/{model.role}_{model.name}-router.log" if log_dir else None
    return RouterLaunchSpec(
        router_id=model.path,
        policy=model.router.policy or record.default_policy,
        served_model_name=model.served_model_name or model.name,
        model_path=model.model_path or None,
        pd=model.engine.pd_prefill_engines is not None,
        allow_dropped_fields=model.router.allow_dropped_fields,
        extra_args=model.router.args,
        log_path=log_path,
    )


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
    """The role service of ``role``: one manager per model on ``placements[model]``, an
    ``SGLANG_ROUTER`` model's router launched here.
    :raises ConfigError: a model cannot be served, naming its key (routers launched stop)."""
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
    model: ModelConfig, pm: PluginManager, service: RoleService, **settings: Unpack[ManagerSettings]
) -> InferenceManager | ExternalEngines:
    """The manager of one model (:class:`ExternalEngines` for one served by external
    engines), publishing to ``service``; an ``SGLANG_ROUTER`` model's router launched."""
    arguments = _arguments(model, pm, **settings)
    router: RouterProcess | None = None
    publisher: Any = service.publisher
    if arguments["route_mode"] != "DIRECT":
        record = router_record(model, pm.role(model.role), pm)
        router = record.launch(router_launch_spec(model, record, settings.get("log_dir")))
        service.routers[model.name] = router
        if model.engine.pd_prefill_engines is not None:
            publisher = _EnginesHidden(service.publisher)
    cls = ExternalEngines if model.external else InferenceManager
    router_url = router.url if router is not None else None
    return cls(model.name, **arguments, publisher=publisher, router_url=router_url, router=router)


def _arguments(
    model: ModelConfig, pm: PluginManager, **settings: Unpack[ManagerSettings]
) -> dict[str, Any]:
    """:func:`manager_arguments`, or an external model's :class:`ExternalEngines` arguments
    (of ``settings``, none is used)."""
    if not model.external:
        return manager_arguments(model, pm, **settings)
    return {
        "urls": model.external_urls,
        "spec": engine_spec(model, pm),
        "served_model_name": model.served_model_name or model.name,
        "route_mode": model.route_mode or pm.role(model.role).default_route_mode,
    }


def engine_spec(model: ModelConfig, pm: PluginManager) -> InferenceEngineSpec:
    """The capabilities of ``model``'s engines (its weight source and CPU backup decided)."""
    spec = pm.role(model.role)
    source = pm.weight_source(model.weight_source or spec.default_weight_source)
    try:
        return InferenceEngineSpec.for_role(
            spec,
            source,
            weights_cpu_backup=bool(model.engine.weights_cpu_backup),
            offload_weights=model.engine.offload_weights,
        )
    except ValueError as exc:
        raise ConfigError(f"{model.path}.weight_source", str(exc)) from None


class ManagerSettings(TypedDict, total=False):
    """Where and how a model's manager runs: its ``placement`` (required), the manager's
    ``timeouts`` and the engines' ``log_dir``."""

    placement: Required[ReplicaPlacement]
    timeouts: ManagerTimeouts | None
    log_dir: str | None


def manager_arguments(
    model: ModelConfig, pm: PluginManager, **settings: Unpack[ManagerSettings]
) -> dict[str, Any]:
    """The :class:`~relax_core.manager.InferenceManager` arguments of ``model``, but the
    ``publisher`` and the router. Pure.
    :raises ConfigError: a bad weight source or ``engine`` table, naming the key."""
    spec = pm.role(model.role)
    backend = pm.engine_backend(model.backend)
    reader = ConfigReader()
    options = backend_options(model, backend, reader)
    reader.raise_problems()
    engine = model.engine
    if engine.deterministic_inference is None:
        engine = attrs.evolve(engine, deterministic_inference=spec.deterministic_inference)
    launch = ModelLaunch(
        model_path=model.model_path,
        nodes_per_replica=settings["placement"].nodes_per_replica,
        served_model_name=model.served_model_name or model.name,
        tp=model.placement.tp,
        pp=model.placement.pp,
        device=model.device,
        seed=model.seed,
        log_dir=settings.get("log_dir"),
        options=engine,
        backend_options=options,
    )
    return {
        "spec": engine_spec(model, pm),
        "backend": backend,
        "launch": launch,
        "placement": settings["placement"],
        "route_mode": model.route_mode or spec.default_route_mode,
        "timeouts": settings.get("timeouts"),
        "unhealthy_after": model.health.unhealthy_after,
    }


def backend_options(
    model: ModelConfig, backend: EngineBackend, reader: ConfigReader
) -> object | None:
    """``backend``'s options record read from ``model``'s ``engine`` table; ``None`` for a
    backend without one, or after a problem (given to ``reader`` at its key path)."""
    path = f"{model.path}.engine"
    if backend.options is None:
        if model.engine_table:
            reader.problem(
                path,
                "engine-options",
                f"engine backend {backend.name!r} declares no options of its own, so its models "
                "take no engine table; drop the table (the engine server's own flags go in "
                "extra_args)",
            )
        return None
    return reader.record(model.engine_table, path, backend.options)


def engine_launch_specs(
    config: JobConfig, plugin_manager: PluginManager, *, dist_init_addr: str = "192.0.2.1:29500"
) -> dict[str, dict[str, list[Any]]]:
    """Model key path -> engine id -> the ``EngineLaunchSpec`` of each worker (head first)
    ``relax serve`` would launch (multi-node ones joining ``dist_init_addr``). Pure.
    :raises PlacementError, ConfigError: the plan is invalid, a model cannot be served."""
    from relax_core.placement import plan_inference_placement

    plan = plan_inference_placement(config, plugin_manager)
    out: dict[str, dict[str, list[Any]]] = {}
    for model in config.models():
        if model.external:
            continue
        # A CPU model's placement lists no bundles: one worker per replica.
        nodes = len(plan.model_placement(model.role, model.name).workers[0]) or 1
        placement = ReplicaPlacement.unplaced(model.placement.num_engines, nodes)
        manager = InferenceManager(
            model.name, **manager_arguments(model, plugin_manager, placement=placement)
        )
        out[model.path] = manager.launch_specs(dist_init_addr=dist_init_addr)
    return out


def start_model_actor(
    model: ModelConfig,
    pm: PluginManager,
    *,
    job: str,
    publisher: Any,
    actor_class: type[object] = ManagerActor,
    **settings: Unpack[ManagerSettings],
) -> Any:
    """Create ``model``'s named manager actor (an ``actor_class``) for job ``job`` (with its
    router, if any), publishing to ``publisher``; return the handle, not started. A model
    served by ``external_urls`` needs an ``actor_class`` whose manager is
    :class:`ExternalEngines`.
    :raises LifecycleError: the actor could not be built (the reason is its error's last line)."""
    import ray

    from relax_core.coordination.remote import NAMESPACE

    kwargs = _arguments(model, pm, **settings)
    if kwargs["route_mode"] != "DIRECT":
        record = router_record(model, pm.role(model.role), pm)
        spec = router_launch_spec(model, record, settings.get("log_dir"))
        kwargs.update(router_backend=record, router_spec=spec)
    try:
        return start_manager_actor(
            model.name,
            name=manager_actor_name(job, model.role, model.name),
            namespace=NAMESPACE,
            publisher=publisher,
            actor_class=actor_class,
            **kwargs,
        )
    except ray.exceptions.RayActorError as exc:
        what = "actor (external engines)" if model.external else "manager actor"
        raise LifecycleError(
            f"{model.path}: its {what} did not start: {actor_error_line(exc)}"
        ) from None


def describe_job(config: JobConfig, pm: PluginManager) -> list[str]:
    """One line per model: backend, device, engines, weight source, route mode, gateway mode."""
    lines = []
    for role in config.roles:
        spec = pm.role(role.name)
        for m in role.models:
            n = m.placement.num_engines
            size = f"{n} engine{'s' if n != 1 else ''}"
            if m.device != "cpu":
                size += f" x {m.placement.gpus_per_engine} GPU"
            where = "Ray actor" if role.gateway.in_ray_actor else "thread"
            route = m.route_mode or spec.default_route_mode
            if route != "DIRECT":
                try:
                    record = router_record(m, spec, pm)
                    route += f" ({record.name}, {m.router.policy or record.default_policy})"
                except ConfigError as exc:
                    route += f" (no usable router: {exc.message})"
            what = f"{m.backend} on {m.engine_device}"
            if m.engine_device != m.device:
                # e.g. engines told --device cpu on GPU bundles the job declares
                what += f" (--device {m.engine_device} in extra_args; on {m.device} bundles)"
            if m.external:
                what = "external engines"
            lines.append(
                f"  {role.name}.{m.name}: {what}, {size}, weights "
                f"{m.weight_source or spec.default_weight_source}, route {route}, gateway in "
                f"a {where}"
            )
    return lines

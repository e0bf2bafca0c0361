"""Loading plugins (the core's own, then the ``relax`` entry points) and collecting the records
they register."""

from __future__ import annotations

import importlib
import importlib.metadata
import os
import threading
from collections.abc import Callable, Iterable, Mapping
from types import ModuleType
from typing import Any, Generic, TypeVar, cast

import attrs
import pluggy

from relax_core import hookspecs
from relax_core.errors import PluginError
from relax_core.records import (
    BenchmarkSpec,
    CommandSpec,
    DataSourceSpec,
    EngineBackend,
    EnvironmentSpec,
    PlacementMode,
    RewardSpec,
    RoleSpec,
    RolloutShapeSpec,
    RouterBackend,
    RoutingPolicy,
    RunProbeSpec,
    StageSpec,
    TrackerSpec,
    TrainerSpec,
    WeightSource,
)

ENTRY_POINT_GROUP = "relax"
CORE_PLUGIN_NAME = "relax-core"
#: The module of the core's own plugin, loaded by name as pytest loads its default plugins: the
#: registry depends on no implementation it collects records from (they depend on it).
CORE_PLUGIN_MODULE = "relax_core.builtins"

R = TypeVar("R")

#: kind -> (record type, what one is called in messages); each kind's hook is
#: ``relax_register_<kind>``.
_RECORDS: Mapping[str, tuple[type[Any], str]] = {
    "roles": (RoleSpec, "role"),
    "engine_backends": (EngineBackend, "engine backend"),
    "weight_sources": (WeightSource, "weight source"),
    "reward_adapters": (RewardSpec, "reward adapter"),
    "routing_policies": (RoutingPolicy, "routing policy"),
    "placement_modes": (PlacementMode, "placement mode"),
    "routers": (RouterBackend, "router"),
    "data_sources": (DataSourceSpec, "data source"),
    "rollout_shapes": (RolloutShapeSpec, "rollout shape"),
    "environments": (EnvironmentSpec, "environment"),
    "stages": (StageSpec, "stage"),
    "trainers": (TrainerSpec, "trainer"),
    "trackers": (TrackerSpec, "tracker"),
    "run_probes": (RunProbeSpec, "run probe"),
    "benchmarks": (BenchmarkSpec, "benchmark"),
    "commands": (CommandSpec, "command"),
}
#: kind -> (hook name, record type)
KINDS: Mapping[str, tuple[str, type[Any]]] = {
    kind: (f"relax_register_{kind}", record) for kind, (record, _) in _RECORDS.items()
}
_SINGULAR = {kind: singular for kind, (_, singular) in _RECORDS.items()}


def _lookup(kind: str, record: type[R]) -> Callable[[PluginManager, str], R]:
    """The typed getter of one kind of :data:`KINDS` (``record``: its record type)."""

    def get(self: PluginManager, name: str) -> R:
        return cast(R, self._get(kind, name))

    get.__name__ = _SINGULAR[kind].replace(" ", "_")
    get.__qualname__ = f"PluginManager.{get.__name__}"
    get.__doc__ = (
        f"The {_SINGULAR[kind]} named ``name``; :class:`PluginError` if none is registered."
    )
    return get


@attrs.frozen
class Registered(Generic[R]):
    """A record with the plugin (entry-point name) and distribution that registered it."""

    record: R
    plugin: str
    distribution: str


def _duplicate_message(
    kind: str, name: str, first: Registered[Any], plugin: str, distribution: str
) -> str:
    """Why a record name taken twice stops every command, and the two ways to get going again:
    rename the record, or disable one of the plugins (the core cannot be disabled)."""
    disable = " or ".join(
        f"RELAX_DISABLE_PLUGINS={p}" for p in (first.plugin, plugin) if p != CORE_PLUGIN_NAME
    )
    what = _SINGULAR[kind]
    return (
        f"{what} name {name!r} is registered twice: by plugin {first.plugin!r} (distribution "
        f"{first.distribution!r}) and by plugin {plugin!r} (distribution {distribution!r}); "
        f"names are unique per kind, so Relax stops here. Rename the {what} in one of them, or "
        f"disable one plugin by its entry-point name: {disable}"
    )


def _env_list(name: str) -> frozenset[str] | None:
    raw = os.environ.get(name)
    if raw is None:
        return None
    return frozenset(part.strip() for part in raw.split(",") if part.strip())


class PluginManager:
    """A typed wrapper around pluggy for the ``relax`` project.

    Build one with :meth:`PluginManager.create`. Records are collected once, on first access,
    and cached; :meth:`reload` recollects them. Not thread-safe while loading; read-only after."""

    def __init__(self) -> None:
        self._pm = pluggy.PluginManager("relax")
        self._pm.add_hookspecs(hookspecs)
        self._dists: dict[str, str] = {}
        self._records: dict[str, dict[str, Registered[Any]]] | None = None
        self._lock = threading.Lock()

    # -- building ------------------------------------------------------------------------

    @classmethod
    def create(
        cls,
        *,
        entry_points: bool = True,
        builtins: bool = True,
        plugins: Iterable[tuple[str, object]] = (),
    ) -> PluginManager:
        """A plugin manager with the core's built-ins, the installed entry points and ``plugins``.

        :param entry_points: load the ``relax`` entry-point group.
        :param builtins: register the core's own records (weight sources, routing policies, …).
        :param plugins: extra ``(name, module_or_object)`` pairs, registered after the rest.
        :raises PluginError: a plugin failed to import, or an allow/block list names nothing."""
        pm = cls()
        if builtins:
            core = importlib.import_module(CORE_PLUGIN_MODULE)
            pm.register(core, name=CORE_PLUGIN_NAME, distribution=CORE_PLUGIN_NAME)
        if entry_points:
            pm.load_entry_points()
        for name, plugin in plugins:
            pm.register(plugin, name=name)
        return pm

    def register(self, plugin: object, *, name: str, distribution: str | None = None) -> None:
        """Register one plugin object under ``name`` and check its hooks are all known."""
        if self._pm.has_plugin(name):
            raise PluginError(
                f"two plugins are named {name!r} (distributions {self._dists.get(name)!r} and "
                f"{distribution!r}); uninstall one or disable it with RELAX_DISABLE_PLUGINS"
            )
        try:
            self._pm.register(plugin, name=name)
        except (ValueError, pluggy.PluginValidationError) as exc:
            raise PluginError(f"plugin {name!r} cannot be registered: {exc}") from exc
        self._dists[name] = distribution or name
        self._records = None
        try:
            self._pm.check_pending()
        except pluggy.PluginValidationError as exc:
            self._pm.unregister(name=name)
            raise PluginError(
                f"plugin {name!r} implements a hook Relax does not define: {exc}; "
                "hooks are listed in relax_core.hookspecs"
            ) from exc

    def load_entry_points(self) -> list[str]:
        """Load every ``relax`` entry point allowed by the environment; return their names.

        ``RELAX_LOAD_PLUGINS`` (comma-separated entry-point names) is an allow-list;
        ``RELAX_DISABLE_PLUGINS`` a block-list. A plugin that fails to import raises
        :class:`PluginError` naming it and its distribution."""
        allow = _env_list("RELAX_LOAD_PLUGINS")
        block = _env_list("RELAX_DISABLE_PLUGINS") or frozenset()
        found = sorted(
            importlib.metadata.entry_points(group=ENTRY_POINT_GROUP), key=lambda e: e.name
        )
        names = {ep.name for ep in found}
        for var, listed in (("RELAX_LOAD_PLUGINS", allow), ("RELAX_DISABLE_PLUGINS", block)):
            if unknown := (listed or frozenset()) - names:
                raise PluginError(
                    f"{var} names plugins that are not installed: {sorted(unknown)}; "
                    f"installed: {sorted(names)}"
                )
        loaded: list[str] = []
        for ep in found:
            if ep.name in block or (allow is not None and ep.name not in allow):
                continue
            dist = ep.dist.name if ep.dist is not None else "<unknown distribution>"
            try:
                plugin = ep.load()
            except Exception as exc:
                raise PluginError(
                    f"plugin {ep.name!r} (distribution {dist!r}, entry point {ep.value!r}) failed "
                    f"to load: {type(exc).__name__}: {exc}. Fix or uninstall it, or set "
                    f"RELAX_DISABLE_PLUGINS={ep.name}"
                ) from exc
            self.register(plugin, name=ep.name, distribution=dist)
            loaded.append(ep.name)
        return loaded

    # -- records -------------------------------------------------------------------------

    def _collect(self) -> dict[str, dict[str, Registered[Any]]]:
        with self._lock:
            if self._records is not None:
                return self._records
            self._records = {kind: self._collect_kind(kind, *how) for kind, how in KINDS.items()}
            return self._records

    def _collect_kind(
        self, kind: str, hook_name: str, record_type: type[Any]
    ) -> dict[str, Registered[Any]]:
        out: dict[str, Registered[Any]] = {}
        hook = getattr(self._pm.hook, hook_name)
        for impl in hook.get_hookimpls():
            plugin_name = self._pm.get_name(impl.plugin) or repr(impl.plugin)

            def register(record: object, _plugin: str = plugin_name) -> None:
                if not isinstance(record, record_type):
                    raise PluginError(
                        f"plugin {_plugin!r} passed {type(record).__name__} to the {kind} "
                        f"register callback; expected {record_type.__name__}"
                    )
                name = record.name  # type: ignore[attr-defined]
                dist = self._dists.get(_plugin, _plugin)
                if name in out:
                    raise PluginError(_duplicate_message(kind, name, out[name], _plugin, dist))
                out[name] = Registered(record, _plugin, dist)

            try:
                impl.function(**{arg: register for arg in impl.argnames})
            except PluginError:
                raise
            except Exception as exc:
                raise PluginError(
                    f"plugin {plugin_name!r} failed in {hook_name}: {type(exc).__name__}: {exc}"
                ) from exc
        return out

    def registered(self, kind: str) -> Mapping[str, Registered[Any]]:
        """Every record of ``kind`` (a key of :data:`KINDS`) with its owner, by name."""
        if kind not in KINDS:
            raise KeyError(f"unknown record kind {kind!r}; known: {sorted(KINDS)}")
        return self._collect()[kind]

    def _get(self, kind: str, name: str) -> Any:
        table = self.registered(kind)
        try:
            return table[name].record
        except KeyError:
            raise PluginError(
                f"no {_SINGULAR[kind]} named {name!r} is registered; known: "
                f"{sorted(table)}. Is the plugin that provides it installed and enabled?"
            ) from None

    # One typed getter per kind: ``pm.role("genrm")`` is the role named ``genrm``;
    # :class:`PluginError` (naming the known ones) if none is registered.
    role = _lookup("roles", RoleSpec)
    engine_backend = _lookup("engine_backends", EngineBackend)
    weight_source = _lookup("weight_sources", WeightSource)
    reward_adapter = _lookup("reward_adapters", RewardSpec)
    routing_policy = _lookup("routing_policies", RoutingPolicy)
    placement_mode = _lookup("placement_modes", PlacementMode)
    router = _lookup("routers", RouterBackend)
    data_source = _lookup("data_sources", DataSourceSpec)
    rollout_shape = _lookup("rollout_shapes", RolloutShapeSpec)
    environment = _lookup("environments", EnvironmentSpec)
    stage = _lookup("stages", StageSpec)
    trainer = _lookup("trainers", TrainerSpec)
    tracker = _lookup("trackers", TrackerSpec)
    run_probe = _lookup("run_probes", RunProbeSpec)
    benchmark = _lookup("benchmarks", BenchmarkSpec)
    command = _lookup("commands", CommandSpec)

    def plugin_names(self) -> list[str]:
        """Names of every registered plugin, the core's first."""
        return [name for name, _ in self._pm.list_name_plugin()]


_default: PluginManager | None = None
_default_lock = threading.Lock()


def get_plugin_manager() -> PluginManager:
    """The process-wide plugin manager (built on first use). Tests build their own instead."""
    global _default
    with _default_lock:
        if _default is None:
            _default = PluginManager.create()
        return _default


def module_plugin(name: str, **hooks: Callable[..., None]) -> ModuleType:
    """Build a plugin module from keyword hook functions (handy in tests and notebooks)."""
    mod = ModuleType(name)
    for hook_name, fn in hooks.items():
        setattr(mod, hook_name, hookspecs.hookimpl(fn))
    return mod

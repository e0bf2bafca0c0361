"""Discovery schema 2: the routing snapshot of one inference role (its models, their state, how to
reach them and the routing rules), a frozen value validated however it is built: a broken rule
raises :class:`~relax_core.errors.SnapshotError` whose ``path`` names the JSON field."""

from __future__ import annotations

import enum
import json
from collections.abc import Callable, Collection, Mapping
from typing import TYPE_CHECKING, Any, TypeAlias, TypeVar

import attrs

from relax_core.discovery._fields import (
    Validator,
    build_at,
    check_bool,
    check_id,
    check_int,
    check_str,
    check_url,
    child_path,
    frozen_map,
    object_fields,
    segment,
    to_enum,
    to_tuple,
    validator,
)
from relax_core.errors import SnapshotError
from relax_core.records import NAME_PATTERN, RouteMode, WeightSource

if TYPE_CHECKING:
    from relax_core.plugins import PluginManager

SCHEMA_VERSION = 2

#: Weight-source names a snapshot may use when no plugin manager or set is given.
BUILTIN_WEIGHT_SOURCES: frozenset[str] = frozenset({"STATIC", "ACTOR", "DCS"})

T = TypeVar("T")


class ModelState(enum.StrEnum):
    """The state of a model, and of each of its logical replica heads, as the manager publishes it.

    Only a READY model receives requests, and only on its READY heads: weights, KV cache and
    CUDA graph resident, the weights valid and admission open."""

    READY = "READY"
    STARTING = "STARTING"
    DRAINING = "DRAINING"
    SLEEPING = "SLEEPING"
    ONLOADING = "ONLOADING"
    FAILED = "FAILED"
    STOPPING = "STOPPING"
    UNKNOWN = "UNKNOWN"


def _model_state(value: object) -> ModelState:
    return to_enum(ModelState, "state", value)


def _route_mode(value: object) -> RouteMode:
    return to_enum(RouteMode, "route_mode", value)


def _check_name(field: str, value: object, what: str) -> str:
    name = check_str(field, value)
    if not NAME_PATTERN.match(name):
        raise SnapshotError(field, f"{name!r} is not a {what} name")
    return name


def _check_version(_i: Any, _a: Any, value: object) -> None:
    if value != SCHEMA_VERSION or isinstance(value, bool):
        raise SnapshotError(
            "schema_version",
            f"expected {SCHEMA_VERSION}, got {value!r}; this reader understands schema 2 "
            "only (ask for /engines?schema=2)",
        )


def _check_routing(_i: Any, _a: Any, value: Any) -> None:
    if not isinstance(value, RoutingSpec):
        raise SnapshotError("routing", f"must be a RoutingSpec, got {type(value).__name__}")


def _plain(value: object) -> object:
    return value.value if isinstance(value, enum.Enum) else value


@attrs.frozen
class EngineView:
    """One logical replica head of a model.

    ``base_url`` is the head's public (admission) URL, ``None`` while it has none; a FAILED
    head never publishes one. ``direct_eligible`` may only be true for a READY head with a URL.
    ``generation`` moves whenever the head's worker or endpoint is replaced.
    ``weight_version``: the version this head serves (versioned weight sources only; absent
    from the JSON when ``None``)."""

    engine_id: str = attrs.field(validator=validator(check_id, "engine_id", "engine id"))
    base_url: str | None = attrs.field(validator=validator(check_url, "base_url"))
    state: ModelState = attrs.field(converter=_model_state)
    direct_eligible: bool = attrs.field(validator=validator(check_bool, "direct_eligible"))
    generation: int = attrs.field(validator=validator(check_int, "generation"))
    weight_version: str | None = attrs.field(
        default=None, validator=attrs.validators.optional(validator(check_str, "weight_version"))
    )

    def __attrs_post_init__(self) -> None:
        if self.direct_eligible and self.state is not ModelState.READY:
            raise SnapshotError(
                "direct_eligible",
                f"engine {self.engine_id!r} is {self.state.value}; only a READY engine may be "
                "direct_eligible",
            )
        if self.direct_eligible and self.base_url is None:
            raise SnapshotError(
                "direct_eligible",
                f"engine {self.engine_id!r} has no base_url; only an engine with a URL may be "
                "direct_eligible",
            )
        if self.state is ModelState.FAILED and self.base_url is not None:
            raise SnapshotError(
                "base_url",
                f"engine {self.engine_id!r} is FAILED; a FAILED engine never publishes a URL "
                "(publish null)",
            )

    def to_json(self) -> dict[str, Any]:
        """The engine as a JSON object (``weight_version`` only when it has one)."""
        out = {name: _plain(getattr(self, name)) for name in _ENGINE_FIELDS}
        if self.weight_version is not None:
            out["weight_version"] = self.weight_version
        return out


def _check_engines(_i: Any, _a: Any, engines: Any) -> None:
    seen: dict[str, int] = {}
    for index, engine in enumerate(engines):
        if not isinstance(engine, EngineView):
            raise SnapshotError(
                f"engines[{index}]", f"must be an EngineView, got {type(engine).__name__}"
            )
        if engine.engine_id in seen:
            raise SnapshotError(
                f"engines[{index}].engine_id",
                f"engine id {engine.engine_id!r} is already used by "
                f"engines[{seen[engine.engine_id]}]; engine ids are unique within a model",
            )
        seen[engine.engine_id] = index


@attrs.frozen
class ModelView:
    """One model of a role: its state, route mode, weights and replica heads.

    A READY ``SGLANG_ROUTER`` model has a ``router_url``; a ``DIRECT`` model has none. A STATIC
    model carries no ``weight_version``."""

    state: ModelState = attrs.field(converter=_model_state)
    route_mode: RouteMode = attrs.field(converter=_route_mode)
    router_url: str | None = attrs.field(validator=validator(check_url, "router_url"))
    weight_source: str = attrs.field(
        validator=validator(_check_name, "weight_source", "weight-source")
    )
    weight_version: str | None = attrs.field(
        validator=attrs.validators.optional(validator(check_str, "weight_version"))
    )
    served_model_name: str = attrs.field(validator=validator(check_str, "served_model_name"))
    engines: tuple[EngineView, ...] = attrs.field(
        default=(), converter=to_tuple, validator=_check_engines
    )

    def __attrs_post_init__(self) -> None:
        if self.weight_source == "STATIC":
            if self.weight_version is not None:
                raise SnapshotError(
                    "weight_version",
                    f"a STATIC model never carries a weight_version (got {self.weight_version!r})"
                    "; publish null or use a versioned weight source (ACTOR, DCS)",
                )
            for index, engine in enumerate(self.engines):
                if engine.weight_version is not None:
                    raise SnapshotError(
                        f"engines[{index}].weight_version",
                        f"engine {engine.engine_id!r} of a STATIC model carries a weight_version "
                        f"({engine.weight_version!r}); STATIC heads publish none (omit it)",
                    )
        if self.route_mode is RouteMode.DIRECT and self.router_url is not None:
            raise SnapshotError(
                "router_url",
                "a DIRECT model has no router_url; publish null or set route_mode SGLANG_ROUTER",
            )
        if (
            self.route_mode is RouteMode.SGLANG_ROUTER
            and self.state is ModelState.READY
            and self.router_url is None
        ):
            raise SnapshotError(
                "router_url", "a READY SGLANG_ROUTER model must publish its router_url"
            )

    def to_json(self) -> dict[str, Any]:
        """The model as a JSON object."""
        out = {name: _plain(getattr(self, name)) for name in _MODEL_FIELDS}
        out["engines"] = [engine.to_json() for engine in self.engines]
        return out


def _check_str_map(field: str) -> Validator:
    def check(_i: Any, _a: Any, value: Any) -> None:
        if not isinstance(value, Mapping):
            raise SnapshotError(field, f"must be an object, got {type(value).__name__}")
        for key, target in value.items():
            if not isinstance(key, str) or not key:
                raise SnapshotError(field, f"keys must be non-empty strings, got {key!r}")
            check_str(field + segment(key), target)

    return check


@attrs.frozen
class RoutingSpec:
    """How a role picks a model: by explicit model id or alias, by route key, else the default.

    ``policy`` names the DIRECT replica-selection policy (a registered
    :class:`~relax_core.records.RoutingPolicy`); ``policy_revision`` moves when its settings do.
    Every target must be a model id of the snapshot (checked by :class:`RoleSnapshot`)."""

    default_model: str | None = attrs.field(
        default=None, validator=attrs.validators.optional(validator(check_str, "default_model"))
    )
    route_key_map: Mapping[str, str] = attrs.field(
        factory=dict, converter=frozen_map, validator=_check_str_map("route_key_map")
    )
    aliases: Mapping[str, str] = attrs.field(
        factory=dict, converter=frozen_map, validator=_check_str_map("aliases")
    )
    policy: str = attrs.field(
        default="round_robin", validator=validator(_check_name, "policy", "routing-policy")
    )
    policy_revision: int = attrs.field(default=0, validator=validator(check_int, "policy_revision"))

    def __reduce__(self) -> tuple[Any, ...]:
        # Mapping proxies do not pickle; rebuild (and re-validate) from plain dicts.
        return (_rebuild, (RoutingSpec, self.to_json()))

    def to_json(self) -> dict[str, Any]:
        """The routing spec as a JSON object."""
        out = {name: getattr(self, name) for name in _ROUTING_FIELDS}
        out["route_key_map"], out["aliases"] = dict(self.route_key_map), dict(self.aliases)
        return out


#: What ``weight_sources=`` accepts: names, ``{name: WeightSource}`` or a plugin manager.
WeightSources: TypeAlias = "Collection[str] | Mapping[str, WeightSource] | PluginManager"


def _source_records(
    weight_sources: WeightSources | None,
) -> tuple[frozenset[str], Mapping[str, WeightSource]]:
    if weight_sources is None:
        return BUILTIN_WEIGHT_SOURCES, {}
    registered = getattr(weight_sources, "registered", None)
    if callable(registered):
        records = {name: reg.record for name, reg in registered("weight_sources").items()}
        return frozenset(records), records
    if isinstance(weight_sources, Mapping):
        records = {n: r for n, r in weight_sources.items() if isinstance(r, WeightSource)}
        return frozenset(weight_sources), records
    return frozenset(str(name) for name in weight_sources), {}  # type: ignore[union-attr]


def _static_roles(
    static_roles: Collection[str] | None, weight_sources: WeightSources | None
) -> frozenset[str]:
    """The roles whose models must be STATIC: as given, else those a plugin manager's role
    records declare STATIC-only (``RoleSpec.static_weights``), else none."""
    if static_roles is not None:
        return frozenset(static_roles)
    registered = getattr(weight_sources, "registered", None)
    if not callable(registered):
        return frozenset()
    return frozenset(name for name, reg in registered("roles").items() if reg.record.static_weights)


def check_model_sources(
    role: str,
    model_id: str,
    model: ModelView,
    *,
    weight_sources: WeightSources | None = None,
    static_roles: Collection[str] | None = None,
) -> None:
    """Check one model's weight source as :meth:`RoleSnapshot.check_sources` does.

    :raises SnapshotError: naming ``models.<model_id>.weight_source`` or ``.weight_version``."""
    names, records = _source_records(weight_sources)
    static = role in _static_roles(static_roles, weight_sources)
    path = "models" + segment(model_id)
    source = model.weight_source
    if source not in names:
        raise SnapshotError(
            f"{path}.weight_source",
            f"unknown weight source {source!r}; known: {', '.join(sorted(names))}. Install the "
            "plugin that registers it",
        )
    if static and source != "STATIC":
        raise SnapshotError(
            f"{path}.weight_source",
            f"a {role} model must be STATIC, got {source!r}; {role} weights are fixed checkpoints",
        )
    record = records.get(source)
    if record is None:
        return
    if source == "STATIC" and record.update_paths:
        raise SnapshotError(
            f"{path}.weight_source",
            f"the registered STATIC weight source allows updates {sorted(record.update_paths)}; "
            "STATIC must refuse every update path",
        )
    if static and record.update_paths:
        raise SnapshotError(
            f"{path}.weight_source",
            f"a {role} model's weight source must not allow updates, {source!r} allows "
            f"{sorted(record.update_paths)}",
        )
    if not record.publishes_version and model.weight_version is not None:
        raise SnapshotError(
            f"{path}.weight_version",
            f"weight source {source!r} does not publish a version; publish null",
        )


def _check_models(_i: Any, _a: Any, value: Any) -> None:
    if not isinstance(value, Mapping):
        raise SnapshotError("models", f"must be an object, got {type(value).__name__}")
    for model_id, model in value.items():
        path = "models" + segment(model_id) if isinstance(model_id, str) else "models"
        check_id(path, model_id, "model id")
        if not isinstance(model, ModelView):
            raise SnapshotError(path, f"must be a ModelView, got {type(model).__name__}")


@attrs.frozen(kw_only=True)
class RoleSnapshot:
    """The schema-2 snapshot of one role (see the module docstring).

    ``registry_epoch`` identifies the publishing registry's incarnation; ``topology_revision``
    moves on every published change within an epoch. Rules that depend on installed plugins
    are checked by :meth:`check_sources`, which :meth:`from_json` and the registry call."""

    schema_version: int = attrs.field(default=SCHEMA_VERSION, validator=_check_version)
    role: str = attrs.field(validator=validator(_check_name, "role", "role"))
    registry_epoch: str = attrs.field(validator=validator(check_str, "registry_epoch"))
    topology_revision: int = attrs.field(validator=validator(check_int, "topology_revision"))
    routing: RoutingSpec = attrs.field(validator=_check_routing)
    models: Mapping[str, ModelView] = attrs.field(converter=frozen_map, validator=_check_models)
    # Values derived from this immutable snapshot (routing indexes); not part of its value.
    _derived: dict[str, Any] = attrs.field(
        init=False, factory=dict, eq=False, repr=False, hash=False
    )

    def __attrs_post_init__(self) -> None:
        known = ", ".join(sorted(self.models)) or "(none)"
        routing = self.routing
        if routing.default_model is not None and routing.default_model not in self.models:
            raise SnapshotError(
                "routing.default_model",
                f"{routing.default_model!r} is not a model of role {self.role!r}; "
                f"known models: {known}",
            )
        tables = (("route_key_map", "route key", "maps to"), ("aliases", "alias", "points to"))
        for table, what, verb in tables:
            for key, target in getattr(routing, table).items():
                path = f"routing.{table}{segment(key)}"
                if table == "aliases" and key in self.models:
                    raise SnapshotError(path, f"alias {key!r} shadows a model id; rename the alias")
                if target not in self.models:
                    raise SnapshotError(
                        path,
                        f"{what} {key!r} {verb} {target!r}, which is not a model; "
                        f"known models: {known}",
                    )

    def __reduce__(self) -> tuple[Any, ...]:
        # Mapping proxies do not pickle; the derived cache is not worth sending.
        fields = {name: getattr(self, name) for name in _TOP_FIELDS}
        return (_rebuild, (RoleSnapshot, {**fields, "models": dict(self.models)}))

    def derived(self, key: str, build: Callable[[RoleSnapshot], T]) -> T:
        """A value computed once from this snapshot and cached on it (e.g. a routing index).

        ``build(self)`` runs on the first call for ``key``; safe to race (both results equal)."""
        if key not in self._derived:
            self._derived[key] = build(self)
        return self._derived[key]  # type: ignore[no-any-return]

    def check_sources(
        self,
        *,
        weight_sources: WeightSources | None = None,
        static_roles: Collection[str] | None = None,
    ) -> None:
        """Check every model's weight source against the installed ones and the role's rules.

        :param weight_sources: names, ``{name: WeightSource}`` records (then also checked: a
            version only from a source that publishes one, no update path in a STATIC role) or
            a plugin manager; default :data:`BUILTIN_WEIGHT_SOURCES`.
        :param static_roles: roles whose models must be STATIC; default: the STATIC-only roles
            of a plugin manager, else none.
        :raises SnapshotError: naming ``models.<id>.weight_source`` or ``.weight_version``."""
        for model_id, model in self.models.items():
            check_model_sources(
                self.role, model_id, model, weight_sources=weight_sources, static_roles=static_roles
            )

    @classmethod
    def from_json(
        cls,
        data: Mapping[str, Any] | str | bytes,
        *,
        weight_sources: WeightSources | None = None,
        static_roles: Collection[str] | None = None,
    ) -> RoleSnapshot:
        """Parse and validate a schema-2 snapshot (a decoded JSON object, or JSON text).

        :raises SnapshotError: ``path`` names the offending field, the message the rule."""
        if isinstance(data, (str, bytes)):
            try:
                data = json.loads(data)
            except ValueError as exc:
                raise SnapshotError("", f"snapshot is not valid JSON: {exc}") from None
        snapshot = _parse(data)
        snapshot.check_sources(weight_sources=weight_sources, static_roles=static_roles)
        return snapshot

    def to_json(self) -> dict[str, Any]:
        """The snapshot as a JSON-ready dict; ``from_json(s.to_json()) == s``."""
        out = {name: getattr(self, name) for name in _TOP_FIELDS}
        out["routing"] = self.routing.to_json()
        out["models"] = {model_id: model.to_json() for model_id, model in self.models.items()}
        return out

    def schema1(self) -> dict[str, Any]:
        """The schema-1 diagnostic view: rank, status and URL of every regular replica head.

        Ranks are stable: the head numbered ``i`` (its engine id's trailing number, else its
        position) of the model at position ``p`` among ``n`` models has rank ``i * n + p``.
        For old consumers (autoscalers, dashboards); never used for routing."""
        models = list(self.models.values())
        count = len(models)
        ranked: list[tuple[int, EngineView]] = []
        for position, model in enumerate(models):
            digits = [e.engine_id[len(e.engine_id.rstrip("0123456789")) :] for e in model.engines]
            numbers = [int(d) for d in digits if d]
            if len(numbers) != len(digits) or len(set(numbers)) != len(numbers):
                numbers = list(range(len(model.engines)))
            ranked += [
                (n * count + position, e) for n, e in zip(numbers, model.engines, strict=True)
            ]
        ranked.sort(key=lambda item: item[0])
        engines = [{"rank": rank, "status": e.state.value, "url": e.base_url} for rank, e in ranked]
        return {"engines": engines}


def _rebuild(cls: Callable[..., T], fields: dict[str, Any]) -> T:
    """Unpickle a record whose ``__reduce__`` gives its fields as plain values."""
    return cls(**fields)


def _names(cls: type) -> tuple[str, ...]:
    return tuple(f.name for f in attrs.fields(cls) if f.init)


_TOP_FIELDS, _ROUTING_FIELDS, _MODEL_FIELDS = map(_names, (RoleSnapshot, RoutingSpec, ModelView))
#: Engine fields a snapshot may leave out (added to schema 2 later; absent means null).
_ENGINE_OPTIONAL = ("weight_version",)
_ENGINE_FIELDS = tuple(n for n in _names(EngineView) if n not in _ENGINE_OPTIONAL)


def _parse_model(path: str, data: object) -> ModelView:
    fields = object_fields(data, path, _MODEL_FIELDS)
    raw_engines = fields["engines"]
    if not isinstance(raw_engines, (list, tuple)):
        raise SnapshotError(
            f"{path}.engines", f"must be a JSON array, got {type(raw_engines).__name__}"
        )
    engines = []
    for index, raw in enumerate(raw_engines):
        engine_path = f"{path}.engines[{index}]"
        engine = object_fields(raw, engine_path, _ENGINE_FIELDS, _ENGINE_OPTIONAL)
        engines.append(build_at(engine_path, EngineView, **engine))
    return build_at(path, ModelView, **{**fields, "engines": tuple(engines)})


def _parse(data: object) -> RoleSnapshot:
    if isinstance(data, Mapping) and "schema_version" in data:
        _check_version(None, None, data["schema_version"])
    top = object_fields(data, "", _TOP_FIELDS)
    routing = build_at(
        "routing", RoutingSpec, **object_fields(top["routing"], "routing", _ROUTING_FIELDS)
    )
    raw_models = top["models"]
    if not isinstance(raw_models, Mapping):
        raise SnapshotError("models", f"must be a JSON object, got {type(raw_models).__name__}")
    models = {}
    for model_id, raw in raw_models.items():
        path = child_path("models", str(model_id))
        check_id(path, model_id, "model id")
        models[model_id] = _parse_model(path, raw)
    return build_at("", RoleSnapshot, **{**top, "routing": routing, "models": models})

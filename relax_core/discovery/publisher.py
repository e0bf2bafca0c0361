"""The registry publisher: the mutable side of a role's schema-2 snapshot, checking each change
where it enters (its rules are docs/discovery-and-routing.md's)."""

from __future__ import annotations

import threading
import uuid
from collections.abc import Collection
from typing import Any, Final

import attrs

from relax_core.discovery._fields import build_at, to_enum
from relax_core.discovery.schema import (
    EngineView,
    ModelState,
    ModelView,
    RoleSnapshot,
    RoutingSpec,
    WeightSources,
    check_model_sources,
)
from relax_core.errors import SnapshotError
from relax_core.records import RouteMode


def _routing(routing: object) -> RoutingSpec:
    if not isinstance(routing, RoutingSpec):
        raise SnapshotError("routing", f"must be a RoutingSpec, got {type(routing).__name__}")
    return routing


@attrs.define
class _Engine:
    endpoint: str | None  # as the manager reported it; published only when not FAILED
    state: ModelState
    direct_eligible: bool | None  # None: READY and a URL
    generation: int
    view: EngineView
    weight_version: str | None = None


@attrs.define
class _Model:
    view: ModelView  # engines are filled in when a snapshot is built
    engines: dict[str, _Engine] = attrs.field(factory=dict)


def _engine_view(
    engine_id: str,
    endpoint: str | None,
    state: ModelState,
    eligible: bool | None,
    gen: int,
    weight_version: str | None = None,
) -> EngineView:
    url = None if state is ModelState.FAILED else endpoint
    if eligible is None:
        eligible = state is ModelState.READY and url is not None
    return EngineView(engine_id, url, state, eligible, gen, weight_version)


class RegistryPublisher:
    """Holds one role's models and publishes its schema-2 snapshots.

    :param routing: the role's routing spec (its targets must exist when a snapshot is taken).
    :param epoch: the registry epoch; default a fresh ``<role>-<random hex>``.
    :param weight_sources, static_roles: as :meth:`RoleSnapshot.check_sources` takes them.

    ``role`` and ``epoch`` are fixed for its life. Thread-safe: every method takes one lock.
    :meth:`snapshot` returns the cached object when nothing changed."""

    def __init__(
        self,
        role: str,
        routing: RoutingSpec,
        *,
        epoch: str | None = None,
        weight_sources: WeightSources | None = None,
        static_roles: Collection[str] | None = None,
    ) -> None:
        self.role: Final = role
        self._routing = _routing(routing)
        self.epoch: Final = epoch if epoch is not None else f"{role}-{uuid.uuid4().hex[:16]}"
        self._weight_sources = weight_sources
        self._static_roles = static_roles
        self._models: dict[str, _Model] = {}
        self._revision = 0
        self._cached: RoleSnapshot | None = None
        self._lock = threading.RLock()
        self._empty(routing=RoutingSpec(policy=routing.policy))  # checks role and epoch now

    @property
    def topology_revision(self) -> int:
        """The revision the next snapshot carries."""
        with self._lock:
            return self._revision

    def snapshot(self) -> RoleSnapshot:
        """The current snapshot: the cached object when nothing changed since the last call.

        :raises SnapshotError: the routing spec points to a model that is not published."""
        with self._lock:
            if self._cached is None:
                models = {
                    model_id: attrs.evolve(
                        entry.view, engines=tuple(e.view for e in entry.engines.values())
                    )
                    for model_id, entry in self._models.items()
                }
                snapshot = self._empty(self._revision, routing=self._routing, models=models)
                snapshot.check_sources(
                    weight_sources=self._weight_sources, static_roles=self._static_roles
                )
                self._cached = snapshot
            return self._cached

    def set_routing(self, routing: RoutingSpec) -> None:
        """Replace the routing spec (its targets are checked when the next snapshot is taken)."""
        _routing(routing)
        with self._lock:
            if routing != self._routing:
                self._routing = routing
                self._changed()

    def set_model(
        self,
        model_id: str,
        *,
        state: ModelState | str,
        route_mode: RouteMode | str,
        weight_source: str,
        served_model_name: str,
        router_url: str | None = None,
        weight_version: str | None = None,
    ) -> None:
        """Publish a model, or replace its model-level fields (its engines are kept).

        :raises SnapshotError: a field breaks a schema rule (path ``models.<id>.<field>``)."""
        fields = (state, route_mode, router_url, weight_source, weight_version, served_model_name)
        with self._lock:
            self._put_model(model_id, *fields)

    def update_model(self, model_id: str, **changes: Any) -> None:
        """Change some model-level fields (``state``, ``router_url``, ``weight_version``, …).

        :raises KeyError: the model is not published.
        :raises SnapshotError: the result breaks a schema rule."""
        with self._lock:
            fields = attrs.asdict(self._model(model_id).view, recurse=False)
            del fields["engines"]
            if unknown := set(changes) - set(fields):
                raise TypeError(
                    f"update_model: unknown fields {sorted(unknown)}; model fields are "
                    f"{sorted(fields)}"
                )
            fields.update(changes)
            self._put_model(model_id, **fields)

    def set_model_state(self, model_id: str, state: ModelState | str) -> None:
        """Set a model's state (``KeyError`` if it is not published)."""
        self.update_model(model_id, state=state)

    def set_weight_version(self, model_id: str, weight_version: str | None) -> None:
        """Publish a model's new weight version (refused for STATIC models)."""
        self.update_model(model_id, weight_version=weight_version)

    def remove_model(self, model_id: str) -> None:
        """Stop publishing a model and its engines.

        :raises KeyError: the model is not published.
        :raises SnapshotError: the routing spec still points to it; change the routing first."""
        with self._lock:
            self._model(model_id)
            routing = self._routing
            refs = ["routing.default_model"] if routing.default_model == model_id else []
            for name in ("route_key_map", "aliases"):
                pointing = getattr(routing, name).items()
                refs += [f"routing.{name}[{key!r}]" for key, to in pointing if to == model_id]
            if refs:
                raise SnapshotError(
                    f"models.{model_id}",
                    f"cannot remove model {model_id!r}: {', '.join(refs)} still point to it; "
                    "call set_routing() without it first",
                )
            del self._models[model_id]
            self._changed()

    def set_engine(
        self,
        model_id: str,
        engine_id: str,
        *,
        base_url: str | None,
        state: ModelState | str,
        direct_eligible: bool | None = None,
        replaced: bool = False,
        weight_version: str | None = None,
    ) -> int:
        """Publish a replica head, or update it; return its generation.

        A new head starts at generation 1, which moves when ``base_url`` changes or
        ``replaced`` (a new worker behind the same URL). ``direct_eligible`` defaults to "READY
        with a URL" (``False`` keeps a READY head out of DIRECT routing). ``weight_version``:
        what the head serves (versioned weight sources only).

        :raises KeyError: the model is not published.
        :raises SnapshotError: the head breaks a schema rule
            (path ``models.<id>.engines[<engine_id>].<field>``)."""
        with self._lock:
            old = self._model(model_id).engines.get(engine_id)
            generation = 0 if old is None else old.generation
            if old is None or replaced or old.endpoint != base_url:
                generation += 1
            return self._put_engine(
                model_id, engine_id, base_url, state, direct_eligible, generation, weight_version
            )

    def publish_many(
        self,
        model_id: str,
        model: dict[str, Any],
        engines: Collection[tuple[str, dict[str, Any]]] = (),
        removed: Collection[str] = (),
    ) -> dict[str, int]:
        """:meth:`set_model` (``model``: its fields), then :meth:`set_engine` for each
        ``(engine_id, fields)`` of ``engines`` and :meth:`remove_engine` for each of
        ``removed``, under one lock; returns each engine's generation.

        :raises KeyError, SnapshotError: as the calls it makes (those before it stay applied)."""
        with self._lock:
            self.set_model(model_id, **model)
            generations = {e: self.set_engine(model_id, e, **fields) for e, fields in engines}
            for engine_id in removed:
                self.remove_engine(model_id, engine_id)
            return generations

    def set_engine_state(
        self, model_id: str, engine_id: str, state: str, *, direct_eligible: bool | None = None
    ) -> None:
        """Change a head's state (and eligibility), keeping its URL and generation.

        :raises KeyError: the model or engine is not published."""
        with self._lock:
            old = self._engine(model_id, engine_id)
            kept = (old.generation, old.weight_version)
            self._put_engine(model_id, engine_id, old.endpoint, state, direct_eligible, *kept)

    def remove_engine(self, model_id: str, engine_id: str) -> None:
        """Stop publishing a replica head (``KeyError`` if it is not published)."""
        with self._lock:
            self._engine(model_id, engine_id)
            del self._models[model_id].engines[engine_id]
            self._changed()

    def invalidate(self, model_ids: Collection[str] | None = None) -> None:
        """Mark every model (or those of ``model_ids``) and its engines UNKNOWN until their
        managers report again (a lost manager). Idempotent; unknown ids are ignored."""
        with self._lock:
            changed = False
            for model_id, entry in self._models.items():
                if model_ids is not None and model_id not in model_ids:
                    continue
                if entry.view.state is not ModelState.UNKNOWN:
                    entry.view = attrs.evolve(entry.view, state=ModelState.UNKNOWN)
                    changed = True
                for engine_id, engine in entry.engines.items():
                    if engine.state is ModelState.UNKNOWN and engine.direct_eligible is None:
                        continue
                    engine.state = ModelState.UNKNOWN
                    engine.direct_eligible = None
                    kept = (engine.generation, engine.weight_version)
                    engine.view = _engine_view(
                        engine_id, engine.endpoint, engine.state, None, *kept
                    )
                    changed = True
            if changed:
                self._changed()

    def _empty(self, revision: int = 0, **fields: Any) -> RoleSnapshot:
        """A snapshot of this role with ``fields`` (revision 0: to validate them)."""
        fields = {"routing": RoutingSpec(), "models": {}, **fields}
        return RoleSnapshot(
            role=self.role, registry_epoch=self.epoch, topology_revision=revision, **fields
        )

    def _changed(self) -> None:
        self._revision += 1
        self._cached = None

    def _model(self, model_id: str) -> _Model:
        try:
            return self._models[model_id]
        except KeyError:
            raise KeyError(
                f"role {self.role!r} publishes no model {model_id!r}; published: "
                f"{sorted(self._models)}. Call set_model() first"
            ) from None

    def _engine(self, model_id: str, engine_id: str) -> _Engine:
        entry = self._model(model_id)
        try:
            return entry.engines[engine_id]
        except KeyError:
            raise KeyError(
                f"model {model_id!r} of role {self.role!r} publishes no engine {engine_id!r}; "
                f"published: {sorted(entry.engines)}"
            ) from None

    def _put_model(self, model_id: str, *args: Any, **fields: Any) -> None:
        """Publish ``ModelView(*args, **fields)`` as ``model_id`` (its engines are kept)."""
        path = f"models.{model_id}"
        view = build_at(path, ModelView, *args, **fields)
        build_at(path, self._empty, models={model_id: view})
        check_model_sources(
            self.role,
            model_id,
            view,
            weight_sources=self._weight_sources,
            static_roles=self._static_roles,
        )
        entry = self._models.get(model_id)
        if entry is None:
            self._models[model_id] = _Model(view)
            self._changed()
        elif entry.view != view:
            entry.view = view
            self._changed()

    def _put_engine(
        self,
        model_id: str,
        engine_id: str,
        endpoint: str | None,
        state: ModelState | str,
        direct_eligible: bool | None,
        generation: int,
        weight_version: str | None = None,
    ) -> int:
        path = f"models.{model_id}.engines[{engine_id}]"
        engine_state = build_at(path, to_enum, ModelState, "state", state)
        fields = (engine_state, direct_eligible, generation, weight_version)
        view = build_at(path, _engine_view, engine_id, endpoint, *fields)
        if endpoint is not None and view.base_url is None:
            # FAILED hides the URL; still check the one the manager reported.
            build_at(path, EngineView, engine_id, endpoint, ModelState.UNKNOWN, False, generation)
        entry = self._models[model_id]
        old = entry.engines.get(engine_id)
        if entry.view.weight_source == "STATIC" and weight_version is not None:
            raise SnapshotError(
                f"{path}.weight_version",
                f"engine {engine_id!r} of STATIC model {model_id!r} carries a weight_version "
                f"({weight_version!r}); STATIC heads publish none",
            )
        entry.engines[engine_id] = _Engine(
            endpoint, engine_state, direct_eligible, generation, view, weight_version
        )
        if old is None or old.view != view:
            self._changed()
        return generation

"""The model's schema-2 view (heads only; FAILED ones without a URL; the model's state the most
active of its replicas'), and its publication to the role's registry and router."""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any, Protocol

import attrs

from relax_core.discovery.schema import EngineView, ModelState, ModelView
from relax_core.engine.spec import InferenceEngineSpec
from relax_core.manager.slots import ModelLaunch, SlotTable
from relax_core.manager.state import ReplicaState
from relax_core.records import RouterMembership

_S = ReplicaState
# Model state from replica states: the first state in this order that any replica is in.
_MODEL_STATE_ORDER = (_S.READY, _S.ONLOADING, _S.DRAINING, _S.STARTING, _S.SLEEPING, _S.STOPPING)
# Replica states whose head stays registered with the model's router (503 while not READY).
_ROUTED = frozenset({_S.READY, _S.DRAINING, _S.SLEEPING, _S.ONLOADING})


class _Published(Protocol):
    """What a published model has in common, whoever runs its engines."""

    spec: InferenceEngineSpec
    route_mode: str
    router_url: str | None


def model_view(
    model: _Published,
    state: str,
    weight_version: str | None,
    served_model_name: str,
    engines: Iterable[EngineView],
) -> ModelView:
    """The schema-2 view of ``model`` (its route mode, router URL and weight source) in
    ``state``, with its published ``engines``."""
    return ModelView(
        state=state,
        route_mode=model.route_mode,
        router_url=model.router_url,
        weight_source=model.spec.weight_source.name,
        weight_version=weight_version,
        served_model_name=served_model_name,
        engines=tuple(engines),
    )


@attrs.define
class Publication:
    """What one model publishes: its view (heads only) and its weight version, to
    ``publisher`` (``None``: nowhere). Not thread-safe (the manager's lock is held)."""

    slots: SlotTable
    spec: InferenceEngineSpec
    launch: ModelLaunch
    publisher: Any
    route_mode: str
    router_url: str | None
    #: the router in front of the heads (SGLANG_ROUTER), told the routable heads on every publish
    router: RouterMembership | None = None
    #: the version of the weights the model serves (started on, or last updated to)
    weight_version: str | None = attrs.field(default=None, init=False)
    #: engine id -> the generation last published for it
    _published: dict[str, int] = attrs.field(factory=dict, init=False)

    @property
    def published_version(self) -> str | None:
        """The weight version the model publishes (``None`` for sources that publish none)."""
        return self.weight_version if self.spec.publishes_version else None

    def _head_version(self, version: str | None) -> str | None:
        """What a head publishes as its weight version (nothing for unversioned sources)."""
        return version if self.spec.publishes_version else None

    def view(self) -> ModelView:
        """The model's :class:`~relax_core.discovery.schema.ModelView`."""
        engines = []
        states = set()
        for slot in self.slots.ordered():
            rep = slot.replica
            states.add(rep.state)
            if rep.base_url is None:
                continue
            engines.append(
                EngineView(
                    engine_id=rep.engine_id,
                    # A FAILED head never publishes its URL.
                    base_url=None if rep.state is _S.FAILED else rep.base_url,
                    state=str(rep.state),
                    direct_eligible=rep.direct_eligible,
                    generation=rep.generation,
                    weight_version=self._head_version(rep.weight_version),
                )
            )
        state = next((str(s) for s in _MODEL_STATE_ORDER if s in states), None)
        if state is None:
            state = str(ModelState.FAILED if states else ModelState.STOPPING)
        served = self.launch.served_model_name or self.launch.model_path
        return model_view(self, state, self.published_version, served, engines)

    def publish(self) -> None:
        """Tell the router (if any) the heads to route to, then publish the model and its
        replica heads (nothing without a publisher)."""
        self.publish_begin()()

    def publish_begin(self) -> Callable[[], None]:
        """:meth:`publish`, its answer awaited (and its error raised) when the returned
        function is called (a registry actor's ``publish_many_begin`` travels meanwhile);
        the router is told at once."""
        self._sync_router()
        if self.publisher is None:
            return _done
        model_id = self.slots.model_id
        view = self.view()
        engines = []
        published = {}
        for slot in self.slots.ordered():
            rep = slot.replica
            if rep.base_url is None:
                continue
            last = self._published.get(rep.engine_id)
            fields = {
                "base_url": rep.base_url,
                "state": str(rep.state),
                "direct_eligible": rep.direct_eligible,
                "replaced": last is not None and last != rep.generation,
                "weight_version": self._head_version(rep.weight_version),
            }
            engines.append((rep.engine_id, fields))
            published[rep.engine_id] = rep.generation
        removed = sorted(set(self._published) - set(published))
        publisher = self.publisher

        def applied() -> None:
            # Only once the registry has them (a failed publication is sent whole again).
            self._published = published

        begin = getattr(publisher, "publish_many_begin", None)
        if begin is not None:
            answer = begin(model_id, _model_fields(view), engines, removed)

            def wait() -> None:
                answer()
                applied()

            return wait
        many = getattr(publisher, "publish_many", None)
        if many is not None:
            many(model_id, _model_fields(view), engines, removed)
        else:
            publish_model(publisher, model_id, view)
            for engine_id, fields in engines:
                publisher.set_engine(model_id, engine_id, **fields)
            for gone in removed:
                publisher.remove_engine(model_id, gone)
        applied()
        return _done

    def _sync_router(self) -> None:
        if self.router is not None:
            # Before the publisher: in the router before published READY, out before stopped.
            self.router.sync(
                {
                    s.engine_id: s.replica.base_url
                    for s in self.slots.ordered()
                    if s.replica.base_url is not None
                    and s.replica.state in _ROUTED
                    and not s.retiring
                }
            )


def _done() -> None:
    return None


def _model_fields(view: ModelView) -> dict[str, Any]:
    """The model-level fields of ``view`` (its engines are published one by one)."""
    return attrs.asdict(view, recurse=False, filter=lambda a, _v: a.name != "engines")


def publish_model(publisher: Any, model_id: str, view: ModelView) -> None:
    """Publish the model-level fields of ``view`` as model ``model_id`` (its engines are kept;
    callers publish them one by one). Errors are the publisher's ``set_model``'s."""
    publisher.set_model(model_id, **_model_fields(view))

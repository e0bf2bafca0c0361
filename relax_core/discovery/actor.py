"""A role's registry in a Ray actor, so managers in other processes publish into one snapshot:
each gets a :class:`RemotePublisher`, whose calls a :class:`RegistryActor` applies in order to the
role's one :class:`~relax_core.discovery.publisher.RegistryPublisher`."""

from __future__ import annotations

import functools
from collections.abc import Callable, Collection
from typing import Any, TypeAlias, cast

import attrs

from relax_core._proxy import remote_errors
from relax_core.discovery.liveness import ManagerLiveness, actor_ping, actor_republish
from relax_core.discovery.publisher import RegistryPublisher
from relax_core.discovery.schema import RoleSnapshot, RoutingSpec
from relax_core.errors import SnapshotError

_Fields: TypeAlias = dict[str, Any]
_Engines: TypeAlias = Collection[tuple[str, _Fields]]
_FORWARDED = frozenset({"set_model", "set_engine", "remove_engine", "publish_many", "invalidate"})


class RegistryActor:
    """The Ray actor holding one role's :class:`RegistryPublisher` (CPU only)."""

    def __init__(
        self,
        role: str,
        routing: RoutingSpec,
        weight_sources: Collection[str] | None = None,
        epoch: str | None = None,
        liveness_interval: float = 2.0,
    ) -> None:
        self._publisher = RegistryPublisher(
            role, routing, weight_sources=weight_sources, epoch=epoch
        )
        self._liveness_interval = liveness_interval
        self._liveness: ManagerLiveness | None = None

    def call(self, method: str, *args: Any, **fields: Any) -> Any:
        """``RegistryPublisher.<method>(*args, **fields)`` for the forwarded publisher calls."""
        if method not in _FORWARDED:
            raise AttributeError(f"the registry actor forwards only {sorted(_FORWARDED)}")
        return getattr(self._publisher, method)(*args, **fields)

    def watch_manager(self, model_id: str, manager_actor: Any) -> None:
        """Watch ``model_id``'s manager actor; its model goes UNKNOWN when it is gone."""
        if self._liveness is None:
            self._liveness = ManagerLiveness(self._publisher, interval=self._liveness_interval)
            self._liveness.start()
        self._liveness.watch(
            model_id, actor_ping(manager_actor), republish=actor_republish(manager_actor)
        )

    def snapshot(self) -> dict[str, Any]:
        return self._publisher.snapshot().to_json()

    def ping(self) -> str:
        return self._publisher.role


@attrs.define(eq=False)
class RemotePublisher:
    """The publishing side of a :class:`RegistryActor`, usable from any process (picklable).

    Each call blocks until the registry applied it (so a manager's publications stay in order
    and a refused one raises where it was made), with a ``timeout`` in seconds."""

    actor: Any
    role: str
    timeout: float = attrs.field(default=30.0, kw_only=True)

    def _wait(self, method: str, ref: Any) -> Any:
        import ray

        def error(why: str) -> SnapshotError:
            return SnapshotError("", f"role {self.role!r} registry: {method}: {why}")

        with remote_errors(error, actor="its registry actor", timeout=self.timeout):
            return ray.get(ref, timeout=self.timeout)

    def _call(self, method: str, *args: Any, **fields: Any) -> Any:
        if method in _FORWARDED:
            return self._wait(method, self.actor.call.remote(method, *args, **fields))
        return self._wait(method, getattr(self.actor, method).remote(*args))

    def set_model(self, model_id: str, **fields: Any) -> None:
        """See :meth:`RegistryPublisher.set_model`."""
        self._call("set_model", model_id, **fields)

    def set_engine(self, model_id: str, engine_id: str, **fields: Any) -> int:
        """See :meth:`RegistryPublisher.set_engine`."""
        return cast(int, self._call("set_engine", model_id, engine_id, **fields))

    def remove_engine(self, model_id: str, engine_id: str) -> None:
        """See :meth:`RegistryPublisher.remove_engine`."""
        self._call("remove_engine", model_id, engine_id)

    def publish_many(self, *args: Any, **kwargs: Any) -> dict[str, int]:
        """See :meth:`RegistryPublisher.publish_many`: one round trip to the registry."""
        return self.publish_many_begin(*args, **kwargs)()

    def publish_many_begin(
        self, model_id: str, model: _Fields, engines: _Engines = (), removed: Collection[str] = ()
    ) -> Callable[[], dict[str, int]]:
        """:meth:`publish_many` sent now, its answer awaited when the returned function is
        called (and its error raised there). The registry applies calls in the order sent."""
        args = (model_id, model, list(engines), list(removed))
        ref = self.actor.call.remote("publish_many", *args)
        return functools.partial(self._wait, "publish_many", ref)

    def invalidate(self, model_ids: Collection[str] | None = None) -> None:
        """See :meth:`RegistryPublisher.invalidate`."""
        self._call("invalidate", None if model_ids is None else sorted(model_ids))

    def watch_manager(self, model_id: str, manager_actor: Any) -> None:
        """Have the registry watch ``model_id``'s manager actor: when it is gone (or stops
        answering) the model and its engines are published UNKNOWN
        (:class:`~relax_core.discovery.liveness.ManagerLiveness`)."""
        self._call("watch_manager", model_id, manager_actor)

    def snapshot(self) -> RoleSnapshot:
        """The role's current snapshot (blocking)."""
        return RoleSnapshot.from_json(self._call("snapshot"))

    async def fetch(self) -> dict[str, Any]:
        """The role's current snapshot as a schema-2 dict (an ``InferenceClient``
        ``snapshot_provider``; does not block the loop)."""
        return cast("dict[str, Any]", await self.actor.snapshot.remote())

    def stop(self) -> None:
        """Kill the registry actor. Idempotent."""
        import ray

        ray.kill(self.actor, no_restart=True)


def start_registry_actor(
    role: str,
    routing: RoutingSpec,
    *,
    name: str | None = None,
    namespace: str | None = None,
    weight_sources: Collection[str] | None = None,
    liveness_interval: float = 2.0,
) -> RemotePublisher:
    """Create ``role``'s registry actor on the connected Ray (no CPU, no GPU reserved); return
    the publisher to hand to each of the role's managers. ``liveness_interval``: seconds
    between the registry's pings of the manager actors it watches."""
    import ray

    options: dict[str, Any] = {"num_cpus": 0, "num_gpus": 0, "max_restarts": 0}
    if name is not None:
        options.update(name=name, namespace=namespace)
    sources = sorted(weight_sources) if weight_sources is not None else None
    actor = (
        ray.remote(RegistryActor)
        .options(**options)
        .remote(role, routing, sources, liveness_interval=liveness_interval)
    )
    publisher = RemotePublisher(actor, role)
    publisher._call("ping")  # constructed (a bad role or routing spec raises here)
    return publisher

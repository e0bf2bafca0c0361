"""A role's registry in a Ray actor, so managers in other processes publish into one snapshot.

A manager publishes through three calls (``set_model``, ``set_engine``, ``remove_engine``). When
managers live in Ray actors (:mod:`relax_core.manager.actor`), each one gets a
:class:`RemotePublisher`: the same calls, forwarded (blocking, in order) to a
:class:`RegistryActor` that holds the role's real
:class:`~relax_core.discovery.publisher.RegistryPublisher` — so the role still has one
schema-2 snapshot, with the publisher's rules (revision, generations, FAILED without a URL).
Readers use :meth:`RemotePublisher.snapshot` or, as an
:class:`~relax_core.client.client.InferenceClient` snapshot provider,
:meth:`RemotePublisher.fetch`.
"""

from __future__ import annotations

from collections.abc import Collection
from typing import Any

from relax_core.discovery.publisher import RegistryPublisher
from relax_core.discovery.schema import RoleSnapshot, RoutingSpec
from relax_core.errors import SnapshotError

__all__ = ["RegistryActor", "RemotePublisher", "start_registry_actor"]


class RegistryActor:
    """The Ray actor holding one role's :class:`RegistryPublisher` (CPU only)."""

    def __init__(
        self,
        role: str,
        routing: RoutingSpec,
        weight_sources: Collection[str] | None = None,
        epoch: str | None = None,
    ) -> None:
        self._publisher = RegistryPublisher(
            role, routing, weight_sources=weight_sources, epoch=epoch
        )

    def set_model(self, model_id: str, fields: dict[str, Any]) -> None:
        self._publisher.set_model(model_id, **fields)

    def set_engine(self, model_id: str, engine_id: str, fields: dict[str, Any]) -> int:
        return self._publisher.set_engine(model_id, engine_id, **fields)

    def remove_engine(self, model_id: str, engine_id: str) -> None:
        self._publisher.remove_engine(model_id, engine_id)

    def invalidate(self) -> None:
        self._publisher.invalidate()

    def snapshot(self) -> dict[str, Any]:
        return self._publisher.snapshot().to_json()

    def ping(self) -> str:
        return self._publisher.role


class RemotePublisher:
    """The publishing side of a :class:`RegistryActor`, usable from any process (picklable).

    Each call blocks until the registry applied it (so a manager's publications stay in order
    and a refused one raises where it was made), with a ``timeout`` in seconds.
    """

    def __init__(self, actor: Any, role: str, *, timeout: float = 30.0) -> None:
        self.actor = actor
        self.role = role
        self.timeout = timeout

    def _call(self, method: str, *args: Any) -> Any:
        import ray

        try:
            return ray.get(getattr(self.actor, method).remote(*args), timeout=self.timeout)
        except ray.exceptions.RayTaskError as exc:
            if isinstance(exc.cause, BaseException):
                raise exc.cause from None
            raise SnapshotError("", f"role {self.role!r} registry: {method} failed: {exc}") from exc
        except ray.exceptions.RayError as exc:
            raise SnapshotError(
                "", f"role {self.role!r} registry actor unreachable ({method}): {exc}"
            ) from exc

    def set_model(self, model_id: str, **fields: Any) -> None:
        """See :meth:`RegistryPublisher.set_model`."""
        self._call("set_model", model_id, fields)

    def set_engine(self, model_id: str, engine_id: str, **fields: Any) -> int:
        """See :meth:`RegistryPublisher.set_engine`."""
        generation: int = self._call("set_engine", model_id, engine_id, fields)
        return generation

    def remove_engine(self, model_id: str, engine_id: str) -> None:
        """See :meth:`RegistryPublisher.remove_engine`."""
        self._call("remove_engine", model_id, engine_id)

    def invalidate(self) -> None:
        """See :meth:`RegistryPublisher.invalidate`."""
        self._call("invalidate")

    def snapshot(self) -> RoleSnapshot:
        """The role's current snapshot (blocking)."""
        return RoleSnapshot.from_json(self._call("snapshot"))

    async def fetch(self) -> dict[str, Any]:
        """The role's current snapshot as a schema-2 dict — an ``InferenceClient``
        ``snapshot_provider`` (awaits the actor without blocking the loop)."""
        snap: dict[str, Any] = await self.actor.snapshot.remote()
        return snap

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
) -> RemotePublisher:
    """Create ``role``'s registry actor on the connected Ray (no CPU, no GPU reserved); return
    the publisher to hand to each of the role's managers."""
    import ray

    options: dict[str, Any] = {"num_cpus": 0, "num_gpus": 0, "max_restarts": 0}
    if name is not None:
        options.update(name=name, namespace=namespace)
    sources = sorted(weight_sources) if weight_sources is not None else None
    actor = ray.remote(RegistryActor).options(**options).remote(role, routing, sources)
    publisher = RemotePublisher(actor, role)
    publisher._call("ping")  # constructed (a bad role or routing spec raises here)
    return publisher

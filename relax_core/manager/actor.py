"""An InferenceManager hosted by a CPU-only, named Ray actor, so other processes drive it.

The coordinator of a defer layout onloads and offloads genrm and teacher by remote call; for
that, their managers live in actors. :class:`ManagerActor` builds an
:class:`~relax_core.manager.InferenceManager` from the same arguments (the publisher is a
:class:`~relax_core.discovery.actor.RemotePublisher`, so the role keeps one snapshot) and
exposes the same methods with the same per-replica results
(:class:`~relax_core.manager.LifecycleResult` pickles). The actor reserves no CPU and no GPU
(its engine workers hold the bundles) and runs up to ``max_concurrency`` calls at once: queries
(``states``, ``model_view``) answer while an onload runs; lifecycle calls still take the
manager's lock one at a time.

Errors raised by the manager reach the caller as themselves (``LifecycleError``,
``InferenceRecoveryRequired`` with its ``result``), wrapped by Ray as its ``RayTaskError`` of
that type; :class:`~relax_core.coordination.handles.RayManagerHandle` unwraps them.
"""

from __future__ import annotations

from typing import Any

from relax_core.manager.manager import InferenceManager
from relax_core.manager.results import HealthReport, LifecycleResult

__all__ = ["ManagerActor", "manager_actor_name", "start_manager_actor"]


def manager_actor_name(job: str, role: str, model_id: str) -> str:
    """The actor name of ``role``'s model ``model_id`` in job ``job``."""
    return f"relax-manager-{job}-{role}-{model_id}"


class ManagerActor:
    """One model's InferenceManager inside a Ray actor; every method forwards to it.

    Constructor arguments are :class:`~relax_core.manager.InferenceManager`'s.
    """

    def __init__(self, model_id: str, **kwargs: Any) -> None:
        self._manager = InferenceManager(model_id, **kwargs)

    # -- lifecycle ---------------------------------------------------------------------------

    def start(self) -> LifecycleResult:
        return self._manager.start()

    def onload(self, tags: Any = None, *, engine_ids: Any = None) -> LifecycleResult:
        return self._manager.onload(tags, engine_ids=engine_ids)

    def offload(self, tags: Any = None, *, engine_ids: Any = None) -> LifecycleResult:
        return self._manager.offload(tags, engine_ids=engine_ids)

    def health_check(self, *, recover: bool = True) -> HealthReport:
        return self._manager.health_check(recover=recover)

    def recover(self) -> LifecycleResult:
        return self._manager.recover()

    def confirm_external_cleanup(self, engine_ids: Any = None) -> list[str]:
        return self._manager.confirm_external_cleanup(engine_ids)

    def scale_out(self, *args: Any, **kwargs: Any) -> LifecycleResult:
        return self._manager.scale_out(*args, **kwargs)

    def scale_in(self, *args: Any, **kwargs: Any) -> LifecycleResult:
        return self._manager.scale_in(*args, **kwargs)

    def shutdown(self) -> None:
        self._manager.shutdown()

    # -- weights -----------------------------------------------------------------------------

    def update_weights_from_tensor(self, *args: Any, **kwargs: Any) -> LifecycleResult:
        return self._manager.update_weights_from_tensor(*args, **kwargs)

    def update_weights_from_disk(self, *args: Any, **kwargs: Any) -> LifecycleResult:
        return self._manager.update_weights_from_disk(*args, **kwargs)

    def update_weights_from_distributed(self, *args: Any, **kwargs: Any) -> LifecycleResult:
        return self._manager.update_weights_from_distributed(*args, **kwargs)

    def init_weights_update_group(self, *args: Any, **kwargs: Any) -> LifecycleResult:
        return self._manager.init_weights_update_group(*args, **kwargs)

    def destroy_weights_update_group(self, *args: Any, **kwargs: Any) -> LifecycleResult:
        return self._manager.destroy_weights_update_group(*args, **kwargs)

    def load_checkpoint(self, version: int | None = None) -> LifecycleResult:
        return self._manager.load_checkpoint(version)

    # -- queries -----------------------------------------------------------------------------

    def ping(self) -> str:
        """The model id; takes no lock (the registry's liveness check)."""
        return self._manager.model_id

    def republish(self) -> None:
        """Publish the model's state again (after the registry marked it UNKNOWN)."""
        self._manager.republish()

    def weight_version(self) -> str | None:
        return self._manager.weight_version

    def states(self) -> dict[str, str]:
        return self._manager.states()

    def engine_pids(self) -> dict[str, list[int | None]]:
        return self._manager.engine_pids()

    def admission_states(self) -> dict[str, dict[str, Any]]:
        return self._manager.admission_states()

    def model_view(self) -> Any:
        return self._manager.model_view()

    def workers(self, engine_id: str) -> list[Any]:
        return self._manager.workers(engine_id)

    def unconfirmed_workers(self) -> list[Any]:
        return self._manager.unconfirmed_workers()


def start_manager_actor(
    model_id: str,
    *,
    name: str | None = None,
    namespace: str | None = None,
    max_concurrency: int = 8,
    **kwargs: Any,
) -> Any:
    """Create a :class:`ManagerActor` for ``model_id`` on the connected Ray; return its handle
    (``kwargs`` are the InferenceManager's: ``spec``, ``backend``, ``launch``, ``placement``,
    ``publisher``, ``timeouts``, …). The manager is not started: call ``start``.

    The actor reserves no CPU and no GPU. It is built before this returns, so bad arguments
    raise here (as the ``RayActorError`` of its failed construction). With a ``publisher`` of a
    registry actor (:class:`~relax_core.discovery.actor.RemotePublisher`), the registry watches
    the manager actor and publishes its model UNKNOWN once the actor is gone.
    """
    import ray

    options: dict[str, Any] = {
        "num_cpus": 0,
        "num_gpus": 0,
        "max_restarts": 0,
        "max_concurrency": max_concurrency,
    }
    if name is not None:
        options.update(name=name, namespace=namespace)
    actor: Any = ray.remote(ManagerActor).options(**options).remote(model_id, **kwargs)
    ray.get(actor.states.remote(), timeout=60)
    watch = getattr(kwargs.get("publisher"), "watch_manager", None)
    if watch is not None:
        # The role's registry watches the actor: if it dies, its model is published UNKNOWN.
        watch(model_id, actor)
    return actor

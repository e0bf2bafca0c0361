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

A model routed through a router (``SGLANG_ROUTER``) keeps its router where its manager is: give
``router_backend`` and ``router_spec`` and the actor launches the router itself (a router
process is not serialisable), makes it ready before the engines start, publishes its URL as
the model's ``router_url`` and stops it after the engines.

Errors raised by the manager reach the caller as themselves (``LifecycleError``,
``InferenceRecoveryRequired`` with its ``result``), wrapped by Ray as its ``RayTaskError`` of
that type; :class:`~relax_core.coordination.handles.RayManagerHandle` unwraps them.
"""

from __future__ import annotations

from typing import Any

from relax_core.errors import LifecycleError
from relax_core.manager.manager import InferenceManager
from relax_core.manager.results import HealthReport, LifecycleResult
from relax_core.records import RouterBackend, RouterLaunchSpec

__all__ = ["ManagerActor", "manager_actor_name", "start_manager_actor"]


def manager_actor_name(job: str, role: str, model_id: str) -> str:
    """The actor name of ``role``'s model ``model_id`` in job ``job``."""
    return f"relax-manager-{job}-{role}-{model_id}"


class ManagerActor:
    """One model's InferenceManager inside a Ray actor; every method forwards to it.

    Constructor arguments are :class:`~relax_core.manager.InferenceManager`'s, plus
    ``router_backend`` / ``router_spec`` (the router of an ``SGLANG_ROUTER`` model, launched
    here; ``router_timeout``: seconds :meth:`start` waits for it to be ready).
    """

    def __init__(
        self,
        model_id: str,
        *,
        router_backend: RouterBackend | None = None,
        router_spec: RouterLaunchSpec | None = None,
        router_timeout: float = 60.0,
        **kwargs: Any,
    ) -> None:
        self._router: Any = None
        self._router_timeout = router_timeout
        if router_backend is not None:
            if router_spec is None:
                raise ValueError(f"model {model_id!r}: router_backend needs a router_spec")
            self._router = router_backend.launch(router_spec)
            kwargs.update(router=self._router, router_url=self._router.url)
        try:
            self._manager = InferenceManager(model_id, **kwargs)
        except BaseException:
            self._stop_router()
            raise

    def _stop_router(self) -> None:
        if self._router is not None:
            # Stopped last, when no traffic is left: a short grace is enough.
            self._router.terminate(3.0)

    # -- lifecycle ---------------------------------------------------------------------------

    def start(self) -> LifecycleResult:
        """Make the router ready (if any), then start every engine; the router must then hold
        the model's READY heads.

        :raises ConfigError: the router drops a request field the roles send (no engine
            started). :raises LifecycleError: the router did not start or took no head.
        """
        if self._router is not None:
            self._router.wait_ready(self._router_timeout)
        result = self._manager.start()
        if self._router is not None and result.ok:
            trouble = self._router.check()
            if trouble:
                raise LifecycleError(
                    f"the router of model {self._manager.model_id!r} ({self._router.url}) did "
                    "not take the model's heads:\n  " + "\n  ".join(trouble)
                )
        return result

    def onload(self, tags: Any = None, *, engine_ids: Any = None) -> LifecycleResult:
        return self._manager.onload(tags, engine_ids=engine_ids)

    def offload(
        self, tags: Any = None, *, engine_ids: Any = None, abort: bool = False
    ) -> LifecycleResult:
        return self._manager.offload(tags, engine_ids=engine_ids, abort=abort)

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
        """Shut the manager down, then stop its router (whatever the shutdown raised)."""
        try:
            self._manager.shutdown()
        finally:
            self._stop_router()

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

    def router_url(self) -> str | None:
        """The URL of the router this actor runs, if any."""
        return None if self._router is None else str(self._router.url)

    def router_pids(self) -> list[int]:
        """The process ids of the router this actor runs (empty without one, or once stopped)."""
        return [] if self._router is None else list(self._router.pids())


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
    ``publisher``, ``timeouts``, …, and :class:`ManagerActor`'s ``router_backend`` /
    ``router_spec``). The manager is not started: call ``start``.

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

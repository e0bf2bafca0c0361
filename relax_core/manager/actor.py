"""A model's manager behind one contract, in this process or in a CPU-only, named Ray actor.

:class:`ModelManager` is that contract: what a caller may ask of one model's manager, whether
it is an :class:`~relax_core.manager.InferenceManager` in this process (``relax serve``) or a
:class:`ManagerActor` that hosts one (``relax run``: the coordinator of a defer layout onloads
and offloads genrm and teacher by remote call, and the trainer pushes weights to rollout). Both
are checked against it: by mypy (the typed functions at the bottom of this module) and by a
test that compares every public method's name and signature.

:class:`ManagerActor` builds its manager from the same arguments (the publisher is a
:class:`~relax_core.discovery.actor.RemotePublisher`, so the role keeps one snapshot) and
answers with the same per-replica results (:class:`~relax_core.manager.LifecycleResult`
pickles). The actor reserves no CPU and no GPU (its engine workers hold the bundles) and runs up
to ``max_concurrency`` calls at once: queries (``states``, ``model_view``) answer while an
onload runs; lifecycle calls still take the manager's lock one at a time.

A model routed through a router (``SGLANG_ROUTER``) has its router where its manager is:
:func:`start_behind_router` makes it ready before the engines start and checks it took the
model's READY heads; :func:`shutdown_behind_router` stops it after the engines. A
:class:`ManagerActor` given ``router_backend`` and ``router_spec`` launches the router itself
(a router process is not serialisable).

Errors raised by the manager reach the caller as themselves (``LifecycleError``,
``InferenceRecoveryRequired`` with its ``result``), wrapped by Ray as its ``RayTaskError`` of
that type; :class:`~relax_core.coordination.handles.RayManagerHandle` and
:class:`~relax_core.jobs.models.RayModel` unwrap them.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import TYPE_CHECKING, Any, Protocol

from relax_core.discovery.schema import ModelView
from relax_core.engine.buckets import WeightBucket
from relax_core.errors import LifecycleError
from relax_core.manager.manager import InferenceManager
from relax_core.manager.results import HealthReport, LifecycleResult, UnconfirmedWorker
from relax_core.manager.slots import WorkerSlot
from relax_core.records import RouterBackend, RouterLaunchSpec, RouterProcess

__all__ = [
    "ManagerActor",
    "ModelManager",
    "manager_actor_name",
    "shutdown_behind_router",
    "start_behind_router",
    "start_manager_actor",
]


class ModelManager(Protocol):
    """One model's manager, wherever it runs: the methods an
    :class:`~relax_core.manager.InferenceManager` and a :class:`ManagerActor` share, with the
    same signatures and results. See :class:`~relax_core.manager.InferenceManager` for what
    each does.

    Not in it: the in-process extras (``weight_version`` is a property in process and a query
    method on the actor; ``replicas``, ``launch_specs``, ``control_channel``) and the actor's
    own queries (``ping``, ``weight_version()``, ``router_url``, ``router_pids``).
    """

    # -- lifecycle

    def start(self) -> LifecycleResult: ...

    def onload(
        self, tags: Iterable[str] | None = None, *, engine_ids: Iterable[str] | None = None
    ) -> LifecycleResult: ...

    def offload(
        self,
        tags: Iterable[str] | None = None,
        *,
        engine_ids: Iterable[str] | None = None,
        abort: bool = False,
    ) -> LifecycleResult: ...

    def health_check(self, *, recover: bool = True) -> HealthReport: ...

    def recover(self) -> LifecycleResult: ...

    def confirm_external_cleanup(self, engine_ids: Iterable[str] | None = None) -> list[str]: ...

    def scale_out(
        self,
        workers: Sequence[Sequence[Sequence[int]]] | None = None,
        *,
        count: int | None = None,
        placement_group: Any = None,
        owned: bool = False,
    ) -> LifecycleResult: ...

    def scale_in(
        self, *, count: int | None = None, urls: Sequence[str] | None = None
    ) -> LifecycleResult: ...

    def shutdown(self) -> None: ...

    # -- weights

    def update_weights_from_tensor(
        self,
        serialized_named_tensors: Sequence[str],
        *,
        load_format: str | None = None,
        weight_version: str | None = None,
        flush_cache: bool = True,
        pause: str | None = None,
        buckets: Sequence[Sequence[str]] = (),
    ) -> LifecycleResult: ...

    def update_weights_from_disk(
        self, model_path: str, *, weight_version: str | None = None, load_format: str | None = None
    ) -> LifecycleResult: ...

    def update_weights_from_distributed(
        self,
        names: Sequence[str],
        dtypes: Sequence[str],
        shapes: Sequence[Sequence[int]],
        *,
        group_name: str = "weight_update_group",
        weight_version: str | None = None,
        load_format: str | None = None,
        buckets: Sequence[WeightBucket] = (),
    ) -> LifecycleResult: ...

    def init_weights_update_group(
        self,
        *,
        master_address: str,
        master_port: int,
        rank_offsets: Sequence[int],
        world_size: int,
        group_name: str = "weight_update_group",
        backend: str = "nccl",
    ) -> LifecycleResult: ...

    def destroy_weights_update_group(
        self, group_name: str = "weight_update_group"
    ) -> LifecycleResult: ...

    def load_lora_adapter(self, lora_name: str, lora_path: str) -> LifecycleResult: ...

    def unload_lora_adapter(self, lora_name: str) -> LifecycleResult: ...

    def load_checkpoint(self, version: int | None = None) -> LifecycleResult: ...

    # -- queries

    def republish(self) -> None: ...

    def states(self) -> dict[str, str]: ...

    def engine_pids(self) -> dict[str, list[int | None]]: ...

    def admission_states(self) -> dict[str, dict[str, Any]]: ...

    def model_view(self) -> ModelView: ...

    def workers(self, engine_id: str) -> list[WorkerSlot]: ...

    def unconfirmed_workers(self) -> list[UnconfirmedWorker]: ...


class _Startable(Protocol):
    """What :func:`start_behind_router` needs of a manager (external engines have it too)."""

    def start(self) -> LifecycleResult: ...

    def shutdown(self) -> None: ...


def start_behind_router(
    manager: _Startable, router: RouterProcess | None, *, timeout: float, name: str
) -> LifecycleResult:
    """Make ``router`` ready (if any), then start the manager's engines; once READY, the
    router must hold the model's heads. ``name`` names the model in errors. Blocking.

    :raises ConfigError: the router drops a request field the roles send (no engine started).
    :raises LifecycleError: the router did not start, or did not take the model's heads.
    """
    if router is not None:
        router.wait_ready(timeout)
    result = manager.start()
    if router is not None and result.ok:
        trouble = router.check()
        if trouble:
            raise LifecycleError(
                f"the router of {name} ({router.url}) did not take the model's heads:\n  "
                + "\n  ".join(trouble)
            )
    return result


def shutdown_behind_router(manager: _Startable, router: RouterProcess | None) -> None:
    """Shut the manager down, then stop its router, whatever the shutdown raised (it took its
    heads out of the router first). Raises what the manager's shutdown raised."""
    try:
        manager.shutdown()
    finally:
        if router is not None:
            # Stopped last, when no traffic is left: a short grace is enough (smg would
            # otherwise linger for its drain settle time).
            router.terminate(3.0)


def manager_actor_name(job: str, role: str, model_id: str) -> str:
    """The actor name of ``role``'s model ``model_id`` in job ``job``."""
    return f"relax-manager-{job}-{role}-{model_id}"


class ManagerActor:
    """One model's InferenceManager inside a Ray actor: a :class:`ModelManager` whose every
    method forwards to it, plus the actor's own queries.

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
        self._router: RouterProcess | None = None
        self._router_timeout = router_timeout
        if router_backend is not None:
            if router_spec is None:
                raise ValueError(f"model {model_id!r}: router_backend needs a router_spec")
            self._router = router_backend.launch(router_spec)
            kwargs.update(router=self._router, router_url=self._router.url)
        try:
            self._manager = InferenceManager(model_id, **kwargs)
        except BaseException:
            if self._router is not None:
                self._router.terminate(3.0)
            raise

    # -- lifecycle ---------------------------------------------------------------------------

    def start(self) -> LifecycleResult:
        """See :func:`start_behind_router`."""
        return start_behind_router(
            self._manager,
            self._router,
            timeout=self._router_timeout,
            name=f"model {self._manager.model_id!r}",
        )

    def onload(
        self, tags: Iterable[str] | None = None, *, engine_ids: Iterable[str] | None = None
    ) -> LifecycleResult:
        return self._manager.onload(tags, engine_ids=engine_ids)

    def offload(
        self,
        tags: Iterable[str] | None = None,
        *,
        engine_ids: Iterable[str] | None = None,
        abort: bool = False,
    ) -> LifecycleResult:
        return self._manager.offload(tags, engine_ids=engine_ids, abort=abort)

    def health_check(self, *, recover: bool = True) -> HealthReport:
        return self._manager.health_check(recover=recover)

    def recover(self) -> LifecycleResult:
        return self._manager.recover()

    def confirm_external_cleanup(self, engine_ids: Iterable[str] | None = None) -> list[str]:
        return self._manager.confirm_external_cleanup(engine_ids)

    def scale_out(
        self,
        workers: Sequence[Sequence[Sequence[int]]] | None = None,
        *,
        count: int | None = None,
        placement_group: Any = None,
        owned: bool = False,
    ) -> LifecycleResult:
        return self._manager.scale_out(
            workers, count=count, placement_group=placement_group, owned=owned
        )

    def scale_in(
        self, *, count: int | None = None, urls: Sequence[str] | None = None
    ) -> LifecycleResult:
        return self._manager.scale_in(count=count, urls=urls)

    def shutdown(self) -> None:
        """See :func:`shutdown_behind_router`."""
        shutdown_behind_router(self._manager, self._router)

    # -- weights -----------------------------------------------------------------------------

    def update_weights_from_tensor(
        self,
        serialized_named_tensors: Sequence[str],
        *,
        load_format: str | None = None,
        weight_version: str | None = None,
        flush_cache: bool = True,
        pause: str | None = None,
        buckets: Sequence[Sequence[str]] = (),
    ) -> LifecycleResult:
        return self._manager.update_weights_from_tensor(
            serialized_named_tensors,
            load_format=load_format,
            weight_version=weight_version,
            flush_cache=flush_cache,
            pause=pause,
            buckets=buckets,
        )

    def update_weights_from_disk(
        self, model_path: str, *, weight_version: str | None = None, load_format: str | None = None
    ) -> LifecycleResult:
        return self._manager.update_weights_from_disk(
            model_path, weight_version=weight_version, load_format=load_format
        )

    def update_weights_from_distributed(
        self,
        names: Sequence[str],
        dtypes: Sequence[str],
        shapes: Sequence[Sequence[int]],
        *,
        group_name: str = "weight_update_group",
        weight_version: str | None = None,
        load_format: str | None = None,
        buckets: Sequence[WeightBucket] = (),
    ) -> LifecycleResult:
        return self._manager.update_weights_from_distributed(
            names,
            dtypes,
            shapes,
            group_name=group_name,
            weight_version=weight_version,
            load_format=load_format,
            buckets=buckets,
        )

    def init_weights_update_group(
        self,
        *,
        master_address: str,
        master_port: int,
        rank_offsets: Sequence[int],
        world_size: int,
        group_name: str = "weight_update_group",
        backend: str = "nccl",
    ) -> LifecycleResult:
        return self._manager.init_weights_update_group(
            master_address=master_address,
            master_port=master_port,
            rank_offsets=rank_offsets,
            world_size=world_size,
            group_name=group_name,
            backend=backend,
        )

    def destroy_weights_update_group(
        self, group_name: str = "weight_update_group"
    ) -> LifecycleResult:
        return self._manager.destroy_weights_update_group(group_name)

    def load_lora_adapter(self, lora_name: str, lora_path: str) -> LifecycleResult:
        return self._manager.load_lora_adapter(lora_name, lora_path)

    def unload_lora_adapter(self, lora_name: str) -> LifecycleResult:
        return self._manager.unload_lora_adapter(lora_name)

    def load_checkpoint(self, version: int | None = None) -> LifecycleResult:
        return self._manager.load_checkpoint(version)

    # -- queries -----------------------------------------------------------------------------

    def republish(self) -> None:
        """Publish the model's state again (after the registry marked it UNKNOWN)."""
        self._manager.republish()

    def states(self) -> dict[str, str]:
        return self._manager.states()

    def engine_pids(self) -> dict[str, list[int | None]]:
        return self._manager.engine_pids()

    def admission_states(self) -> dict[str, dict[str, Any]]:
        return self._manager.admission_states()

    def model_view(self) -> ModelView:
        return self._manager.model_view()

    def workers(self, engine_id: str) -> list[WorkerSlot]:
        return self._manager.workers(engine_id)

    def unconfirmed_workers(self) -> list[UnconfirmedWorker]:
        return self._manager.unconfirmed_workers()

    # -- the actor's own queries ---------------------------------------------------------

    def ping(self) -> str:
        """The model id; takes no lock (the registry's liveness check)."""
        return self._manager.model_id

    def weight_version(self) -> str | None:
        """The manager's published weight version (a property in process)."""
        return self._manager.weight_version

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


if TYPE_CHECKING:
    # mypy checks both implementations against the contract (a test checks the signatures).

    def _in_process(manager: InferenceManager) -> ModelManager:
        return manager

    def _in_an_actor(actor: ManagerActor) -> ModelManager:
        return actor

"""A model's manager: its API written once (:class:`ModelManager`), one core
(:class:`ManagerActor`: the manager, its router and a few queries of its own, in a Ray actor or
in this process), two clients (:class:`InProcessManager`, :class:`RayManager`); every forwarder
is generated from the Protocol (:func:`relax_core._proxy.generate`)."""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import TYPE_CHECKING, Any, Protocol

from relax_core._proxy import generate, remote_errors
from relax_core.discovery.schema import ModelView
from relax_core.engine.buckets import WeightBucket
from relax_core.errors import LifecycleError
from relax_core.manager.external import ExternalEngines
from relax_core.manager.manager import InferenceManager
from relax_core.manager.results import HealthReport, LifecycleResult, UnconfirmedWorker
from relax_core.manager.slots import WorkerSlot
from relax_core.records import RouterBackend, RouterLaunchSpec, RouterProcess


class ModelManager(Protocol):
    """One model's manager, wherever it runs: the methods an
    :class:`~relax_core.manager.InferenceManager` and a :class:`ManagerActor` share (see the
    former for what each does)."""

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


def manager_actor_name(job: str, role: str, model_id: str) -> str:
    """The actor name of ``role``'s model ``model_id`` in job ``job``."""
    return f"relax-manager-{job}-{role}-{model_id}"


class HostedManager(ModelManager, Protocol):
    """A :class:`ModelManager` where callers reach it (:class:`ManagerActor` and its two
    clients): the manager's API and the host's own queries."""

    def ping(self) -> str:
        """The model id; takes no lock (the registry's liveness check)."""

    def weight_version(self) -> str | None:
        """The manager's published weight version (a property of the manager itself)."""

    def router_url(self) -> str | None:
        """The URL of the model's router, if any."""

    def router_pids(self) -> list[int]:
        """The process ids of the model's router (empty without one, or once stopped)."""


if TYPE_CHECKING:
    # The generated methods are invisible to mypy: it sees the Protocol's instead.
    _Hosted = HostedManager
else:
    _Hosted = object


#: Seconds a manager's start waits for its router to be ready.
_ROUTER_TIMEOUT = 60.0


def _to_manager(name: str) -> Callable[..., Any]:
    def method(self: ManagerActor, *args: Any, **kwargs: Any) -> Any:
        return getattr(self._manager, name)(*args, **kwargs)

    return method


def _to_call(name: str) -> Callable[..., Any]:
    def method(self: InProcessManager | RayManager, *args: Any, **kwargs: Any) -> Any:
        return self.call(name, *args, **kwargs)

    return method


@generate(ModelManager, _to_manager)
class ManagerActor(_Hosted):
    """One model's manager and its router, in a Ray actor (:func:`start_manager_actor`) or
    in this process (:func:`host_manager`).

    Arguments are :class:`~relax_core.manager.InferenceManager`'s (a subclass's
    ``_manager_class``'s), plus ``router_backend`` / ``router_spec`` (an ``SGLANG_ROUTER``
    model's router, launched here; :meth:`start` waits up to 60 s for it)."""

    _manager_class: Callable[..., Any] = InferenceManager

    def __init__(
        self,
        model_id: str,
        *,
        router_backend: RouterBackend | None = None,
        router_spec: RouterLaunchSpec | None = None,
        **kwargs: Any,
    ) -> None:
        self._router: RouterProcess | None = None
        self._name = f"model {model_id!r}"
        if router_backend is not None:
            if router_spec is None:
                raise ValueError(f"model {model_id!r}: router_backend needs a router_spec")
            self._router = router_backend.launch(router_spec)
            kwargs.update(router=self._router, router_url=self._router.url)
        try:
            self._manager: Any = self._manager_class(model_id, **kwargs)
        except BaseException:
            if self._router is not None:
                self._router.terminate(3.0)
            raise

    def start(self) -> LifecycleResult:
        """Make the router ready (if any), then start the manager's engines; once READY, the
        router must hold the model's heads. Blocking.
        :raises ConfigError: the router drops a request field the roles send (no engine started).
        :raises LifecycleError: the router did not start, or did not take the model's heads."""
        router = self._router
        if router is not None:
            router.wait_ready(_ROUTER_TIMEOUT)
        result: LifecycleResult = self._manager.start()
        if router is not None and result.ok and (trouble := router.check()):
            raise LifecycleError(
                f"the router of {self._name} ({router.url}) did not take the model's heads:"
                "\n  " + "\n  ".join(trouble)
            )
        return result

    def shutdown(self) -> None:
        """Shut the manager down, then stop its router, whatever the shutdown raised (it took
        its heads out of the router first). Raises what the manager's shutdown raised."""
        try:
            self._manager.shutdown()
        finally:
            if self._router is not None:
                # No traffic is left: a short grace (smg would linger for its drain time).
                self._router.terminate(3.0)

    # -- the host's own queries ------------------------------------------------------------

    def ping(self) -> str:
        """See :meth:`HostedManager.ping`."""
        return str(self._manager.model_id)

    def weight_version(self) -> str | None:
        """See :meth:`HostedManager.weight_version`."""
        version: str | None = self._manager.weight_version
        return version

    def router_url(self) -> str | None:
        """See :meth:`HostedManager.router_url`."""
        return None if self._router is None else str(self._router.url)

    def router_pids(self) -> list[int]:
        """See :meth:`HostedManager.router_pids`."""
        return [] if self._router is None else list(self._router.pids())


def host_manager(
    manager: InferenceManager | ExternalEngines,
    *,
    router: RouterProcess | None = None,
    name: str | None = None,
) -> ManagerActor:
    """The core around a manager of this process and its router (``relax serve``)."""
    cls: Any = ManagerActor  # built without __init__ (that builds a manager of its own)
    core: ManagerActor = cls.__new__(cls)
    core._manager = manager
    core._router = router
    core._name = name or f"model {manager.model_id!r}"
    return core


@generate(HostedManager, _to_call)
class InProcessManager(_Hosted):
    """The in-process client of a :class:`ManagerActor` core: each :class:`HostedManager`
    method calls it here (blocking); :meth:`acall` runs a call in a worker thread."""

    def __init__(self, core: ManagerActor, *, name: str | None = None) -> None:
        self.core = core
        self.name = name or core.ping()

    def call(self, method: str, /, *args: Any, **kwargs: Any) -> Any:
        """``core.method(*args, **kwargs)``."""
        return getattr(self.core, method)(*args, **kwargs)

    async def acall(self, method: str, /, *args: Any, **kwargs: Any) -> Any:
        """:meth:`call` in a worker thread (the event loop goes on)."""
        return await asyncio.to_thread(self.call, method, *args, **kwargs)


@generate(HostedManager, _to_call)
class RayManager(_Hosted):
    """The Ray client of a :class:`ManagerActor`: each :class:`HostedManager` method calls
    the actor and waits (up to ``timeouts[method]`` seconds, if given).

    The manager's own errors reach the caller as themselves; a dead actor, a timeout or
    another failure as a ``LifecycleError`` naming ``name`` and the method."""

    def __init__(
        self, actor: Any, *, name: str, timeouts: Mapping[str, float] | None = None
    ) -> None:
        self.actor = actor
        self.name = name
        self.timeouts = dict(timeouts or {})

    def call(self, method: str, /, *args: Any, **kwargs: Any) -> Any:
        """``ray.get(actor.method.remote(*args, **kwargs))``, the error unwrapped."""
        import ray

        timeout = self.timeouts.get(method)
        with remote_errors(self._error(method), actor="its manager actor", timeout=timeout):
            return ray.get(getattr(self.actor, method).remote(*args, **kwargs), timeout=timeout)

    async def acall(self, method: str, /, *args: Any, **kwargs: Any) -> Any:
        """``await actor.method.remote(*args, **kwargs)``, the error unwrapped."""
        with remote_errors(self._error(method), actor="its manager actor"):
            return await getattr(self.actor, method).remote(*args, **kwargs)

    def _error(self, method: str) -> Callable[[str], LifecycleError]:
        return lambda why: LifecycleError(f"{self.name}: {method}(): {why}")


def start_manager_actor(
    model_id: str,
    *,
    name: str | None = None,
    namespace: str | None = None,
    max_concurrency: int = 8,
    actor_class: type[object] = ManagerActor,
    **kwargs: Any,
) -> Any:
    """Create an ``actor_class`` for ``model_id`` (``kwargs``: its arguments) on the
    connected Ray, reserving no CPU and no GPU; return its handle, not started.

    Bad arguments raise here (the ``RayActorError`` of its construction). A registry
    ``publisher`` watches the actor and publishes the model UNKNOWN once it is gone."""
    import ray

    options: dict[str, Any] = {"num_cpus": 0, "num_gpus": 0, "max_restarts": 0}
    if name is not None:
        options.update(name=name, namespace=namespace)
    options["max_concurrency"] = max_concurrency
    actor: Any = ray.remote(actor_class).options(**options).remote(model_id, **kwargs)
    ray.get(actor.states.remote(), timeout=60)
    watch = getattr(kwargs.get("publisher"), "watch_manager", None)
    if watch is not None:
        watch(model_id, actor)
    return actor


if TYPE_CHECKING:  # mypy checks the manager and the core against the contract
    _CORES: tuple[type[ModelManager], ...] = (InferenceManager, ManagerActor)

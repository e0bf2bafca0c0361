"""The coordinator as a CPU-only Ray actor (:func:`start_coordinator`,
:func:`connect_coordinator`) and :class:`RemoteCoordinator`, its client: each ``Coordinator``
call forwarded, an error raised in the actor re-raised as itself."""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import TYPE_CHECKING, Any

from relax_core._proxy import generate, remote_errors
from relax_core.coordination.coordinator import (
    DEFAULT_OPERATION_TIMEOUT,
    Coordinator,
    LifecycleCoordinator,
)
from relax_core.coordination.handles import RayManagerHandle
from relax_core.coordination.residency import ResidencyPlan
from relax_core.errors import CoordinationError

#: The Ray namespace of every job's coordinator actor.
NAMESPACE = "relax"


def coordinator_name(job: str) -> str:
    """The coordinator actor's name for job ``job``: ``relax-coordinator-<job>``."""
    return f"relax-coordinator-{job}"


class CoordinatorActor(LifecycleCoordinator):
    """The LifecycleCoordinator a Ray async actor hosts; ``managers``: role ->
    ``[(name, manager actor), …]``, the other settings the LifecycleCoordinator's."""

    def __init__(self, *, managers: Mapping[str, Sequence[tuple[str, Any]]], **settings: Any):
        handles = {
            role: [RayManagerHandle(actor, name=name) for name, actor in pairs]
            for role, pairs in managers.items()
        }
        super().__init__(managers=handles, **settings)


if TYPE_CHECKING:  # the generated methods are invisible to mypy: it sees the Protocol's
    _Contract = Coordinator
else:
    _Contract = object


def _to_actor(name: str) -> Callable[..., Any]:
    async def method(self: RemoteCoordinator, *args: Any, **kwargs: Any) -> Any:
        return await self._call(name, *args, **kwargs)

    return method


@generate(Coordinator, _to_actor)
class RemoteCoordinator(_Contract):
    """The ``Coordinator`` over a :class:`CoordinatorActor` handle (picklable), each method
    generated from the Protocol."""

    def __init__(self, actor: Any) -> None:
        self.actor = actor

    async def _call(self, method: str, *args: Any, **kwargs: Any) -> Any:
        def error(why: str) -> CoordinationError:
            return CoordinationError(f"coordinator {method}: {why}; the run cannot go on")

        with remote_errors(error, actor="the coordinator actor"):
            return await getattr(self.actor, method).remote(*args, **kwargs)

    def stop(self) -> None:
        """Kill the coordinator actor. Idempotent."""
        import ray

        ray.kill(self.actor, no_restart=True)


def start_coordinator(
    job: str,
    *,
    slices: Mapping[str, str],
    managers: Mapping[str, Sequence[tuple[str, Any]]],
    generation_role: str,
    operation_timeout: float = DEFAULT_OPERATION_TIMEOUT,
    residency: ResidencyPlan | None = None,
) -> RemoteCoordinator:
    """Create job ``job``'s coordinator actor on the connected Ray (CPU-only, no GPU).

    :param managers: role -> ``[(name, manager actor), …]`` (see
        :func:`relax_core.manager.actor.start_manager_actor`).
    :param residency: which roles of a slice may hold it at once (default: one at a time).
    :raises CoordinationError: a coordinator of that job already exists."""
    import ray

    name = coordinator_name(job)
    try:
        ray.get_actor(name, namespace=NAMESPACE)
    except ValueError:
        pass
    else:
        raise CoordinationError(
            f"a coordinator {name!r} already runs in namespace {NAMESPACE!r}; stop it or use "
            "another job name"
        )
    options = {"num_cpus": 0, "num_gpus": 0, "max_restarts": 0, "max_concurrency": 1000}
    actor: Any = (
        ray.remote(CoordinatorActor)
        .options(name=name, namespace=NAMESPACE, **options)
        .remote(
            slices=dict(slices),
            managers={role: list(h) for role, h in managers.items()},
            generation_role=generation_role,
            operation_timeout=operation_timeout,
            residency=residency,
        )
    )
    coordinator = RemoteCoordinator(actor)  # type: ignore[abstract]  # generated methods
    ray.get(actor.describe.remote(), timeout=60)  # constructed (and its arguments valid)
    return coordinator


def connect_coordinator(job: str) -> RemoteCoordinator:
    """Job ``job``'s running coordinator.

    :raises CoordinationError: there is none on the connected Ray."""
    import ray

    name = coordinator_name(job)
    try:
        return RemoteCoordinator(ray.get_actor(name, namespace=NAMESPACE))  # type: ignore[abstract]
    except ValueError:
        raise CoordinationError(
            f"no coordinator {name!r} in Ray namespace {NAMESPACE!r} on this cluster; is job "
            f"{job!r} running (and is this its Ray address)?"
        ) from None


if TYPE_CHECKING:  # mypy checks the client and the actor (so the in-process one) against it
    _CLIENTS: tuple[type[Coordinator], ...] = (RemoteCoordinator, CoordinatorActor)

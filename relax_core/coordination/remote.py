"""The coordinator as a CPU-only Ray actor, and the client every process of a job uses.

:func:`start_coordinator` creates the named async actor ``relax-coordinator-<job>`` (namespace
``relax``; no CPU, no GPU reserved) around a
:class:`~relax_core.coordination.coordinator.LifecycleCoordinator` whose deferred roles'
managers are Ray actors (:mod:`relax_core.manager.actor`): :class:`CoordinatorActor` *is* that
coordinator (a subclass that only wraps the handles), so the actor's methods are never written
out again. :class:`RemoteCoordinator` is the
:class:`~relax_core.coordination.coordinator.Coordinator` of every other process: it forwards
each call (``await actor.method.remote(...)``, the same arguments); an error raised in the
actor is re-raised as itself (a :class:`~relax_core.errors.BatchFailedError`, not a Ray
wrapper). :func:`connect_coordinator`
finds a job's coordinator by name — that is how ``relax coordinator status|reset`` reaches it.

Nothing here is an HTTP route: activate, deactivate, commit and reset are Ray calls only.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any

from relax_core._ray import remote_errors
from relax_core.coordination.coordinator import (
    DEFAULT_OPERATION_TIMEOUT,
    Coordinator,
    CoordinatorStatus,
    LifecycleCoordinator,
)
from relax_core.coordination.handles import RayManagerHandle
from relax_core.coordination.residency import ResidencyPlan
from relax_core.coordination.sink import SinkReceipt
from relax_core.coordination.states import BatchState, LeaseState
from relax_core.errors import CoordinationError

__all__ = [
    "NAMESPACE",
    "CoordinatorActor",
    "RemoteCoordinator",
    "connect_coordinator",
    "coordinator_name",
    "start_coordinator",
]

#: The Ray namespace of every job's coordinator actor.
NAMESPACE = "relax"


def coordinator_name(job: str) -> str:
    """The coordinator actor's name for job ``job``: ``relax-coordinator-<job>``."""
    return f"relax-coordinator-{job}"


class CoordinatorActor(LifecycleCoordinator):
    """The coordinator a Ray actor hosts (an async actor: every method runs on its loop): a
    :class:`~relax_core.coordination.coordinator.LifecycleCoordinator` whose deferred roles'
    managers are manager actors.

    :param managers: role -> ``[(name, manager actor handle), …]``.
    """

    def __init__(
        self,
        *,
        slices: Mapping[str, str],
        managers: Mapping[str, Sequence[tuple[str, Any]]],
        generation_role: str,
        operation_timeout: float,
        residency: ResidencyPlan | None = None,
    ) -> None:
        super().__init__(
            slices=slices,
            managers={
                role: [RayManagerHandle(actor, name=name) for name, actor in handles]
                for role, handles in managers.items()
            },
            generation_role=generation_role,
            operation_timeout=operation_timeout,
            residency=residency,
        )


class RemoteCoordinator:
    """The :class:`~relax_core.coordination.coordinator.Coordinator` over a
    :class:`CoordinatorActor` handle (picklable): each call forwarded with its arguments."""

    def __init__(self, actor: Any) -> None:
        self.actor = actor

    async def _call(self, method: str, *args: Any, **kwargs: Any) -> Any:
        def error(why: str) -> CoordinationError:
            return CoordinationError(f"coordinator {method}: {why}; the run cannot go on")

        with remote_errors(error, actor="the coordinator actor"):
            return await getattr(self.actor, method).remote(*args, **kwargs)

    async def begin_batch(self, batch_id: int) -> BatchState:
        """See :meth:`LifecycleCoordinator.begin_batch`."""
        state: BatchState = await self._call("begin_batch", batch_id)
        return state

    async def acknowledge_rollout_offloaded(self, batch_id: int, result: Any) -> LeaseState:
        """See :meth:`LifecycleCoordinator.acknowledge_rollout_offloaded`."""
        state: LeaseState = await self._call("acknowledge_rollout_offloaded", batch_id, result)
        return state

    async def begin_student_scoring(self, batch_id: int) -> LeaseState:
        """See :meth:`LifecycleCoordinator.begin_student_scoring`."""
        state: LeaseState = await self._call("begin_student_scoring", batch_id)
        return state

    async def activate(
        self, role: str, operation_id: str, *, batch_id: int, models: Sequence[str] = ()
    ) -> LeaseState:
        """See :meth:`LifecycleCoordinator.activate`."""
        state: LeaseState = await self._call(
            "activate", role, operation_id, batch_id=batch_id, models=tuple(models)
        )
        return state

    async def deactivate(self, role: str, operation_id: str, *, batch_id: int) -> LeaseState:
        """See :meth:`LifecycleCoordinator.deactivate`."""
        state: LeaseState = await self._call("deactivate", role, operation_id, batch_id=batch_id)
        return state

    async def fail_batch(
        self, batch_id: int, error: str, *, release_unconfirmed: bool = False
    ) -> BatchState:
        """See :meth:`LifecycleCoordinator.fail_batch`."""
        state: BatchState = await self._call(
            "fail_batch", batch_id, str(error), release_unconfirmed=release_unconfirmed
        )
        return state

    async def commit_batch(self, batch_id: int, receipt: SinkReceipt) -> BatchState:
        """See :meth:`LifecycleCoordinator.commit_batch`."""
        state: BatchState = await self._call("commit_batch", batch_id, receipt)
        return state

    async def wait_committed(self, batch_id: int, timeout: float | None = None) -> SinkReceipt:
        """See :meth:`LifecycleCoordinator.wait_committed`."""
        receipt: SinkReceipt = await self._call("wait_committed", batch_id, timeout)
        return receipt

    async def reset_blocked(self, role: str, *, confirm_clean: bool = False) -> LeaseState:
        """See :meth:`LifecycleCoordinator.reset_blocked` (operators only)."""
        state: LeaseState = await self._call("reset_blocked", role, confirm_clean=confirm_clean)
        return state

    async def describe(self) -> CoordinatorStatus:
        """See :meth:`LifecycleCoordinator.describe`."""
        status: CoordinatorStatus = await self._call("describe")
        return status

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
    :raises CoordinationError: a coordinator of that job already exists.
    """
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
    actor: Any = (
        ray.remote(CoordinatorActor)
        .options(
            name=name,
            namespace=NAMESPACE,
            num_cpus=0,
            num_gpus=0,
            max_restarts=0,
            max_concurrency=1000,
        )
        .remote(
            slices=dict(slices),
            managers={role: list(h) for role, h in managers.items()},
            generation_role=generation_role,
            operation_timeout=operation_timeout,
            residency=residency,
        )
    )
    coordinator = RemoteCoordinator(actor)
    ray.get(actor.describe.remote(), timeout=60)  # constructed (and its arguments valid)
    return coordinator


def connect_coordinator(job: str) -> RemoteCoordinator:
    """Job ``job``'s running coordinator.

    :raises CoordinationError: there is none on the connected Ray.
    """
    import ray

    name = coordinator_name(job)
    try:
        return RemoteCoordinator(ray.get_actor(name, namespace=NAMESPACE))
    except ValueError:
        raise CoordinationError(
            f"no coordinator {name!r} in Ray namespace {NAMESPACE!r} on this cluster; is job "
            f"{job!r} running (and is this its Ray address)?"
        ) from None


if TYPE_CHECKING:
    # mypy checks the client and the actor against the contract.

    def _client(coordinator: RemoteCoordinator) -> Coordinator:
        return coordinator

    def _actor(actor: CoordinatorActor) -> Coordinator:
        return actor

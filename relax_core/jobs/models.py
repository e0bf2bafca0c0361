"""A model of a job as the runtime drives it (:class:`ModelHandle`): in this process
(:class:`LocalModel`) or in a manager actor (:class:`RayModel`), each over a client of the
manager's core. Every call blocks; errors are the manager's own."""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any, Protocol

from relax_core._proxy import generate
from relax_core.manager import InferenceManager, LifecycleResult, UnconfirmedWorker
from relax_core.manager.actor import HostedManager, InProcessManager, RayManager, host_manager
from relax_core.manager.external import ExternalEngines
from relax_core.records import RouterProcess


class ModelHandle(Protocol):
    """One model of a job: what starting in phases, putting to sleep and teardown need;
    ``key`` is ``role.model``."""

    @property
    def role(self) -> str: ...
    @property
    def model_id(self) -> str: ...
    @property
    def key(self) -> str: ...

    def start(self) -> LifecycleResult:
        """Start the model's engines (behind its router, if any); per-replica results.
        :raises RelaxError: the router did not start or take the heads, or the start failed."""

    def offload(self) -> LifecycleResult:
        """Put every replica to sleep (its spec's ``offload_tags``); per-replica results."""

    def shutdown(self) -> None:
        """Stop the engines and the worker actors, then the router.
        :raises RelaxError: a step was not confirmed (a fenced worker, a pending shutdown)."""

    def engine_pids(self) -> dict[str, list[int | None]]:
        """Engine id -> the engine process id of each worker (head first)."""

    def router_pids(self) -> list[int]:
        """The process ids of the model's router (empty without one)."""

    def unconfirmed_workers(self) -> list[UnconfirmedWorker]:
        """The workers whose cleanup is not confirmed: their placement groups are kept."""

    def close(self) -> None:
        """Let go of the manager's host once shut down (its actor is killed). Idempotent."""


def _to_client(name: str) -> Callable[..., Any]:
    def method(self: _Model, *args: Any, **kwargs: Any) -> Any:
        return getattr(self.client, name)(*args, **kwargs)

    return method


if TYPE_CHECKING:  # the generated methods are invisible to mypy: it sees the Protocol's
    _Contract = ModelHandle
else:
    _Contract = object


@generate(ModelHandle, _to_client)
class _Model(_Contract):
    """One model of a job over a client of its manager's core (what both homes share): each
    :class:`ModelHandle` method is the client's method of that name."""

    def __init__(self, role: str, model_id: str, client: HostedManager) -> None:
        self._role = role
        self._model_id = model_id
        self.client = client

    @property
    def role(self) -> str:
        """The model's role."""
        return self._role

    @property
    def model_id(self) -> str:
        """The model's id in its role."""
        return self._model_id

    @property
    def key(self) -> str:
        """``role.model``."""
        return f"{self._role}.{self._model_id}"


class LocalModel(_Model):
    """A model whose manager runs in this process (an :class:`InferenceManager`, or
    :class:`ExternalEngines` for engines started by someone else), and its router."""

    def __init__(
        self,
        role: str,
        model_id: str,
        manager: InferenceManager | ExternalEngines,
        *,
        router: RouterProcess | None = None,
    ) -> None:
        key = f"{role}.{model_id}"
        core = host_manager(manager, router=router, name=key)
        super().__init__(role, model_id, InProcessManager(core, name=key))  # type: ignore[abstract]
        self.manager = manager
        self.router = router

    def close(self) -> None:
        """Nothing to let go of: the manager is an object of this process."""


class RayModel(_Model):
    """A model whose manager a :class:`~relax_core.manager.actor.ManagerActor` hosts;
    :meth:`shutdown` waits up to ``shutdown_timeout``, each query up to 60 s."""

    def __init__(
        self, role: str, model_id: str, actor: Any, *, shutdown_timeout: float = 120.0
    ) -> None:
        timeouts = dict.fromkeys(("engine_pids", "router_pids", "unconfirmed_workers"), 60.0)
        timeouts["shutdown"] = shutdown_timeout
        client = RayManager(actor, name=f"{role}.{model_id}", timeouts=timeouts)  # type: ignore[abstract]
        super().__init__(role, model_id, client)
        self.actor = actor

    def close(self) -> None:
        """Kill the manager actor. Idempotent."""
        import ray

        ray.kill(self.actor, no_restart=True)


if TYPE_CHECKING:  # mypy checks both homes against the contract
    _HOMES: tuple[type[ModelHandle], ...] = (LocalModel, RayModel)

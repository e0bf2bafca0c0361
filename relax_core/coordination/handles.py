"""Manager handles: how the coordinator and a deferred batch reach a model's InferenceManager.

A handle is anything with ``async onload()`` and ``async offload()`` returning a
:class:`~relax_core.manager.LifecycleResult` (one result per replica); one that also has
``async abort_and_offload()`` lets a failed or interrupted batch release its role without
waiting for requests nobody wants any more. One adapter, :class:`ClientHandle`, over either
client of the manager's core (:mod:`relax_core.manager.actor`), built by:

- :class:`RayManagerHandle`: a manager living in a Ray actor
  (:mod:`relax_core.manager.actor`); the call is ``await actor.onload.remote()``. This is how
  the coordinator drives deferred roles.
- :class:`LocalManagerHandle`: a manager in this process; the blocking call runs in a worker
  thread. This is how the generation role offloads *itself* before it acknowledges to the
  coordinator (the coordinator never calls back into its caller, so there is no self-RPC
  deadlock).

:func:`unconfirmed` says whether a result proves the asked-for state on every replica.
"""

from __future__ import annotations

from typing import Any, Protocol, runtime_checkable

from relax_core.manager.actor import InProcessManager, RayManager, host_manager
from relax_core.manager.results import LifecycleResult, Outcome

__all__ = [
    "ClientHandle",
    "LocalManagerHandle",
    "ManagerHandle",
    "RayManagerHandle",
    "unconfirmed",
]


@runtime_checkable
class ManagerHandle(Protocol):
    """One model's manager, as the coordinator sees it. ``name`` is used in messages.

    Optional: ``async abort_and_offload() -> LifecycleResult``, an offload that aborts the
    requests in flight at once instead of draining them (the manager's ``offload(abort=True)``).
    The coordinator uses it to release a role for a FAILED batch, and ``offload()`` on a handle
    without it.
    """

    @property
    def name(self) -> str: ...

    async def onload(self) -> LifecycleResult:
        """Resume every tag on every replica; per-replica results."""
        ...

    async def offload(self) -> LifecycleResult:
        """Release every tag on every replica; per-replica results."""
        ...


def unconfirmed(result: object, expected: str) -> str | None:
    """Why ``result`` does not prove every replica is in state ``expected``; ``None`` if it does.

    A FAILED or SKIPPED replica, a replica left in another state, or something that is not a
    :class:`~relax_core.manager.LifecycleResult` is not a confirmation.
    """
    if not isinstance(result, LifecycleResult):
        return f"expected a LifecycleResult, got {type(result).__name__}"
    wrong = [
        f"{r.engine_id}: {r.outcome} {r.state}" + (f" ({r.error})" if r.error else "")
        for r in result.replicas
        if r.state != expected or r.outcome is Outcome.FAILED
    ]
    if wrong:
        return (
            f"{result.operation} of model {result.model_id!r}: {len(wrong)} of "
            f"{len(result.replicas)} replica(s) not {expected}: {'; '.join(wrong)}"
        )
    return None


class ClientHandle:
    """A :class:`ManagerHandle` over a client of a manager's core
    (:class:`~relax_core.manager.actor.InProcessManager` or
    :class:`~relax_core.manager.actor.RayManager`): each call is the client's, awaited.

    Besides the contract: ``abort_and_offload``, ``weight_version``, ``failed``,
    ``check_health`` and ``recover`` (the lease engine rebuilds a role's FAILED replicas before
    its next switch, and when a stage's request failed mid-run).
    Not idempotent by itself, but the manager's onload/offload are (a repeated call is a
    no-op per replica).
    """

    def __init__(self, client: InProcessManager | RayManager) -> None:
        self.client = client

    @property
    def name(self) -> str:
        """The model's name in messages (``role.model``, or the model id)."""
        return self.client.name

    async def onload(self) -> LifecycleResult:
        """The manager's ``onload()``: every tag on every replica."""
        result: LifecycleResult = await self.client.acall("onload")
        return result

    async def offload(self) -> LifecycleResult:
        """The manager's ``offload()``: every tag on every replica, requests drained."""
        result: LifecycleResult = await self.client.acall("offload")
        return result

    async def abort_and_offload(self) -> LifecycleResult:
        """The manager's ``offload(abort=True)``: the requests in flight are aborted, not
        drained."""
        result: LifecycleResult = await self.client.acall("offload", abort=True)
        return result

    async def weight_version(self) -> str | None:
        """The manager's published weight version."""
        version: str | None = await self.client.acall("weight_version")
        return version

    async def failed(self) -> list[str]:
        """The engine ids of the manager's FAILED replicas."""
        states: dict[str, str] = await self.client.acall("states")
        return [engine for engine, state in states.items() if state == "FAILED"]

    async def check_health(self) -> None:
        """The manager's ``health_check(recover=False)``: a replica whose engine process
        exited is FAILED now (its rebuild stays the lease engine's, :meth:`recover`)."""
        await self.client.acall("health_check", recover=False)

    async def recover(self) -> LifecycleResult:
        """The manager's ``recover()``: rebuild the FAILED replicas."""
        result: LifecycleResult = await self.client.acall("recover")
        return result


class LocalManagerHandle(ClientHandle):
    """A manager in this process; each call runs the blocking manager method in a thread."""

    def __init__(self, manager: Any, *, name: str | None = None) -> None:
        self.manager = manager
        name = name or str(getattr(manager, "model_id", "manager"))
        super().__init__(InProcessManager(host_manager(manager, name=name), name=name))  # type: ignore[abstract]


class RayManagerHandle(ClientHandle):
    """A manager hosted by a Ray actor (:func:`relax_core.manager.actor.start_manager_actor`).

    The Ray error of a failed call is re-raised as its cause when it has one (the manager's own
    :class:`~relax_core.errors.LifecycleError`), else as a ``LifecycleError`` naming the actor.
    """

    def __init__(self, actor: Any, *, name: str) -> None:
        self.actor = actor
        super().__init__(RayManager(actor, name=name))  # type: ignore[abstract]

"""Manager handles (:class:`ManagerHandle`): how the coordinator and a deferred batch reach a
model's manager, in a Ray actor (:class:`RayManagerHandle`) or in this process
(:class:`LocalManagerHandle`, its blocking calls in a worker thread)."""

from __future__ import annotations

from typing import Any, Protocol, cast, runtime_checkable

from relax_core.manager.actor import InProcessManager, RayManager, host_manager
from relax_core.manager.results import LifecycleResult, Outcome


@runtime_checkable
class ManagerHandle(Protocol):
    """One model's manager, as the coordinator sees it. Optional: ``abort_and_offload()``,
    which releases a FAILED batch's role without draining its requests."""

    @property
    def name(self) -> str: ...

    async def onload(self) -> LifecycleResult:
        """Resume every tag on every replica; per-replica results."""
        ...

    async def offload(self) -> LifecycleResult:
        """Release every tag on every replica; per-replica results."""
        ...


def unconfirmed(result: object, expected: str) -> str | None:
    """Why ``result`` does not prove every replica is in state ``expected``; ``None`` if it does
    (a FAILED replica, another state or not a LifecycleResult is no confirmation)."""
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
    """A :class:`ManagerHandle` over an ``InProcessManager`` or ``RayManager`` client: each
    call the manager's, awaited (onload and offload are idempotent per replica)."""

    def __init__(self, client: InProcessManager | RayManager) -> None:
        self.client = client

    @property
    def name(self) -> str:
        """The model's name in messages (``role.model``, or the model id)."""
        return self.client.name

    async def onload(self) -> LifecycleResult:
        """The manager's ``onload()``: every tag on every replica."""
        return cast("LifecycleResult", await self.client.acall("onload"))

    async def offload(self) -> LifecycleResult:
        """The manager's ``offload()``: its default tags on every replica, requests drained."""
        return cast("LifecycleResult", await self.client.acall("offload"))

    async def abort_and_offload(self) -> LifecycleResult:
        """The manager's ``offload(abort=True)``: requests in flight aborted, not drained."""
        return cast("LifecycleResult", await self.client.acall("offload", abort=True))

    async def weight_version(self) -> str | None:
        """The manager's published weight version."""
        return cast("str | None", await self.client.acall("weight_version"))

    async def failed(self) -> list[str]:
        """The engine ids of the manager's FAILED replicas."""
        states: dict[str, str] = await self.client.acall("states")
        return [engine for engine, state in states.items() if state == "FAILED"]

    async def check_health(self) -> None:
        """The manager's ``health_check(recover=False)``: a dead engine's replica FAILED now."""
        await self.client.acall("health_check", recover=False)

    async def recover(self) -> LifecycleResult:
        """The manager's ``recover()``: rebuild the FAILED replicas."""
        return cast("LifecycleResult", await self.client.acall("recover"))


class LocalManagerHandle(ClientHandle):
    """A manager in this process; each call runs the blocking manager method in a thread."""

    def __init__(self, manager: Any, *, name: str | None = None) -> None:
        self.manager = manager
        name = name or str(getattr(manager, "model_id", "manager"))
        super().__init__(InProcessManager(host_manager(manager, name=name), name=name))  # type: ignore[abstract]


class RayManagerHandle(ClientHandle):
    """A manager hosted by a Ray actor (:func:`relax_core.manager.actor.start_manager_actor`);
    a failed call raises the manager's own error, else a ``LifecycleError`` naming the actor."""

    def __init__(self, actor: Any, *, name: str) -> None:
        self.actor = actor
        super().__init__(RayManager(actor, name=name))  # type: ignore[abstract]
